"""Every RPC's documented error codes, each with its ErrorInfo reason; never UNKNOWN."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, StartAgent, error_info, error_reason
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    Step,
    answer,
    created,
    item_added,
    message,
    sse,
    text_delta,
)

Code = grpc.StatusCode


async def expect(call: Awaitable[object], code: grpc.StatusCode, reason: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert (raised.value.code(), error_reason(raised.value)) == (code, reason)
    return raised.value.details() or ""


def turn_request(thread_id: str, *inputs: agent_pb2.UserInput) -> agent_pb2.StartTurnRequest:
    return agent_pb2.StartTurnRequest(thread_id=thread_id, input=inputs)


async def test_unknown_or_missing_thread(agent: Harness) -> None:
    stub = agent.stub
    text = agent_pb2.UserInput(text="hi")
    for call in (
        stub.StartTurn(turn_request("thread_nope", text)),
        stub.Interrupt(agent_pb2.InterruptRequest(thread_id="thread_nope", turn_id="t")),
        stub.GetThread(agent_pb2.GetThreadRequest(thread_id="thread_nope")),
        stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id="thread_nope")),
    ):
        assert "thread_nope" in await expect(call, Code.NOT_FOUND, "THREAD_NOT_FOUND")
    events = agent.events("thread_nope")
    await events.until_end()
    assert events.error is not None
    assert events.error.code() == Code.NOT_FOUND
    assert error_reason(events.error) == "THREAD_NOT_FOUND"
    await expect(
        stub.GetThread(agent_pb2.GetThreadRequest()), Code.INVALID_ARGUMENT, "MISSING_THREAD_ID"
    )


async def test_start_turn_rejects_bad_input(agent: Harness) -> None:
    thread = await agent.start_thread()
    stub = agent.stub
    bad = {
        "EMPTY_INPUT": [
            turn_request(thread.id),
            turn_request(thread.id, agent_pb2.UserInput(text="")),
            turn_request(thread.id, agent_pb2.UserInput()),
        ],
        "INPUT_TOO_LARGE": [
            turn_request(thread.id, agent_pb2.UserInput(text="x" * (1024 * 1024 + 1))),
            turn_request(thread.id, *(agent_pb2.UserInput(text="é" * 200_000) for _ in range(3))),
        ],
    }
    for reason, requests in bad.items():
        for request in requests:
            await expect(stub.StartTurn(request), Code.INVALID_ARGUMENT, reason)
    reply = await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert list(reply.thread.turns) == []


async def test_one_turn_at_a_time_and_none_after_close(
    provider: ScriptedProvider, agent: Harness
) -> None:
    gate = asyncio.Event()
    provider.queue(gate, answer("late"))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "first")
    await expect(
        agent.start_turn(thread.id, "second"), Code.FAILED_PRECONDITION, "TURN_ALREADY_RUNNING"
    )
    gate.set()
    await events.turn_completed(turn.id)
    for turn_id, code, reason in (
        (turn.id, Code.FAILED_PRECONDITION, "TURN_NOT_RUNNING"),
        # A turn the thread never had is not found, as for every RPC that names a turn.
        ("turn_other", Code.NOT_FOUND, "TURN_NOT_FOUND"),
    ):
        await expect(
            agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn_id)),
            code,
            reason,
        )
    await expect(
        agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id)),
        Code.INVALID_ARGUMENT,
        "MISSING_TURN_ID",
    )
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    # Closing twice is fine; starting a turn on a closed thread is not.
    again = await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    assert again.thread.status == agent_pb2.THREAD_STATUS_CLOSED
    await expect(agent.start_turn(thread.id, "more"), Code.FAILED_PRECONDITION, "THREAD_CLOSED")


async def test_stream_events_out_of_range(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(event_buffer=3)
    gates = [asyncio.Event() for _ in range(3)]
    steps: list[Step] = [sse(created(), item_added(message("", "msg-1")))]
    for number, gate in enumerate(gates):
        steps += [gate, sse(text_delta(f" {number}"))]
    provider.queue(*steps, asyncio.Event())
    thread = await agent.start_thread()
    beyond = agent.events(thread.id, after_index=1)
    await beyond.until_end()
    assert beyond.error is not None
    assert beyond.error.code() == Code.OUT_OF_RANGE
    assert error_reason(beyond.error) == "EVENT_INDEX_OUT_OF_RANGE"
    # Both ends, whichever side the index is past (was: only the end it passed).
    ends = dict(error_info(beyond.error).metadata)
    assert (int(ends["first_index"]), int(ends["last_index"])) == (1, 0)

    live = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "count")
    # One event at a time, so the live subscriber never falls out of the small buffer.
    for number, gate in enumerate(gates):
        gate.set()
        expected = f" {number}"
        await live.wait_for(lambda e: e.agent_message_delta.delta == expected)  # noqa: B023
    # Interrupt answers once the turn has stopped: every event of it is published by then.
    await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
    dropped = agent.events(thread.id, after_index=0)
    await dropped.until_end()
    assert dropped.error is not None
    assert dropped.error.code() == Code.OUT_OF_RANGE
    metadata = error_info(dropped.error).metadata
    first_index = int(metadata["first_index"])
    assert first_index > 1
    assert int(metadata["last_index"]) >= first_index

    resumed = agent.events(thread.id, after_index=first_index - 1)
    assert (await resumed.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_INTERRUPTED
    assert [e.index for e in resumed.events] == [first_index, first_index + 1, first_index + 2]


async def test_shutdown_refuses_new_work(agent: Harness) -> None:
    thread = await agent.start_thread()
    await agent.server.agent.shutdown()
    await expect(agent.start_thread(), Code.UNAVAILABLE, "SHUTTING_DOWN")
    await expect(
        agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id)),
        Code.UNAVAILABLE,
        "SHUTTING_DOWN",
    )


async def test_unexpected_failures_are_internal_never_unknown(
    agent: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(thread_id: str) -> None:
        raise RuntimeError("bug with a secret-looking detail")

    monkeypatch.setattr(agent.server.agent, "thread", broken)
    details = await expect(
        agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id="x")), Code.INTERNAL, "INTERNAL"
    )
    assert "secret-looking" not in details
    events = agent.events("x")
    await events.until_end()
    assert events.error is not None
    assert events.error.code() == Code.INTERNAL
    assert any("GetThread failed unexpectedly" in r.getMessage() for r in caplog.records)


async def test_unknown_enum_numbers_are_invalid_argument(agent: Harness) -> None:
    # proto3 keeps an enum number it does not know; each was taken as unset (the turn ran
    # without its tool_choice, the listing matched nothing) with no word to the client.
    stub = agent.stub
    unknown = agent_pb2.ToolChoice(mode=99)  # type: ignore[arg-type]
    cases: list[tuple[Awaitable[object], str, str]] = [
        (
            stub.StartThread(agent_pb2.StartThreadRequest(tool_choice=unknown)),
            "INVALID_SAMPLING",
            "tool_choice",
        ),
        (
            stub.StartThread(agent_pb2.StartThreadRequest(optional_fields=99)),  # type: ignore[arg-type]
            "INVALID_SAMPLING",
            "optional_fields",
        ),
        (
            stub.ListThreads(agent_pb2.ListThreadsRequest(status=99)),  # type: ignore[arg-type]
            "INVALID_STATUS_FILTER",
            "status",
        ),
    ]
    thread = await agent.start_thread()
    cases.append(
        (
            stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="hi")], tool_choice=unknown
                )
            ),
            "INVALID_SAMPLING",
            "tool_choice",
        )
    )
    for call, reason, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == Code.INVALID_ARGUMENT
        info = error_info(raised.value)
        assert (info.reason, info.metadata["field"]) == (reason, field)
        assert "99" in (raised.value.details() or "")
    # Nothing was started by the refused calls: the one thread, no turn.
    listed = await stub.ListThreads(agent_pb2.ListThreadsRequest())
    assert [t.id for t in listed.threads] == [thread.id]
    shown = await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert not shown.thread.turns
    # The known numbers still go through.
    active = await stub.ListThreads(
        agent_pb2.ListThreadsRequest(status=agent_pb2.THREAD_STATUS_ACTIVE)
    )
    assert [t.id for t in active.threads] == [thread.id]


async def test_a_request_over_the_receive_limit_is_grpcs_own_refusal(agent: Harness) -> None:
    # gRPC's C core refuses it before any interceptor or handler runs: the one error without
    # an ErrorInfo, as README's "Status codes" says.
    from grpc_status import rpc_status

    from grpc_common import DEFAULT_MAX_RECEIVE_BYTES

    huge = agent_pb2.StartThreadRequest(instructions="x" * (DEFAULT_MAX_RECEIVE_BYTES + 1))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.stub.StartThread(huge)
    assert raised.value.code() == Code.RESOURCE_EXHAUSTED
    assert "larger than max" in (raised.value.details() or "")
    assert rpc_status.from_call(raised.value) is None  # type: ignore[arg-type]
    # The server is unharmed.
    await agent.start_thread()
