"""Hostile timing and content in the tool loop and the provider stream: races, duplicate call
ids, stale statuses, events after `error`, counts no integer column holds."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
)
from tests.agent_server.test_tools import LOOKUP, function_call, requested, start_tool_turn
from tests.trace_reducer.live import eventually
from trace_reducer import read_bundle

IN_PROGRESS = agent_pb2.TURN_STATUS_IN_PROGRESS
AWAITING = agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS
INTERRUPTED = agent_pb2.TURN_STATUS_INTERRUPTED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
# Long enough that a turn wedged until it would fail the test by its own timeout.
WEDGE_SECONDS = 3600.0
TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


def records(thread: agent_pb2.Thread) -> list[record_pb2.TraceRecord]:
    with read_bundle(thread.bundle_path) as reader:
        return list(reader)


def awaiting_outputs(turn_id: str) -> Callable[[agent_pb2.ThreadEvent], bool]:
    return lambda e: e.turn_id == turn_id and e.HasField("turn_awaiting_tool_outputs")


def submit_request(thread_id: str, turn_id: str, call_id: str) -> Any:
    return agent_pb2.SubmitToolOutputsRequest(
        thread_id=thread_id,
        turn_id=turn_id,
        outputs=[agent_pb2.ToolOutput(call_id=call_id, output="answer")],
    )


async def test_an_interrupt_racing_the_last_output_always_stops_the_turn(
    start_agent: StartAgent,
) -> None:
    # Was: about one race in five the cancellation was swallowed (asyncio.wait_for on 3.11),
    # the turn went on to its next request and Interrupt waited for the tool-output timeout.
    agent = await start_agent(
        provider_url=None, local_word_delay=0.0, tool_output_timeout=WEDGE_SECONDS
    )
    thread = await agent.start_thread(tools=[LOOKUP])
    events = agent.events(thread.id)
    for _ in range(30):
        turn = await agent.start_turn(thread.id, "lookup the weather")
        await events.wait_for(awaiting_outputs(turn.id))
        [call] = [
            e.tool_call_requested
            for e in events.of_kind("tool_call_requested")
            if e.turn_id == turn.id
        ]
        submitted, interrupted = await asyncio.wait_for(
            asyncio.gather(
                agent.stub.SubmitToolOutputs(submit_request(thread.id, turn.id, call.call_id)),
                agent.stub.Interrupt(
                    agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id)
                ),
                return_exceptions=True,
            ),
            30,
        )
        final = (await events.turn_completed(turn.id)).status
        if isinstance(interrupted, grpc.aio.AioRpcError):
            # Refused only when the output came first and the turn had ended before it.
            assert interrupted.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert final == agent_pb2.TURN_STATUS_COMPLETED
            continue
        # Interrupt was accepted (the turn was running when it came): the turn stopped.
        assert not isinstance(interrupted, BaseException), interrupted
        assert interrupted.turn.status == INTERRUPTED
        assert final == INTERRUPTED
        if isinstance(submitted, grpc.aio.AioRpcError):
            # Only when the interrupt came first: the turn no longer waited for outputs.
            assert submitted.code() == grpc.StatusCode.FAILED_PRECONDITION
    rollout = await reduce_after_close(agent, thread)
    assert {t.execution.status for t in rollout.turns.values()} <= {CANCELLED, COMPLETED}
    # A turn that woke before its interrupt came stopped in its next request, cancelled.
    for turn_state in rollout.turns.values():
        calls = [rollout.inference_calls[c] for c in turn_state.inference_call_ids]
        assert len(calls) <= 2
        if len(calls) == 2 and turn_state.execution.status == CANCELLED:
            assert calls[1].execution.status == CANCELLED


async def reduce_after_close(agent: Harness, thread: agent_pb2.Thread) -> Any:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return await reduce_with_cli(Path(thread.bundle_path))


async def test_the_output_completing_a_round_answers_in_progress(local: Harness) -> None:
    # Was: the answer still said AWAITING_TOOL_OUTPUTS (5 runs out of 5).
    for _ in range(5):
        thread, events, turn = await start_tool_turn(
            local, "convert 3 miles, then lookup the answer", [LOOKUP, CONVERT]
        )
        convert, lookup = await requested(events, 2)
        await events.wait_for(lambda e: e.HasField("turn_awaiting_tool_outputs"))
        first = await local.stub.SubmitToolOutputs(
            submit_request(thread.id, turn.id, lookup.call_id)
        )
        # One call still waits: the turn does too.
        assert first.turn.status == AWAITING
        last = await local.stub.SubmitToolOutputs(
            submit_request(thread.id, turn.id, convert.call_id)
        )
        assert last.turn.status == IN_PROGRESS
        assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED


CONVERT = agent_pb2.FunctionTool(name="convert", description="Convert units.")


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def test_two_calls_with_one_call_id_fail_the_turn_at_once(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    # Was: one call stayed pending forever, every output was DUPLICATE_TOOL_OUTPUT, and the
    # turn waited for the tool-output timeout (600 s by default).
    agent = await start_agent(tool_output_timeout=WEDGE_SECONDS)
    first = function_call("call-same")
    second = {**function_call("call-same"), "id": "fc-second"}
    provider.queue(
        sse(
            created(),
            item_added(first),
            item_done(first),
            item_added(second),
            item_done(second),
            completed(),
        )
    )
    thread, events, turn = await start_tool_turn(agent, "go", [LOOKUP])
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_FAILED
    assert done.error.code == "duplicate_call_id"
    assert "call-same" in done.error.message
    assert [c.status for c in done.tool_calls] == [agent_pb2.TOOL_CALL_STATUS_CANCELLED] * 2
    # The thread goes on: the next turn is answered.
    provider.queue(answer("next"))
    again = await agent.start_turn(thread.id, "again")
    assert (await events.turn_completed(again.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await reduce_after_close(agent, thread)
    # Nothing the provider sent is lost: both calls are accepted items and ended tool calls.
    calls = [
        i.responses_item_id
        for i in rollout.conversation_items.values()
        if i.kind == state_pb2.ITEM_KIND_FUNCTION_CALL
    ]
    assert sorted(calls) == ["fc-call-same", "fc-second"]
    assert {t.execution.status for t in rollout.tool_calls.values()} == {CANCELLED}
    [call] = rollout.turns[turn.id].inference_call_ids
    assert rollout.inference_calls[call].error.code == "duplicate_call_id"


async def test_a_response_failed_read_after_the_error_is_recorded(
    provider: ScriptedProvider, agent: Harness
) -> None:
    # Was: the attempt ended on `error` and closed the stream; the `response.failed` the real
    # API sends next, in a later read, was never recorded.
    later = asyncio.Event()
    failed = {
        "type": "response.failed",
        "response": {"id": "resp-1", "error": {"code": "server_error", "message": "later"}},
    }
    provider.queue(
        sse(created(), {"type": "error", "code": "overloaded", "message": "first"}),
        later,
        sse(failed),
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    bundle = Path(thread.bundle_path) / "trace.binpb"
    await eventually(lambda: b'"overloaded"' in bundle.read_bytes(), "the error is recorded")
    later.set()
    final = await events.turn_completed(turn.id)
    assert (final.error.code, final.error.message) == ("overloaded", "first")
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    kinds = [r.provider_event.event_type for r in records(thread) if r.HasField("provider_event")]
    assert kinds == ["error", "response.failed"]


async def test_a_stream_still_open_after_its_error_ends_the_attempt_in_bounded_time(
    provider: ScriptedProvider, agent: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_server import turn as turn_module

    # A provider that never ends its stream after `error` cannot hold the turn.
    monkeypatch.setattr(turn_module, "DRAIN_SECONDS", 0.2)
    never = asyncio.Event()
    provider.queue(sse(created(), {"type": "error", "code": "overloaded", "message": "x"}), never)
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    final = await events.turn_completed(turn.id)
    assert final.error.code == "overloaded"
    never.set()


@pytest.mark.parametrize(
    ("usage", "output_tokens"),
    [
        ('{"input_tokens": 18446744073709551616, "output_tokens": 1}', 1),
        ('{"input_tokens": 9223372036854775808, "output_tokens": -1, "total_tokens": true}', 0),
        ('{"input_tokens": 1e400, "output_tokens": "many", "total_tokens": NaN}', 0),
    ],
)
async def test_counts_no_column_holds_never_cost_the_answer(
    provider: ScriptedProvider, agent: Harness, usage: str, output_tokens: int
) -> None:
    # Was: 2**64 turned the completed answer into FAILED `internal` after it was accepted.
    item = message("fine", "msg-1")
    completed_event = (
        f'{{"type": "response.completed", "response": {{"id": "r", "usage": {usage}}}}}'
    )
    provider.queue(
        sse(created(), {**item_added(item), "output_index": 2**40}, item_done(item))
        + f"data: {completed_event}\n\n"
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    final = await events.turn_completed(turn.id)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await reduce_after_close(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    # What fits is kept, what does not is left out; the raw event keeps it verbatim.
    assert (call.usage.input_tokens, call.usage.output_tokens) == (0, output_tokens)
    raw = [r.provider_event.data for r in records(thread) if r.HasField("provider_event")]
    assert completed_event in raw


@pytest.mark.parametrize("logprob", ["-1e999", "NaN", "null"])
async def test_export_rl_writes_every_accepted_number_as_strict_json(
    provider: ScriptedProvider, agent: Harness, tmp_path: Path, logprob: str
) -> None:
    # Was: `internal error: ValueError: Out of range float values` and an empty output file,
    # for two rewards of 1.5e308 (the mean overflowed) or a logprob of null, NaN or -1e999.
    item = message("hi there", "msg-1")
    created_event = {**created(), "prompt_token_ids": [1, 2, 3]}
    deltas = (
        f'data: {{"type": "response.output_text.delta", "item_id": "msg-1", "delta": "hi",'
        f' "token_ids": [7], "logprobs": [{{"token": "hi", "logprob": {logprob}}}]}}\n\n'
        'data: {"type": "response.output_text.delta", "item_id": "msg-1", "delta": " there",'
        ' "token_ids": [8], "logprobs": [{"token": " there", "logprob": -0.5}]}\n\n'
    )
    provider.queue(
        sse(created_event, item_added(item)) + deltas + sse(item_done(item), completed())
    )
    thread = await agent.start_thread(capture_logprobs=True, request_token_ids=True)
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    for _ in range(2):
        await agent.stub.RecordReward(
            agent_pb2.RecordRewardRequest(thread_id=thread.id, name="score", value=1.5e308)
        )
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    out = tmp_path / "rl"
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "export-rl", thread.bundle_path, "--format", "jsonl", "--out", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    [written] = out.iterdir()
    [line] = written.read_text().splitlines()
    # Strict JSON: no NaN, no Infinity.
    sample = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the output"))
    assert sample["reward"] == 1.5e308
    assert sample["logprobs"][-2:] == [None, -0.5]
    assert sample["token_ids"][-2:] == [7, 8]
