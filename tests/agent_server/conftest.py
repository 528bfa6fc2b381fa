"""Fixtures: a scripted provider, an in-process agent server with a real gRPC client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from agent_server import AgentServer, Settings
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import state_pb2
from tests.agent_server.scripted_provider import ScriptedProvider
from tests.commands import exec_argv
from tests.streams import StreamLog

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


class EventLog(StreamLog[agent_pb2.ThreadEvent]):
    """Every event of one StreamEvents call, read in the background and awaited by predicate."""

    def __init__(self, call: Any) -> None:
        super().__init__(call, _events_of(call))

    @property
    def events(self) -> list[agent_pb2.ThreadEvent]:
        return self.items

    async def turn_completed(self, turn_id: str) -> agent_pb2.Turn:
        event = await self.wait_for(lambda e: e.turn_id == turn_id and e.HasField("turn_completed"))
        return event.turn_completed.turn

    def of_kind(self, kind: str) -> list[agent_pb2.ThreadEvent]:
        return [e for e in self.events if e.WhichOneof("kind") == kind]


async def _events_of(call: Any) -> AsyncIterator[agent_pb2.ThreadEvent]:
    async for response in call:
        yield response.event


@dataclass
class Harness:
    server: AgentServer
    channel: grpc.aio.Channel
    stub: agent_pb2_grpc.AgentServiceAsyncStub
    trace_root: Path | None
    logs: list[EventLog] = field(default_factory=list)

    async def start_thread(self, **fields: Any) -> agent_pb2.Thread:
        reply = await self.stub.StartThread(agent_pb2.StartThreadRequest(**fields))
        return reply.thread

    async def start_turn(self, thread_id: str, *texts: str) -> agent_pb2.Turn:
        reply = await self.stub.StartTurn(
            agent_pb2.StartTurnRequest(
                thread_id=thread_id, input=[agent_pb2.UserInput(text=t) for t in texts]
            )
        )
        return reply.turn

    def events(self, thread_id: str, after_index: int = 0) -> EventLog:
        log = EventLog(
            self.stub.StreamEvents(
                agent_pb2.StreamEventsRequest(thread_id=thread_id, after_index=after_index)
            )
        )
        self.logs.append(log)
        return log

    def bundles(self) -> list[Path]:
        assert self.trace_root is not None
        # The root is made by the first bundle.
        return sorted(self.trace_root.iterdir()) if self.trace_root.exists() else []


StartAgent = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def provider() -> AsyncIterator[ScriptedProvider]:
    scripted = await ScriptedProvider().start()
    try:
        yield scripted
    finally:
        await scripted.stop()


@pytest.fixture
async def start_agent(provider: ScriptedProvider, tmp_path: Path) -> AsyncIterator[StartAgent]:
    """start_agent(**settings overrides) -> Harness; recording under tmp_path/traces by default."""
    harnesses: list[Harness] = []

    async def start(**overrides: Any) -> Harness:
        settings = Settings(
            listen="127.0.0.1:0",
            provider_url=provider.url,
            model="test-model",
            trace_root=tmp_path / "traces",
            max_retries=0,
            retry_base_delay=0.0,
        )
        settings = replace(settings, **overrides)
        server = await AgentServer.start(settings)
        channel = grpc.aio.insecure_channel(server.address)
        harness = Harness(
            server, channel, agent_pb2_grpc.AgentServiceStub(channel), settings.trace_root
        )
        harnesses.append(harness)
        return harness

    try:
        yield start
    finally:
        for harness in harnesses:
            for log in harness.logs:
                await log.close()
            await harness.server.stop()
            await harness.channel.close(None)


@pytest.fixture
async def agent(start_agent: StartAgent) -> Harness:
    return await start_agent()


async def reduce_with_cli(bundle: Path) -> state_pb2.RolloutTrace:
    """`trace-reducer reduce <bundle>` as a user runs it, then its state.json parsed."""
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        "reduce",
        str(bundle),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    state_path = Path(stdout.decode().strip())
    assert state_path == bundle / "state.json"
    text = await asyncio.to_thread(state_path.read_text)
    return json_format.Parse(text, state_pb2.RolloutTrace())


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a failed call (its domain checked on the way)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, f"no rich status on {error.code()}: {error.details()}"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.domain == "rollout-trace"
    return info


def error_reason(error: grpc.aio.AioRpcError) -> str:
    return str(error_info(error).reason)


@dataclass
class Served:
    process: asyncio.subprocess.Process
    address: str
    stderr: bytes = b""
    stdout: bytes = b""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ROLLOUT_* settings, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(extra)
    return env


@contextlib.asynccontextmanager
async def serve(
    *args: str, nofile: tuple[int, int] | None = None, **env: str
) -> AsyncIterator[Served]:
    """Run `agent-server serve --listen 127.0.0.1:0 ARGS`; SIGTERM it on the way out.

    nofile: its open-file limit, (soft, hard)."""
    process = await asyncio.create_subprocess_exec(
        *exec_argv([AGENT_SERVER, "serve", "--listen", "127.0.0.1:0", *args], nofile=nofile),
        env=clean_env(**env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    line = (await process.stdout.readline()).decode()
    assert line.startswith("listening on "), (line, await process.stderr.read())
    served = Served(process, line.removeprefix("listening on ").strip())
    try:
        yield served
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        rest, served.stderr = await process.communicate()
        served.stdout = line.encode() + rest
