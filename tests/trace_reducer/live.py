"""Real servers for tests of live bundles: the agent server on a scripted provider, the reducer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from agent_server import AgentServer, Settings
from grpc_common import GrpcServer
from rollout.agent.v1 import agent_pb2_grpc
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc
from tests.agent_server.conftest import Harness
from tests.agent_server.scripted_provider import ScriptedProvider
from tests.streams import StreamLog
from trace_reducer.service import SERVICE_NAME, ReducerService, add_to_server

if TYPE_CHECKING:
    from rollout.reducer.v1.reducer_pb2_grpc import ReducerServiceAsyncStub

DEADLINE_SECONDS = 30.0


@contextlib.asynccontextmanager
async def scripted_agent(trace_root: Path) -> AsyncIterator[tuple[Harness, ScriptedProvider]]:
    """An in-process agent server recording under trace_root, on a scripted provider."""
    provider = await ScriptedProvider().start()
    settings = Settings(
        listen="127.0.0.1:0",
        provider_url=provider.url,
        model="test-model",
        trace_root=trace_root,
        max_retries=0,
        retry_base_delay=0.0,
    )
    server = await AgentServer.start(settings)
    channel = grpc.aio.insecure_channel(server.address)
    harness = Harness(server, channel, agent_pb2_grpc.AgentServiceStub(channel), trace_root)
    try:
        yield harness, provider
    finally:
        for log in harness.logs:
            await log.close()
        await server.stop()
        await channel.close(None)
        await provider.stop()


@contextlib.asynccontextmanager
async def reducer_service(root: Path) -> AsyncIterator[ReducerServiceAsyncStub]:
    """ReducerService on 127.0.0.1:0 with bundle root `root`, and a client stub for it."""
    service = ReducerService(root)
    server = await GrpcServer.start(
        "127.0.0.1:0", lambda grpc_server: add_to_server(service, grpc_server), [SERVICE_NAME]
    )
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield reducer_pb2_grpc.ReducerServiceStub(channel)
    finally:
        await channel.close(None)
        await server.stop(None)


class Updates(StreamLog[reducer_pb2.WatchBundleResponse]):
    """Every response of one WatchBundle call, read in the background, awaited by predicate."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[
            reducer_pb2.WatchBundleRequest, reducer_pb2.WatchBundleResponse
        ],
    ) -> None:
        super().__init__(call, deadline=DEADLINE_SECONDS)

    @property
    def responses(self) -> list[reducer_pb2.WatchBundleResponse]:
        return self.items


def open_descriptors(path: Path) -> int:
    """How many file descriptors of this process are open on path."""
    target = str(path.resolve())
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == target:
                count += 1
    return count


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll condition until it holds; fail naming `what` after the deadline."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not so after {DEADLINE_SECONDS} s: {what}")
        await asyncio.sleep(0.01)
