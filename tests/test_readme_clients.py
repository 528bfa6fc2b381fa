"""The README's ways of talking to the server, run as written against `agent-server serve`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs import block
from tests.live_server import LiveServer, live_server, server_env
from tests.test_readme import example

DEFAULT_ADDRESS = "127.0.0.1:50051"
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def served(traces: Path) -> Iterator[LiveServer]:
    with live_server("--trace-root", str(traces), "--local-word-delay", "0") as server:
        yield server


def run_python(code: str, address: str) -> str:
    """The example as a script of its own, pointed at the test's server."""
    assert DEFAULT_ADDRESS in code
    result = subprocess.run(
        [sys.executable, "-c", code.replace(DEFAULT_ADDRESS, address)],
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_async_client_example(served: LiveServer, traces: Path) -> None:
    printed = run_python(example("client"), served.address)
    assert printed.startswith('You said: "What does rollout-trace record?".')
    bundle = re.search(r"\n\[COMPLETED\] bundle: (\S+)\n$", printed)
    assert bundle, printed
    assert Path(bundle.group(1)).parent == traces


def test_the_sync_client_example(served: LiveServer) -> None:
    printed = run_python(example("sync-client"), served.address).splitlines()
    assert printed[0] == "the model called weather"
    assert printed[1] == 'COMPLETED The tool weather returned: "sunny".'
    assert printed[2] == "NOT_FOUND THREAD_NOT_FOUND {'thread_id': 'thread_0'}"


def grpcurl_lines() -> list[list[str]]:
    lines = block("grpcurl", "sh").splitlines()
    return [shlex.split(line) for line in lines if line.strip()]


def test_the_grpcurl_example(served: LiveServer) -> None:
    lines = grpcurl_lines()
    assert [line[0] for line in lines] == ["grpcurl"] * 6
    thread_id = ""

    def command(line: list[str]) -> list[str]:
        return [
            GRPCURL,
            *(
                arg.replace(DEFAULT_ADDRESS, served.address).replace("THREAD_ID", thread_id)
                for arg in line[1:]
            ),
        ]

    def run(line: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command(line), capture_output=True, text=True, timeout=60)

    listed, started, turn, stream, close, missing = lines
    assert set(run(listed).stdout.split()) >= {
        "rollout.agent.v1.AgentService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    thread_id = json.loads(run(started).stdout)["thread"]["id"]
    assert json.loads(run(turn).stdout)["turn"]["status"] == "TURN_STATUS_IN_PROGRESS"
    # StreamEvents runs until the thread closes: read it until the turn has completed.
    events = subprocess.Popen(command(stream), stdout=subprocess.PIPE, text=True)
    try:
        assert events.stdout is not None
        output = ""
        deadline = time.monotonic() + 60
        while '"turn_completed"' not in output:
            assert time.monotonic() < deadline, output
            line = events.stdout.readline()
            assert line, output
            output += line
    finally:
        events.terminate()
        events.wait()
    assert json.loads(run(close).stdout)["thread"]["status"] == "THREAD_STATUS_CLOSED"
    failed = run(missing)
    assert failed.returncode != 0
    assert "Code: NotFound" in failed.stderr
    assert '"reason":"THREAD_NOT_FOUND"' in failed.stderr
    assert '"domain":"rollout-trace"' in failed.stderr
