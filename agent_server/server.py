"""AgentServer: the agent, its provider and its gRPC server started and stopped as one."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from agent_server import telemetry
from agent_server._router import Router
from agent_server.agent import Agent
from agent_server.config import Settings
from agent_server.dialects import dialect_named, unsupported_fields
from agent_server.local_model import LocalModel
from agent_server.provider import ProviderClient
from agent_server.replay_model import ReplayBook, ReplayModel
from agent_server.service import SERVICE_NAME, AgentService, add_to_server
from grpc_common import (
    GrpcServer,
    MetricsServer,
    RpcMetricsInterceptor,
    refuse_address_in_use,
    split_listen,
)
from grpc_common._files import path_kind

if TYPE_CHECKING:
    from trace_reducer.export._live import LiveExport

log = logging.getLogger(__name__)

# Running RPCs get this long to finish once every thread has been ended.
_STOP_GRACE = 5.0
# One per process: its series live in the process's one registry.
_RPC_METRICS = RpcMetricsInterceptor(
    telemetry.REGISTRY, "rollout_agent", logging.getLogger("agent_server.rpc")
)


def trace_root_problem(root: Path) -> str | None:
    """Why the trace root cannot take a bundle right now, or None when it looks usable."""
    if root.exists():
        if not root.is_dir():
            # What it is, in the words every path flag uses (was: only `is not a directory`,
            # a FIFO and a file alike).
            return f"trace root is not a directory: {root} is {path_kind(root)}"
        if not os.access(root, os.W_OK | os.X_OK):
            return f"trace root is not writable: {root}"
        return None
    parent = next((p for p in root.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"trace root cannot be created: {parent} is {path_kind(parent)}: {root}"
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        return f"trace root does not exist and cannot be created: {root}"
    return None


class AgentServer:
    """`await AgentServer.start(settings)`, then `.address` / `.port`, then `await .stop()`."""

    def __init__(
        self,
        settings: Settings,
        agent: Agent,
        provider: ProviderClient,
        grpc_server: GrpcServer,
        local_model: LocalModel | ReplayModel | None,
    ) -> None:
        self.settings = settings
        self.agent = agent
        self._provider = provider
        self._grpc = grpc_server
        self._local_model = local_model
        self._stopping: asyncio.Task[None] | None = None
        # The Prometheus endpoint, when --metrics-listen asked for one.
        self.metrics: MetricsServer | None = None
        self.live_export: LiveExport | None = None
        self.named_providers: list[ProviderClient] = []
        # One of `serve --workers N`'s processes: how calls reach the other workers.
        self.router: Router | None = None

    @classmethod
    async def start(cls, settings: Settings) -> AgentServer:
        """Start the replay provider (--replay-from), else the local model when no provider
        URL is set, then the gRPC server.

        Raises ValueError / OSError (ListenError: `cannot listen on HOST:PORT: address already
        in use`) when the listen address is unusable, ConfigError when the bundles to replay
        cannot be read.
        """
        if settings.worker is None:
            # An address in use is said first, before the models start and log; a worker
            # shares its port with the others (GrpcServer.start's reuse_port).
            refuse_address_in_use(*split_listen(settings.listen), settings.listen)
        if settings.trace_root is not None:
            problem = trace_root_problem(settings.trace_root)
            if problem:
                log.warning(
                    "%s; threads will fail to start until it is fixed (recording is on)", problem
                )
        for warning in settings.warnings():
            log.warning("%s", warning)
        live = telemetry.start_live_export(settings)
        metrics = (
            MetricsServer.start(settings.metrics_listen, telemetry.REGISTRY)
            if settings.metrics_listen
            else None
        )
        if metrics is not None:
            log.info("metrics at %s", metrics.url)
        local_model: LocalModel | ReplayModel | None = None
        if settings.replay_from is not None:
            local_model = await ReplayModel.from_settings(settings)
            base_url = local_model.url
            log.info("replaying %s at %s", settings.replay_from, base_url)
        elif settings.provider_url is None:
            local_model = await LocalModel.start(settings.local_word_delay)
            base_url = local_model.url
            log.info("no --provider-url given: using the built-in local model at %s", base_url)
        else:
            base_url = settings.provider_url
        provider = ProviderClient(
            base_url,
            settings.api_key,
            settings.stream_idle_timeout,
            max_connections=settings.provider_max_connections,
            dialect=dialect_named(settings.provider_api),
        )
        named = {
            named.name: ProviderClient(
                named.url,
                named.api_key,
                settings.stream_idle_timeout,
                max_connections=settings.provider_max_connections,
                dialect=dialect_named(named.api),
                name=named.name,
                unsupported=unsupported_fields(named.capabilities),
            )
            for named in settings.providers
        }
        book = local_model.book if isinstance(local_model, ReplayModel) else None
        agent = Agent(
            settings,
            provider,
            named,
            branch_point=book.branch_point if book and settings.replay_branch_at else None,
        )
        service = AgentService(agent)
        role = settings.worker
        router = (
            Router(agent, role, settings.workers, settings.trace_root) if role is not None else None
        )

        def register(server: grpc.aio.Server) -> None:
            add_to_server(service, server, router)

        try:
            grpc_server = await GrpcServer.start(
                settings.listen,
                register,
                [SERVICE_NAME],
                settings.access,
                keepalive=settings.keepalive,
                rpc_metrics=_RPC_METRICS,
                # The workers share the port, and each serves on its own Unix socket too.
                reuse_port=router is not None,
                private_addresses=[router.private_address] if router is not None else [],
            )
        except BaseException:
            await provider.aclose()
            for client in named.values():
                await client.aclose()
            if local_model is not None:
                await local_model.stop()
            if metrics is not None:
                metrics.stop()
            await telemetry.stop_live_export(live, _STOP_GRACE)
            raise
        server = cls(settings, agent, provider, grpc_server, local_model)
        server.metrics = metrics
        server.live_export = live
        server.named_providers = list(named.values())
        server.router = router
        return server

    @property
    def port(self) -> int:
        return self._grpc.port

    @property
    def address(self) -> str:
        return self._grpc.address

    @property
    def local_model_url(self) -> str | None:
        return self._local_model.url if self._local_model is not None else None

    @property
    def replay(self) -> ReplayBook | None:
        """What the replay provider answered so far (with --replay-from)."""
        model = self._local_model
        return model.book if isinstance(model, ReplayModel) else None

    async def stop(self) -> None:
        """Graceful shutdown; every caller waits for the same one."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        await self._grpc.set_not_serving()
        # Ending the threads first ends their event streams: the gRPC stop has little to wait for.
        try:
            await self.agent.shutdown()
        finally:
            await self._grpc.stop(_STOP_GRACE)
            if self.router is not None:
                await self.router.close()
            await self._provider.aclose()
            for client in self.named_providers:
                await client.aclose()
            if self._local_model is not None:
                await self._local_model.stop()
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.stop)
            # What is queued goes out, within the grace a stop allows.
            await telemetry.stop_live_export(self.live_export, _STOP_GRACE)

    async def wait_for_termination(self) -> None:
        await self._grpc.wait_for_termination()
