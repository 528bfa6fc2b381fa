"""Shared gRPC plumbing: health, reflection, rich errors, address handling, access control."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from grpc_common import (
    ERROR_DOMAIN,
    AccessControl,
    GrpcServer,
    ListenError,
    MetricsServer,
    abort,
    refuse_address_in_use,
    split_listen,
)
from tests.grpc_common.conftest import register_unary, unary_server

_SERVICE = "test.v1.EchoService"


async def _refuse(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    await abort(context, grpc.StatusCode.NOT_FOUND, "THING_NOT_FOUND", "no such thing", id="7")


_register = register_unary(_SERVICE, {"Refuse": _refuse})


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    async with unary_server(_SERVICE, {"Refuse": _refuse}) as running:
        yield running


async def test_health_reports_serving_then_not_serving(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", _SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_not_serving()
        reply = await health.Check(health_pb2.HealthCheckRequest(service=_SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_under_both_names(server: GrpcServer, version: str) -> None:
    # Messages of the version asked for, from the descriptor pool: v1's are not v1alpha's.
    pool = descriptor_pool.Default()
    request_type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"grpc.reflection.{version}.ServerReflectionRequest")
    )
    response_type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"grpc.reflection.{version}.ServerReflectionResponse")
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        requests = [
            request_type(list_services=""),
            request_type(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
            request_type(file_containing_symbol="no.such.Symbol"),
        ]
        replies = [reply async for reply in info(iter(requests))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {
        _SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    [serialized] = replies[1].file_descriptor_response.file_descriptor_proto
    file = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    assert (file.name, file.package) == (
        "grpc/reflection/v1/reflection.proto",
        "grpc.reflection.v1",
    )
    assert file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert replies[2].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


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


# Past gRPC's own pending-call default (1,000, all shed past 3,000), which cancelled a few
# dozen of 1,500 StartThreads sent at once.
BURST = 3_500


async def test_a_burst_of_calls_is_answered_whole(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        replies = await asyncio.gather(
            *(health.Check(health_pb2.HealthCheckRequest()) for _ in range(BURST)),
            return_exceptions=True,
        )
    failed = [reply for reply in replies if isinstance(reply, BaseException)]
    assert not failed, f"{len(failed)} of {BURST} failed, the first: {failed[0]!r}"


async def test_port_in_use_is_refused(server: GrpcServer) -> None:
    # Was: "cannot listen on …: Failed to bind to address …; set GRPC_VERBOSITY=debug …".
    with pytest.raises(ListenError) as raised:
        await GrpcServer.start(server.address, _register, [_SERVICE])
    assert str(raised.value) == f"cannot listen on {server.address}: address already in use"


def test_a_metrics_port_in_use_is_said_the_same_way() -> None:
    from prometheus_client import CollectorRegistry

    with _occupied() as listen, pytest.raises(ListenError) as raised:
        MetricsServer.start(listen, CollectorRegistry())
    assert str(raised.value) == f"cannot serve metrics on {listen}: address already in use"


@contextlib.contextmanager
def _occupied() -> Iterator[str]:
    """HOST:PORT of a port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield f"127.0.0.1:{taken.getsockname()[1]}"


_BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["agent-server", "serve"],
        ["agent-server", "serve", "--workers", "2"],
        ["agent-server", "gateway", "--trace-root", "{tmp}"],
        ["trace-reducer", "serve", "--bundle-root", "{tmp}"],
        ["trace-reducer", "view", "{tmp}"],
    ],
    ids=["serve", "serve-workers", "gateway", "trace-reducer-serve", "view-root"],
)
def test_an_address_in_use_is_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    # Was: exit 1 with "Failed to bind … set GRPC_VERBOSITY=debug …" (trace-reducer serve
    # after a C-core line `E… add_port.cc:83] Failed to add port …`), and the gateway's
    # "[Errno 98] error while attempting to bind on address ('127.0.0.1', …)"; a served
    # `view ROOT` the same aiohttp words without the errno, and exit 1.
    if "--workers" in command and not hasattr(socket, "SO_REUSEPORT"):
        pytest.skip("--workers needs SO_REUSEPORT")
    program, *args = (part.replace("{tmp}", str(tmp_path)) for part in command)
    # A user's shell: no GRPC_VERBOSITY (importing agent_server sets it here).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "GRPC_"))}
    with _occupied() as listen:
        done = subprocess.run(
            [str(_BIN / program), *args, "--listen", listen],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (done.returncode, done.stderr) == (
        2,
        f"{program}: cannot listen on {listen}: address already in use\n",
    )
    assert done.stdout == ""


@pytest.mark.parametrize("program", ["agent-server", "trace-reducer"])
def test_a_metrics_address_in_use_is_one_line_and_exit_2(program: str) -> None:
    # Was, from trace-reducer serve: "--metrics-listen: cannot serve metrics on …", the flag
    # before the words the agent server says alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUT_", "GRPC_"))}
    with _occupied() as listen:
        done = subprocess.run(
            [str(_BIN / program), "serve", "--listen", "127.0.0.1:0", "--metrics-listen", listen],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (done.returncode, done.stderr) == (
        2,
        f"{program}: cannot serve metrics on {listen}: address already in use\n",
    )


def test_a_free_address_is_not_refused() -> None:
    with socket.socket() as once:
        once.bind(("127.0.0.1", 0))
        port = once.getsockname()[1]
    refuse_address_in_use("127.0.0.1", port, f"127.0.0.1:{port}")
    refuse_address_in_use("127.0.0.1", 0, "127.0.0.1:0")


@pytest.mark.parametrize("listen", ["nohost", "host:", ":80", "h:99999", "h:x"])
def test_malformed_listen_address(listen: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_listen(listen)


def test_ipv6_listen_address() -> None:
    assert split_listen("[::1]:50051") == ("::1", 50051)


def _access(
    token_env: str | None = None,
    cert: Path | None = None,
    key: Path | None = None,
    environ: dict[str, str] | None = None,
) -> AccessControl:
    return AccessControl.load(
        token_env=token_env, tls_cert=cert, tls_key=key, environ=environ or {}
    )


async def _refuse_code(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> str:
    refuse = channel.unary_unary(
        f"/{_SERVICE}/Refuse", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await refuse(b"", metadata=metadata)
    status = rpc_status.from_call(raised.value)  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    assert status is not None
    assert status.details[0].Unpack(info)
    assert "s3cret" not in (raised.value.details() or "")
    return f"{raised.value.code().name}/{info.reason}"


async def test_bearer_token_is_required_except_for_health() -> None:
    access = _access("TOKEN_VAR", environ={"TOKEN_VAR": "s3cret"})
    server = await GrpcServer.start("127.0.0.1:0", _register, [_SERVICE], access=access)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert await _refuse_code(channel, ()) == "UNAUTHENTICATED/MISSING_TOKEN"
            wrong = (("authorization", "Bearer nope"),)
            assert await _refuse_code(channel, wrong) == "UNAUTHENTICATED/INVALID_TOKEN"
            # With the right token the call reaches the servicer, which refuses on its own terms.
            right = (("authorization", "Bearer s3cret"),)
            assert await _refuse_code(channel, right) == "NOT_FOUND/THING_NOT_FOUND"
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=_SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


def test_access_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="TOKEN_VAR, which is unset"):
        _access("TOKEN_VAR")
    with pytest.raises(ValueError, match="go together"):
        _access(cert=Path("cert.pem"))
    with pytest.raises(ValueError, match="cannot read"):
        _access(cert=Path("/nonexistent/cert.pem"), key=Path("/nonexistent/key.pem"))
    assert "s3cret" not in repr(_access("T", environ={"T": "s3cret"}))


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made with the openssl command."""
    return make_certificate(tmp_path)


def make_certificate(directory: Path, name: str = "") -> tuple[Path, Path]:
    """`certificate`'s pair, made in directory as {name}cert.pem and {name}key.pem."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = directory / f"{name}cert.pem", directory / f"{name}key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server = await GrpcServer.start(
        "127.0.0.1:0", _register, [_SERVICE], access=_access(cert=cert, key=key)
    )
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(server.address, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=_SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(server.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
async def test_an_independent_reflection_client_lists_the_services(
    server: GrpcServer, protocol: str
) -> None:
    # buf curl (Go's reflection client) asks under the one protocol it is told to use.
    buf = Path(sys.executable).parent / "buf"
    process = await asyncio.create_subprocess_exec(
        str(buf),
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "--reflect-protocol",
        protocol,
        "--list-services",
        f"http://{server.address}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    assert {_SERVICE, "grpc.health.v1.Health"} <= set(stdout.decode().split())
