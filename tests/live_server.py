"""`agent-server serve` as a real process for tests that are not async (sync client, chat)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


@dataclass
class LiveServer:
    process: subprocess.Popen[str]
    address: str
    # What the server wrote to stderr, once it has exited.
    stderr: str = ""


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment without ROLLOUT_* settings, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(extra)
    return env


@contextlib.contextmanager
def live_server(*args: str, **env: str) -> Iterator[LiveServer]:
    """Run `agent-server serve --listen 127.0.0.1:0 ARGS` until the block ends (then SIGTERM)."""
    process = subprocess.Popen(
        [AGENT_SERVER, "serve", "--listen", "127.0.0.1:0", *args],
        env=server_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        _, stderr = process.communicate()
        raise AssertionError(f"agent-server serve did not start: {line!r} {stderr}")
    served = LiveServer(process, line.removeprefix("listening on ").strip())
    try:
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        _, served.stderr = process.communicate(timeout=30)
