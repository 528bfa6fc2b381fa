"""Shared gRPC plumbing: health, reflection, rich errors, address handling."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from trace_reducer.grpc_server import ERROR_DOMAIN, GrpcServer, abort, split_listen

_SERVICE = "test.v1.EchoService"


async def _refuse(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    await abort(context, grpc.StatusCode.NOT_FOUND, "THING_NOT_FOUND", "no such thing", id="7")


def _register(server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(_refuse)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE, {"Refuse": handler}),)
    )


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    running = await GrpcServer.start("127.0.0.1:0", _register, [_SERVICE])
    try:
        yield running
    finally:
        await running.stop(None)


async def test_health_reports_serving_then_not_serving(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", _SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_not_serving()
        reply = await health.Check(health_pb2.HealthCheckRequest(service=_SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_the_services(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = set()
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in reply.list_services_response.service}
    assert {_SERVICE, "grpc.health.v1.Health"} <= names


async def test_abort_carries_error_info(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        refuse = channel.unary_unary(
            f"/{_SERVICE}/Refuse", request_serializer=None, response_deserializer=None
        )
        call = refuse(b"")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
    error = raised.value
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "no such thing"
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "THING_NOT_FOUND",
        ERROR_DOMAIN,
        {"id": "7"},
    )


async def test_port_in_use_is_refused(server: GrpcServer) -> None:
    with pytest.raises(OSError, match="cannot listen"):
        await GrpcServer.start(server.address, _register, [_SERVICE])


@pytest.mark.parametrize("listen", ["nohost", "host:", ":80", "h:99999", "h:x"])
def test_malformed_listen_address(listen: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_listen(listen)


def test_ipv6_listen_address() -> None:
    assert split_listen("[::1]:50051") == ("::1", 50051)
