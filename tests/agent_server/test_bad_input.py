"""A sweep of malformed, oversized and unknown arguments over every AgentService RPC.

Each gets its documented code and an ErrorInfo reason, none gets UNKNOWN, and a client's mistake
leaves no traceback in the server log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, error_reason

Code = grpc.StatusCode
Rpc = Callable[[Harness, str], Awaitable[object]]
HUGE_ID = "t" * 100_000


def _rpcs() -> dict[str, Callable[[Harness, str], Awaitable[object]]]:
    return {
        "StartTurn": lambda a, tid: a.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=tid, input=[agent_pb2.UserInput(text="hi")])
        ),
        "Interrupt": lambda a, tid: a.stub.Interrupt(
            agent_pb2.InterruptRequest(thread_id=tid, turn_id="turn_x")
        ),
        "GetThread": lambda a, tid: a.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=tid)),
        "CloseThread": lambda a, tid: a.stub.CloseThread(
            agent_pb2.CloseThreadRequest(thread_id=tid)
        ),
        "StreamEvents": _first_event,
    }


async def _first_event(agent: Harness, thread_id: str) -> object:
    call = agent.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
    async for response in call:
        return response
    return None


async def _expect(call: Awaitable[object], code: grpc.StatusCode, reason: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    error = raised.value
    assert error.code() != Code.UNKNOWN
    assert (error.code(), error_reason(error)) == (code, reason), error.details()
    return error.details() or ""


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("rpc", sorted(_rpcs()))
async def test_missing_unknown_and_oversized_thread_ids(
    rpc: str, agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    call = _rpcs()[rpc]
    with caplog.at_level(logging.DEBUG):
        await _expect(call(agent, ""), Code.INVALID_ARGUMENT, "MISSING_THREAD_ID")
        await _expect(call(agent, "thread_nope"), Code.NOT_FOUND, "THREAD_NOT_FOUND")
        details = await _expect(call(agent, HUGE_ID), Code.NOT_FOUND, "THREAD_NOT_FOUND")
        # An id is echoed for the user's sake, but never at a length that swamps the message.
        assert len(details) <= 1024
        await _expect(call(agent, "thread\x00nul"), Code.NOT_FOUND, "THREAD_NOT_FOUND")
    _no_tracebacks(caplog)


async def test_start_thread_limits(agent: Harness, caplog: pytest.LogCaptureFixture) -> None:
    stub = agent.stub
    with caplog.at_level(logging.DEBUG):
        await _expect(
            stub.StartThread(agent_pb2.StartThreadRequest(instructions="x" * (1024 * 1024 + 1))),
            Code.INVALID_ARGUMENT,
            "INSTRUCTIONS_TOO_LARGE",
        )
        await _expect(
            stub.StartThread(agent_pb2.StartThreadRequest(model="m" * 1000)),
            Code.INVALID_ARGUMENT,
            "INVALID_MODEL",
        )
        await _expect(
            stub.StartThread(agent_pb2.StartThreadRequest(model="bad\nmodel")),
            Code.INVALID_ARGUMENT,
            "INVALID_MODEL",
        )
        many = {f"k{i}": "v" for i in range(1000)}
        await _expect(
            stub.StartThread(agent_pb2.StartThreadRequest(metadata=many)),
            Code.INVALID_ARGUMENT,
            "METADATA_TOO_LARGE",
        )
        await _expect(
            stub.StartThread(agent_pb2.StartThreadRequest(metadata={"k": "v" * 100_000})),
            Code.INVALID_ARGUMENT,
            "METADATA_TOO_LARGE",
        )
    _no_tracebacks(caplog)
    assert agent.bundles() == []


async def test_undecodable_requests_are_not_unknown(
    agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    for method in ("StartThread", "StartTurn", "GetThread", "StreamEvents"):
        path = f"/rollout.agent.v1.AgentService/{method}"
        garbage = b"\xff\xff\xff\xff"
        if method == "StreamEvents":
            call: Awaitable[object] = _drain(
                agent.channel.unary_stream(
                    path, request_serializer=None, response_deserializer=None
                )(garbage)
            )
        else:
            call = agent.channel.unary_unary(
                path, request_serializer=None, response_deserializer=None
            )(garbage)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() not in {Code.UNKNOWN, Code.OK}, method


async def _drain(call: grpc.aio.UnaryStreamCall[bytes, bytes]) -> None:
    async for _ in call:
        pass
