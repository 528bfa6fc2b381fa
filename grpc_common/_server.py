"""GrpcServer: a grpc.aio server with health, reflection and the shared interceptors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from ._access import AccessControl
from ._handlers import MalformedRequestInterceptor
from ._keepalive import Keepalive
from ._listen import ListenError, refuse_address_in_use
from ._reflection import enable_reflection

# gRPC's own default is 4 MiB; requests a little over a service's limits must reach it.
DEFAULT_MAX_RECEIVE_BYTES = 16 * 1024 * 1024

# Calls that have arrived but that the server's event loop has not yet taken up, before gRPC's
# C core cancels the newest. Its default, 1,000 (shedding at random from there, all past
# 3,000), answered a pipeline starting 1,500 rollouts at once (one gather of StartThread) with
# a bare CANCELLED for a few dozen of them, which the client cannot tell from its own cancel
# and no handler or interceptor ever sees. A burst now waits its turn instead: each pending
# call costs a few hundred bytes, and the keepalive and deadlines still bound it.
MAX_PENDING_CALLS = 1_000_000


def split_listen(listen: str) -> tuple[str, int]:
    """Parse HOST:PORT (IPv6 hosts in brackets); raise ValueError with a clear message."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


class GrpcServer:
    """A grpc.aio server with health and reflection, bound to one loopback or host address."""

    def __init__(self, server: grpc.aio.Server, host: str, port: int, health: HealthServicer):
        self.server = server
        self.host = host
        self.port = port
        self.health = health

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    async def start(
        cls,
        listen: str,
        register: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str],
        access: AccessControl | None = None,
        *,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
        keepalive: Keepalive | None = None,
        rpc_metrics: grpc.aio.ServerInterceptor[Any, Any] | None = None,
        reuse_port: bool = False,
        private_addresses: Sequence[str] = (),
    ) -> GrpcServer:
        """Register the services, add health and reflection (v1 and v1alpha), bind and start.

        max_receive_bytes must exceed the largest valid request, so that the services refuse
        an oversized one with their own code and reason rather than gRPC with a bare one.
        keepalive: its pings and connection ages (Keepalive's defaults when None).
        rpc_metrics: the RpcMetricsInterceptor counting, timing and logging every RPC (first,
        so that it sees refusals too).
        reuse_port: share the port with the other processes that bind it so (`serve
        --workers`: the kernel spreads connections over them); off, a port in use is an error.
        private_addresses: more addresses (`unix:PATH`) served without TLS, the same services,
        token and interceptors: how the processes of `--workers` reach each other.
        Raises ValueError for a malformed address and ListenError (an OSError) when it cannot
        be bound: `cannot listen on HOST:PORT: address already in use`.
        """
        access = access or AccessControl()
        host, port = split_listen(listen)
        if not reuse_port:
            # Before gRPC's C core tries: it would say only "Failed to bind", and log lines.
            refuse_address_in_use(host, port, listen)
        # Without this off, a second server asking for a port in use silently shares it.
        server = grpc.aio.server(
            interceptors=[
                *([rpc_metrics] if rpc_metrics is not None else []),
                *access.interceptors(),
                MalformedRequestInterceptor(service_names),
            ],
            options=[
                ("grpc.so_reuseport", 1 if reuse_port else 0),
                ("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                *(keepalive or Keepalive()).options(),
            ],
        )
        register(server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        enable_reflection(
            server,
            [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name],
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        credentials = access.credentials()
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise ListenError(f"cannot listen on {listen}: {error}") from error
        if bound == 0:
            raise ListenError(f"cannot listen on {listen}")
        for private in private_addresses:
            try:
                if server.add_insecure_port(private) == 0:
                    raise RuntimeError("not bound")
            except RuntimeError as error:
                raise ListenError(f"cannot listen on {private}: {error}") from error
        await server.start()
        for name in service_names:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(server, host, bound, health)

    async def set_not_serving(self) -> None:
        """Tell health checkers to go elsewhere; it stays so until the process ends."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        """Refuse new RPCs, give running ones `grace` seconds, then cancel them."""
        await self.set_not_serving()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
