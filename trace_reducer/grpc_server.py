"""Shared gRPC plumbing for both servers: rich errors, health, reflection, binding, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

ERROR_DOMAIN = "rollout-trace"
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_status(
    code: grpc.StatusCode, reason: str, message: str, **metadata: str
) -> status_pb2.Status:
    """A google.rpc.Status carrying an ErrorInfo, as clients of any language decode it."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return status


async def abort(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    reason: str,
    message: str,
    **metadata: str,
) -> NoReturn:
    """End the RPC with code, message and an ErrorInfo(reason) in the status details."""
    status = error_status(code, reason, message, **metadata)
    await context.abort(
        code, message, trailing_metadata=((_STATUS_DETAILS_KEY, status.SerializeToString()),)
    )
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def status_code_name(code: int) -> str:
    """Name of a google.rpc.Code value, for messages."""
    return str(code_pb2.Code.Name(code))


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
        interceptors: Sequence[grpc.aio.ServerInterceptor[Any, Any]] = (),
    ) -> GrpcServer:
        """Register the services, add health and reflection, bind and start.

        Raises ValueError for a malformed address and OSError when it cannot be bound.
        """
        host, port = split_listen(listen)
        # Without this, a second server asking for a port in use silently shares it.
        server = grpc.aio.server(
            interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)]
        )
        register(server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            [
                *service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        bound_host = f"[{host}]" if ":" in host else host
        try:
            bound = server.add_insecure_port(f"{bound_host}:{port}")
        except RuntimeError as error:
            raise OSError(f"cannot listen on {listen}: {error}") from error
        if bound == 0:
            raise OSError(f"cannot listen on {listen}")
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


def install_signal_handlers(on_first_signal: Callable[[], None]) -> None:
    """SIGTERM/SIGINT call on_first_signal once; a second signal exits the process at once."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def handle(signum: int) -> None:
        if received:
            print("second signal: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        received.append(signum)
        on_first_signal()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)
