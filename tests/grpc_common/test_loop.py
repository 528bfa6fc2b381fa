"""run_on_loop and the event loop names: uvloop where installed, asyncio's own on request."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import signal
import subprocess
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import IO

import pytest

from grpc_common import (
    EVENT_LOOPS,
    default_event_loop,
    event_loop_problem,
    run_on_loop,
    running_event_loop,
)
from rollout_client import SyncAgentClient
from tests.commands import exec_argv
from trace_reducer import replay_bundle


async def _which() -> tuple[str, str]:
    return type(asyncio.get_running_loop()).__module__, running_event_loop()


def test_each_name_runs_its_loop() -> None:
    uv_module, uv_name = run_on_loop(_which(), "uvloop")
    assert uv_module.startswith("uvloop")
    assert uv_name == "uvloop"
    plain_module, plain_name = run_on_loop(_which(), "asyncio")
    assert plain_module.startswith("asyncio")
    assert plain_name == "asyncio"


def test_the_default_is_uvloop_where_it_is_installed() -> None:
    # uvloop is a dependency on every platform but Windows, and make test installs it.
    assert default_event_loop() == "uvloop"
    assert all(event_loop_problem(name) is None for name in EVENT_LOOPS)


def test_without_uvloop_the_default_is_asyncio_and_asking_for_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A platform uvloop has no build for (Windows).
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "uvloop" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert default_event_loop() == "asyncio"
    assert event_loop_problem("uvloop") == (
        "--event-loop uvloop: uvloop is not installed (pip install uvloop), or use asyncio"
    )
    assert event_loop_problem("asyncio") is None


def test_an_unknown_name_is_refused() -> None:
    assert event_loop_problem("trio") == "--event-loop must be one of uvloop, asyncio"


def test_what_is_left_running_is_cancelled_as_asyncio_run_does() -> None:
    cancelled: list[bool] = []

    async def lingering() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> int:
        asyncio.get_running_loop().create_task(lingering())
        await asyncio.sleep(0)
        return 7

    assert run_on_loop(main(), "uvloop") == 7
    assert cancelled == [True]


# -- servers started with their standard fds closed ---------------------------------------------

_BIN = Path(sys.executable).parent


def _started(process: subprocess.Popen[str], stream: IO[str], pattern: str) -> re.Match[str]:
    """The first line of stream matching pattern; the server's output up to there if none."""
    seen = []
    for line in stream:
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    process.kill()
    raise AssertionError(f"the server never said it listens: {''.join(seen)}")


def _stopped(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr


def test_agent_server_with_stdin_and_stdout_closed_stops_cleanly(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    process = subprocess.Popen(
        # Closed once its pipes are in place: `<&-`, `>&-`.
        exec_argv(
            [_BIN / "agent-server", "serve", "--listen", "127.0.0.1:0", "--trace-root", traces],
            closed=[0, 1],
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    # stdout is closed: the address is read from the start-up log line on stderr.
    address = _started(process, process.stderr, r"listening on (\S+)").group(1)
    with SyncAgentClient(address) as client:
        thread = client.start_thread()
    code, stderr = _stopped(process)
    assert code == 0, stderr  # was 134: uv__close: Assertion `fd > STDERR_FILENO' failed
    assert "Assertion" not in stderr
    (bundle,) = traces.iterdir()
    assert bundle.name.endswith(thread.id)
    # The thread left open is closed by the shutdown, its bundle whole.
    assert replay_bundle(bundle).recording_complete


@pytest.mark.parametrize("server", ["gateway", "trace-reducer"])
def test_the_other_servers_with_stdin_closed_stop_cleanly(server: str, tmp_path: Path) -> None:
    commands: dict[str, list[str | Path]] = {
        "gateway": [_BIN / "agent-server", "gateway", "--trace-root", tmp_path],
        "trace-reducer": [_BIN / "trace-reducer", "serve", "--bundle-root", tmp_path],
    }
    argv = commands[server]
    process = subprocess.Popen(
        exec_argv([*argv, "--listen", "127.0.0.1:0"], closed=[0]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    _started(process, process.stdout, r"^listening on ")
    code, stderr = _stopped(process)
    assert code == 0, stderr  # was 134, libuv's assertion
