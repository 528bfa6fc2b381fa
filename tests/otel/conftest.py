"""Fixtures for the OTLP export: real bundles from the agent server, and a Phoenix server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import record_pb2
from tests.agent_server.conftest import StartAgent
from tests.agent_server.conftest import provider as provider
from tests.agent_server.conftest import start_agent as start_agent
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from trace_reducer import TRACE_FILE_NAME, decode_varint

PHOENIX = Path(sys.executable).parent / "phoenix"
PHOENIX_START_SECONDS = 180.0

INSTRUCTIONS = "Answer in one short sentence."
FIRST_PROMPT = "Which colour is the sky?"
FIRST_ANSWER = "The sky is blue on a clear day."
SECOND_PROMPT = "Tell me a long story."
KEPT_ANSWER = "Once upon a time."
DISCARDED_TEXT = "There was a partial sentence that"
RETRIED_ANSWER = "Fine after one retry."


@dataclass
class Bundles:
    """Bundles the real agent server recorded, one per scenario."""

    conversation: Path  # turn 1 completed, turn 2 interrupted mid-stream
    retried: Path  # one turn: HTTP 503 on attempt 1, answered on attempt 2


async def _conversation(start_agent: StartAgent, provider: ScriptedProvider) -> Path:
    release = asyncio.Event()
    provider.queue(answer(FIRST_ANSWER, item_id="msg-first", response_id="resp-first"))
    kept = message(KEPT_ANSWER, "msg-kept")
    provider.queue(
        sse(
            created("resp-second"),
            item_added(kept),
            item_done(kept),
            item_added(message("", "msg-partial")),
            text_delta(DISCARDED_TEXT),
        ),
        # The stream stays open: only the interrupt ends it.
        release,
    )
    agent = await start_agent()
    thread = await agent.start_thread(instructions=INSTRUCTIONS, metadata={"suite": "otel"})
    events = agent.events(thread.id)
    first = await agent.start_turn(thread.id, FIRST_PROMPT)
    await events.turn_completed(first.id)
    second = await agent.start_turn(thread.id, SECOND_PROMPT)
    # A delta of the partial item proves the kept item was processed before it.
    await events.wait_for(
        lambda e: e.turn_id == second.id and e.agent_message_delta.item_id == "msg-partial"
    )
    await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=second.id))
    await events.turn_completed(second.id)
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    await agent.server.stop()
    release.set()
    [bundle] = agent.bundles()
    return bundle


async def _retried(start_agent: StartAgent, provider: ScriptedProvider, root: Path) -> Path:
    provider.queue_error(503, {"error": {"message": "overloaded", "code": "server_overloaded"}})
    provider.queue(answer(RETRIED_ANSWER, item_id="msg-retried", response_id="resp-retried"))
    agent = await start_agent(trace_root=root, max_retries=1)
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "Try again please")
    await events.turn_completed(turn.id)
    await agent.server.stop()
    [bundle] = agent.bundles()
    return bundle


@pytest.fixture
async def bundles(start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path) -> Bundles:
    conversation = await _conversation(start_agent, provider)
    retried = await _retried(start_agent, provider, tmp_path / "retried")
    return Bundles(conversation, retried)


def damage_inside(bundle: Path, body: str, target: Path, *, flip: bool = False) -> Path:
    """A copy of bundle whose first frame holding a `body` record is cut in half (TRUNCATED),
    or has one bit flipped (CORRUPT)."""
    shutil.copytree(bundle, target)
    path = target / TRACE_FILE_NAME
    data = bytearray(path.read_bytes())
    offset = 0
    while offset < len(data):
        prefix = decode_varint(data, offset)
        assert prefix is not None
        size, start = prefix
        frame = bytes(data[start : start + size])
        if record_pb2.TraceRecord.FromString(frame).WhichOneof("body") == body:
            if flip:
                data[start + size // 2] ^= 0x01
            else:
                del data[start + size // 2 :]
            path.write_bytes(bytes(data))
            return target
        offset = start + size
    raise AssertionError(f"no {body} record in {bundle}")


def truncate_inside(bundle: Path, body: str, target: Path) -> Path:
    return damage_inside(bundle, body, target)


# -- Phoenix ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Phoenix:
    url: str  # the UI, the REST API and OTLP/HTTP (`/v1/traces`)
    grpc_endpoint: str  # OTLP/gRPC


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """One `phoenix serve` on loopback for the whole session, offline, stopped with SIGTERM."""
    if not PHOENIX.exists():
        pytest.skip("arize-phoenix is not installed (make test installs it)")
    scratch = tmp_path_factory.mktemp("phoenix")
    http_port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http_port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(scratch / "working"),
        # Offline: no WASM or docs fetch at start-up, no telemetry, no migration chatter.
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_LOG_MIGRATIONS": "false",
    }
    log_path = scratch / "phoenix.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(PHOENIX), "serve"], cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + PHOENIX_START_SECONDS
        while True:
            if process.poll() is not None:
                raise AssertionError(f"phoenix exited {process.returncode}: {log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"phoenix not healthy in time: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield Phoenix(url, f"http://127.0.0.1:{grpc_port}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
