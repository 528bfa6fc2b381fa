"""A real GrpcServer on 127.0.0.1:0 serving one test service of raw-bytes unary methods."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from grpc_common import GrpcServer

Unary = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


def register_unary(service: str, methods: dict[str, Unary]) -> Callable[[grpc.aio.Server], None]:
    """What GrpcServer.start calls to register `service`'s methods."""

    def register(server: grpc.aio.Server) -> None:
        handlers = {name: grpc.unary_unary_rpc_method_handler(m) for name, m in methods.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))

    return register


@contextlib.asynccontextmanager
async def unary_server(service: str, methods: dict[str, Unary]) -> AsyncIterator[GrpcServer]:
    """GrpcServer.start with `service`'s methods registered, stopped on the way out."""
    running = await GrpcServer.start("127.0.0.1:0", register_unary(service, methods), [service])
    try:
        yield running
    finally:
        await running.stop(None)
