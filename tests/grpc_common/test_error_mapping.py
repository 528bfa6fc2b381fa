"""The one translation of exceptions into statuses, through a real server: an error that
carries its status, rules taken in order, INTERNAL (logged, no details) for the rest, a
client's cancel passed through; and both servers' documented reasons are their mappings'."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

import agent_server.errors
import trace_reducer.service._service as reducer_service
from grpc_common import ErrorMapping, GrpcServer, RpcStatusError, StatusRule
from tests.grpc_common.conftest import unary_server

_SERVICE = "test.v1.MappedService"


class _MissingError(LookupError):
    pass


class _GoneError(RpcStatusError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "THING_GONE"


MAPPING = ErrorMapping(
    [
        StatusRule(_MissingError, grpc.StatusCode.NOT_FOUND, "THING_MISSING"),
        StatusRule(
            LookupError,
            grpc.StatusCode.INVALID_ARGUMENT,
            "BAD_LOOKUP",
            metadata=lambda error: {"kind": type(error).__name__},
            describe=lambda error: f"lookup failed: {error}",
        ),
    ],
    log=logging.getLogger("tests.mapped"),
)
RAISED: dict[bytes, Exception] = {
    b"gone": _GoneError("it went away", thing="7"),
    b"missing": _MissingError("no such thing"),
    b"lookup": KeyError("k"),
    b"bug": RuntimeError("secret internals"),
}
STARTED: list[asyncio.Event] = []
CLEANED: list[asyncio.Event] = []


async def _handle(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    async with MAPPING.translated(context, "Mapped"):
        if request == b"wait":
            STARTED[-1].set()
            try:
                await asyncio.Event().wait()
            finally:
                CLEANED[-1].set()
        raise RAISED[request]


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    async with unary_server(_SERVICE, {"Mapped": _handle}) as running:
        yield running


async def _call(
    server: GrpcServer, request: bytes
) -> tuple[grpc.StatusCode, str, str, dict[str, str]]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        mapped = channel.unary_unary(
            f"/{_SERVICE}/Mapped", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await mapped(request)
    status = rpc_status.from_call(raised.value)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return raised.value.code(), info.reason, raised.value.details() or "", dict(info.metadata)


async def test_each_exception_ends_the_rpc_with_its_status(
    server: GrpcServer, caplog: pytest.LogCaptureFixture
) -> None:
    assert await _call(server, b"gone") == (
        grpc.StatusCode.NOT_FOUND,
        "THING_GONE",
        "it went away",
        {"thing": "7"},
    )
    # The first rule that names the exception's kind: the subclass's rule is listed first.
    assert await _call(server, b"missing") == (
        grpc.StatusCode.NOT_FOUND,
        "THING_MISSING",
        "no such thing",
        {},
    )
    assert await _call(server, b"lookup") == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_LOOKUP",
        "lookup failed: 'k'",
        {"kind": "KeyError"},
    )
    with caplog.at_level(logging.ERROR, logger="tests.mapped"):
        code, reason, message, _ = await _call(server, b"bug")
    assert (code, reason) == (grpc.StatusCode.INTERNAL, "INTERNAL")
    assert "secret" not in message
    assert "RuntimeError" in message
    logged = [r for r in caplog.records if r.name == "tests.mapped"]
    assert [r.getMessage() for r in logged] == ["Mapped failed unexpectedly"]
    assert logged[0].exc_info is not None


async def test_a_client_cancel_passes_through_for_cleanup(server: GrpcServer) -> None:
    STARTED.append(asyncio.Event())
    CLEANED.append(asyncio.Event())
    async with grpc.aio.insecure_channel(server.address) as channel:
        mapped = channel.unary_unary(
            f"/{_SERVICE}/Mapped", request_serializer=None, response_deserializer=None
        )
        call = mapped(b"wait")
        async with asyncio.timeout(30):
            await STARTED[-1].wait()  # the handler runs in this process, on this loop
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    # The cancel reached the handler as CancelledError: its `finally` ran, no status was sent.
    async with asyncio.timeout(30):
        await CLEANED[-1].wait()


def _documented(docstring: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\* ([A-Z_]+) / ([A-Z_]+):", docstring, re.MULTILINE))


def test_the_reducer_service_answers_the_reasons_it_documents() -> None:
    rules = {(rule.code.name, rule.reason) for rule in reducer_service.ERRORS._rules}
    refusals = {
        (kind.code.name, kind.reason)
        for kind in vars(reducer_service).values()
        if isinstance(kind, type)
        and issubclass(kind, RpcStatusError)
        and kind is not RpcStatusError
    }
    internal = {("INTERNAL", "INTERNAL")}
    assert _documented(reducer_service.__doc__ or "") == rules | refusals | internal


def test_the_agent_errors_each_name_one_reason() -> None:
    kinds = [
        kind
        for kind in vars(agent_server.errors).values()
        if isinstance(kind, type) and issubclass(kind, agent_server.errors.AgentError)
    ]
    reasons = [kind.reason for kind in kinds if "reason" in vars(kind)]
    assert len(reasons) == len(set(reasons)), "a reason named by two errors"
    assert all(issubclass(kind, RpcStatusError) for kind in kinds)
