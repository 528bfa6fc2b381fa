"""Function tools end to end: declared, called, answered over gRPC, recorded and reduced."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import (
    EventLog,
    Harness,
    StartAgent,
    error_reason,
    reduce_with_cli,
    serve,
)
from tests.agent_server.scripted_provider import (
    RESET,
    ScriptedProvider,
    answer,
    completed,
    created,
    item_added,
    item_done,
    sse,
)
from trace_reducer import replay_bundle, request_body, state_to_json

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
AWAITING = agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS

LOOKUP = agent_pb2.FunctionTool(
    name="lookup",
    description="Look something up.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    ),
)
CONVERT = agent_pb2.FunctionTool(
    name="convert",
    description="Convert units.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"amount": {"type": "number"}, "unit": {"type": "string"}}}
    ),
)


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    """The agent on its built-in local model, which calls the tools a message names."""
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def start_tool_turn(
    agent: Harness, text: str, tools: list[agent_pb2.FunctionTool]
) -> tuple[agent_pb2.Thread, EventLog, agent_pb2.Turn]:
    thread = await agent.start_thread(tools=tools)
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, text)
    return thread, events, turn


async def requested(events: EventLog, count: int) -> list[agent_pb2.ToolCallRequestedEvent]:
    await events.wait_for(
        lambda _: len(events.of_kind("tool_call_requested")) >= count,
    )
    return [e.tool_call_requested for e in events.of_kind("tool_call_requested")]


async def submit(
    agent: Harness, thread_id: str, turn_id: str, *outputs: tuple[str, str, bool]
) -> agent_pb2.Turn:
    reply = await agent.stub.SubmitToolOutputs(
        agent_pb2.SubmitToolOutputsRequest(
            thread_id=thread_id,
            turn_id=turn_id,
            outputs=[
                agent_pb2.ToolOutput(call_id=call_id, output=output, is_error=is_error)
                for call_id, output, is_error in outputs
            ],
        )
    )
    return reply.turn


async def get_turn(agent: Harness, thread_id: str, turn_id: str) -> agent_pb2.Turn:
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread_id))
    [turn] = [t for t in reply.thread.turns if t.id == turn_id]
    return turn


async def closed_state(agent: Harness, thread: agent_pb2.Thread) -> state_pb2.RolloutTrace:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return await reduce_with_cli(Path(thread.bundle_path))


def calls_of(rollout: state_pb2.RolloutTrace, turn_id: str) -> list[state_pb2.InferenceCall]:
    return [rollout.inference_calls[c] for c in rollout.turns[turn_id].inference_call_ids]


async def test_a_tool_round_trip_on_the_local_model(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(
        local, "please lookup the tallest mountain", [LOOKUP]
    )
    assert [t.name for t in thread.tools] == ["lookup"]
    [call] = await requested(events, 1)
    assert call.name == "lookup"
    assert json.loads(call.arguments) == {"query": "please lookup the tallest mountain"}
    # The arguments streamed before the call was announced.
    pieces = [
        e.tool_call_arguments_delta
        for e in events.of_kind("tool_call_arguments_delta")
        if e.tool_call_arguments_delta.item_id == call.item_id
    ]
    assert {piece.call_id for piece in pieces} == {call.call_id}
    assert "".join(piece.delta for piece in pieces) == call.arguments
    awaiting = await events.wait_for(lambda e: e.HasField("turn_awaiting_tool_outputs"))
    assert awaiting.turn_awaiting_tool_outputs.turn.status == AWAITING
    waiting = await get_turn(local, thread.id, turn.id)
    assert waiting.status == AWAITING
    assert [(c.call_id, c.status) for c in waiting.tool_calls] == [
        (call.call_id, agent_pb2.TOOL_CALL_STATUS_PENDING)
    ]

    answered = await submit(local, thread.id, turn.id, (call.call_id, "Mount Everest", False))
    assert answered.id == turn.id
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_COMPLETED
    [completion] = [e.tool_call_completed for e in events.of_kind("tool_call_completed")]
    assert (completion.call_id, completion.output, completion.is_error) == (
        call.call_id,
        "Mount Everest",
        False,
    )
    final_texts = [e.item_completed.item.text for e in events.of_kind("item_completed")]
    assert 'The tool lookup returned: "Mount Everest".' in final_texts
    shown = await get_turn(local, thread.id, turn.id)
    assert [c.status for c in shown.tool_calls] == [agent_pb2.TOOL_CALL_STATUS_COMPLETED]

    rollout = await closed_state(local, thread)
    first, second = calls_of(rollout, turn.id)
    [tool_call] = rollout.tool_calls.values()
    assert rollout.turns[turn.id].tool_call_ids == [tool_call.tool_call_id]
    assert tool_call.execution.status == COMPLETED
    assert (tool_call.name, tool_call.call_id) == ("lookup", call.call_id)
    assert tool_call.requested_by_inference_call_id == first.inference_call_id
    assert tool_call.submitted_by.startswith("ipv")
    # call item -> tool call -> output item -> the next inference call
    call_item = rollout.conversation_items[tool_call.call_item_id]
    assert call_item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL
    assert (call_item.name, call_item.call_id, call_item.responses_item_id) == (
        "lookup",
        call.call_id,
        call.item_id,
    )
    assert json.loads(call_item.arguments) == json.loads(call.arguments)
    assert [p.inference.inference_call_id for p in call_item.produced_by] == [
        first.inference_call_id
    ]
    assert first.response_item_ids == [tool_call.call_item_id]
    output_item = rollout.conversation_items[tool_call.output_item_id]
    assert output_item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT
    assert (output_item.call_id, output_item.output) == (call.call_id, "Mount Everest")
    assert [p.tool.tool_call_id for p in output_item.produced_by] == [tool_call.tool_call_id]
    assert second.request_item_ids[-2:] == [tool_call.call_item_id, tool_call.output_item_id]
    thread_items = rollout.threads[thread.id].conversation_item_ids
    assert thread_items == [*second.request_item_ids, *second.response_item_ids]

    # The follow-up request, rebuilt from the bundle: tools, the call, its output, in order.
    body = json.loads(request_body(thread.bundle_path, second.inference_call_id))
    assert body["tools"] == [
        {
            "type": "function",
            "name": "lookup",
            "description": "Look something up.",
            "parameters": json.loads(LOOKUP.parameters_json),
            "strict": False,
        }
    ]
    assert [item.get("type") for item in body["input"]] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert body["input"][2] == {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": "Mount Everest",
    }
    # The same bundle reduces to the same bytes, twice.
    again = await asyncio.to_thread(replay_bundle, thread.bundle_path)
    assert state_to_json(again) == state_to_json(
        await asyncio.to_thread(replay_bundle, thread.bundle_path)
    )
    assert state_to_json(again) == state_to_json(rollout)


async def test_parallel_calls_answered_in_several_submissions(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(
        local, "convert 3 miles, then lookup the answer", [LOOKUP, CONVERT]
    )
    convert, lookup = await requested(events, 2)
    assert (convert.name, lookup.name) == ("convert", "lookup")
    assert json.loads(convert.arguments) == {"unit": "convert 3 miles, then lookup the answer"}
    first = await submit(local, thread.id, turn.id, (lookup.call_id, "42", False))
    assert [c.status for c in first.tool_calls] == [
        agent_pb2.TOOL_CALL_STATUS_PENDING,
        agent_pb2.TOOL_CALL_STATUS_COMPLETED,
    ]
    assert first.status in (agent_pb2.TURN_STATUS_IN_PROGRESS, AWAITING)
    await submit(local, thread.id, turn.id, (convert.call_id, "unit unknown", True))
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed_state(local, thread)
    statuses = {t.name: (t.execution.status, t.is_error) for t in rollout.tool_calls.values()}
    assert statuses == {"convert": (FAILED, True), "lookup": (COMPLETED, False)}
    _, second = calls_of(rollout, turn.id)
    body = json.loads(request_body(thread.bundle_path, second.inference_call_id))
    kinds = [(item.get("type"), item.get("call_id")) for item in body["input"][1:]]
    # The calls, then their outputs, in the order of the calls.
    assert kinds == [
        ("function_call", convert.call_id),
        ("function_call", lookup.call_id),
        ("function_call_output", convert.call_id),
        ("function_call_output", lookup.call_id),
    ]


async def test_outputs_in_one_submission_and_the_next_turn_goes_on(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(local, "lookup and convert", [LOOKUP, CONVERT])
    calls = await requested(events, 2)
    await submit(local, thread.id, turn.id, *((c.call_id, f"out {c.name}", False) for c in calls))
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    second = await local.start_turn(thread.id, "thanks, no tools now")
    assert (await events.turn_completed(second.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed_state(local, thread)
    assert len(rollout.tool_calls) == 2
    assert rollout.turns[second.id].tool_call_ids == []


@pytest.mark.parametrize(
    ("tools", "fragment"),
    [
        ([agent_pb2.FunctionTool(name="")], "a name is"),
        ([agent_pb2.FunctionTool(name="has space")], "a name is"),
        ([agent_pb2.FunctionTool(name="x" * 65)], "a name is"),
        ([LOOKUP, LOOKUP], "another tool"),
        ([agent_pb2.FunctionTool(name="t", parameters_json="{nope")], "not JSON"),
        ([agent_pb2.FunctionTool(name="t", parameters_json="[1]")], "JSON Schema object"),
        (
            [agent_pb2.FunctionTool(name="t", parameters_json='{"maximum": Infinity}')],
            "Infinity is not a JSON number",
        ),
        ([agent_pb2.FunctionTool(name="t", parameters_json='{"a": NaN}')], "NaN is not"),
        ([agent_pb2.FunctionTool(name=f"t{n}") for n in range(129)], "at most 128"),
    ],
)
async def test_bad_tools_are_refused(
    agent: Harness, tools: list[agent_pb2.FunctionTool], fragment: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.start_thread(tools=tools)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(raised.value) == "INVALID_TOOL"
    assert fragment in (raised.value.details() or "")


def _nested_schema(depth: int) -> str:
    """An object schema whose properties nest `depth` levels below it."""
    return '{"type":"object","properties":' + '{"a":' * depth + "{}" + "}" * depth + "}"


async def test_a_schema_nested_past_the_limit_is_refused_when_declared(
    agent: Harness, provider: ScriptedProvider
) -> None:
    # Was: accepted when json read it (how deep it reads depends on the stack it runs on: ~975
    # in the server), and then every turn of the thread FAILED with `internal error:
    # RecursionError` and a traceback, from recording the request.
    for depth in (64, 500, 100_000):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await agent.start_thread(
                tools=[agent_pb2.FunctionTool(name="t", parameters_json=_nested_schema(depth))]
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason(raised.value) == "INVALID_TOOL"
        assert "parameters_json nests deeper than 64 levels" in (raised.value.details() or "")
    # One level less is a thread whose turns run.
    thread = await agent.start_thread(
        tools=[agent_pb2.FunctionTool(name="t", parameters_json=_nested_schema(62))]
    )
    events = agent.events(thread.id)
    provider.queue(answer("fine"))
    turn = await agent.start_turn(thread.id, "go")
    ended = await events.turn_completed(turn.id)
    assert ended.status == agent_pb2.TURN_STATUS_COMPLETED, ended.error


async def test_bad_submissions_get_their_codes(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(local, "lookup and convert", [LOOKUP, CONVERT])
    convert, lookup = await requested(events, 2)

    async def refused(request: agent_pb2.SubmitToolOutputsRequest) -> tuple[str, str]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await local.stub.SubmitToolOutputs(request)
        return raised.value.code().name, error_reason(raised.value)

    def request(*outputs: agent_pb2.ToolOutput, **ids: str) -> agent_pb2.SubmitToolOutputsRequest:
        fields: dict[str, Any] = {"thread_id": thread.id, "turn_id": turn.id, **ids}
        return agent_pb2.SubmitToolOutputsRequest(outputs=list(outputs), **fields)

    ok = agent_pb2.ToolOutput(call_id=lookup.call_id, output="fine")
    assert await refused(request(ok, thread_id="thread_nope")) == ("NOT_FOUND", "THREAD_NOT_FOUND")
    assert await refused(request(ok, turn_id="turn_nope")) == ("NOT_FOUND", "TURN_NOT_FOUND")
    assert await refused(request()) == ("INVALID_ARGUMENT", "EMPTY_TOOL_OUTPUTS")
    unknown = agent_pb2.ToolOutput(call_id="call_nope", output="x")
    assert await refused(request(unknown)) == ("INVALID_ARGUMENT", "UNKNOWN_CALL_ID")
    assert await refused(request(ok, ok)) == ("INVALID_ARGUMENT", "DUPLICATE_TOOL_OUTPUT")
    huge = agent_pb2.ToolOutput(call_id=lookup.call_id, output="x" * (1024 * 1024 + 1))
    assert await refused(request(huge)) == ("INVALID_ARGUMENT", "TOOL_OUTPUT_TOO_LARGE")
    # Nothing of a refused request was taken: both calls are still pending.
    pending = await get_turn(local, thread.id, turn.id)
    assert {c.status for c in pending.tool_calls} == {agent_pb2.TOOL_CALL_STATUS_PENDING}
    await local.stub.SubmitToolOutputs(request(ok))
    assert await refused(request(ok)) == ("INVALID_ARGUMENT", "DUPLICATE_TOOL_OUTPUT")
    await local.stub.SubmitToolOutputs(
        request(agent_pb2.ToolOutput(call_id=convert.call_id, output="3"))
    )
    await events.turn_completed(turn.id)
    late = agent_pb2.ToolOutput(call_id=convert.call_id, output="late")
    assert await refused(request(late)) == (
        "FAILED_PRECONDITION",
        "TURN_NOT_AWAITING_TOOL_OUTPUTS",
    )


async def test_interrupt_while_awaiting_cancels_the_calls(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(local, "lookup something", [LOOKUP])
    [call] = await requested(events, 1)
    reply = await local.stub.Interrupt(
        agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id)
    )
    assert reply.turn.status == agent_pb2.TURN_STATUS_INTERRUPTED
    assert [c.status for c in reply.turn.tool_calls] == [agent_pb2.TOOL_CALL_STATUS_CANCELLED]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await submit(local, thread.id, turn.id, (call.call_id, "too late", False))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(raised.value) == "TURN_NOT_AWAITING_TOOL_OUTPUTS"
    # The conversation goes on: the next request carries an output for the cancelled call.
    following = await local.start_turn(thread.id, "never mind")
    assert (await events.turn_completed(following.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed_state(local, thread)
    [tool_call] = rollout.tool_calls.values()
    assert tool_call.execution.status == CANCELLED
    assert tool_call.error.code == "interrupted"
    output = rollout.conversation_items[tool_call.output_item_id]
    assert "cancelled" in output.output
    assert rollout.turns[turn.id].execution.status == CANCELLED
    [next_call] = calls_of(rollout, following.id)
    assert tool_call.output_item_id in next_call.request_item_ids


async def test_close_while_awaiting(local: Harness) -> None:
    thread, events, turn = await start_tool_turn(local, "lookup something", [LOOKUP])
    await requested(events, 1)
    closed = await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    [shown] = closed.thread.turns
    assert shown.status == agent_pb2.TURN_STATUS_INTERRUPTED
    rollout = await reduce_with_cli(Path(thread.bundle_path))
    assert rollout.recording_complete
    [tool_call] = rollout.tool_calls.values()
    assert tool_call.execution.status == CANCELLED
    assert rollout.turns[turn.id].interrupt.requested_by == "close_thread"


async def test_no_output_in_time_fails_the_turn(start_agent: StartAgent) -> None:
    agent = await start_agent(provider_url=None, local_word_delay=0.0, tool_output_timeout=0.2)
    thread, events, turn = await start_tool_turn(agent, "lookup it", [LOOKUP])
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_FAILED
    assert done.error.code == "tool_output_timeout"
    assert [c.status for c in done.tool_calls] == [agent_pb2.TOOL_CALL_STATUS_FAILED]
    rollout = await closed_state(agent, thread)
    [tool_call] = rollout.tool_calls.values()
    assert tool_call.execution.status == FAILED
    assert tool_call.error.code == "tool_output_timeout"


def function_call(call_id: str, name: str = "lookup", arguments: str = "{}") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc-{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


async def test_too_many_rounds_fail_the_turn(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_tool_rounds=1)
    for round_number in (1, 2):
        call = function_call(f"call-{round_number}")
        provider.queue(sse(created(), item_added(call), item_done(call), completed()))
    thread, events, turn = await start_tool_turn(agent, "go", [LOOKUP])
    [first] = await requested(events, 1)
    await submit(agent, thread.id, turn.id, (first.call_id, "one", False))
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_FAILED
    assert done.error.code == "max_tool_rounds"
    rollout = await closed_state(agent, thread)
    statuses = sorted((t.call_id, t.execution.status) for t in rollout.tool_calls.values())
    assert statuses == [("call-1", COMPLETED), ("call-2", CANCELLED)]


async def test_a_call_cut_mid_arguments_is_discarded_evidence(
    provider: ScriptedProvider, agent: Harness
) -> None:
    call = function_call("call-x", arguments="")
    provider.queue(
        sse(
            created(),
            item_added(call),
            {
                "type": "response.function_call_arguments.delta",
                "item_id": "fc-call-x",
                "delta": '{"query": "hal',
            },
        ),
        RESET,
    )
    thread, events, turn = await start_tool_turn(agent, "go", [LOOKUP])
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_FAILED
    assert not events.of_kind("tool_call_requested")
    rollout = await closed_state(agent, thread)
    assert not rollout.tool_calls
    [inference] = calls_of(rollout, turn.id)
    [discarded] = inference.discarded_outputs
    assert (discarded.item_type, discarded.partial_text) == ("function_call", '{"query": "hal')


async def test_reasoning_items_stream_and_become_reasoning_items(
    provider: ScriptedProvider, agent: Harness
) -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs-1",
        "summary": [{"type": "summary_text", "text": "Think first."}],
    }
    provider.queue(
        sse(
            created(),
            {"type": "response.output_item.added", "item": {**reasoning, "summary": []}},
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": "rs-1",
                "delta": "Think ",
            },
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": "rs-1",
                "delta": "first.",
            },
            item_done(reasoning),
        )
        + answer("Done thinking.", "msg-r").split("\n\n", 1)[1]
    )
    thread, events, turn = await start_tool_turn(agent, "think", [])
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    deltas = [e.reasoning_delta for e in events.of_kind("reasoning_delta")]
    assert "".join(d.delta for d in deltas) == "Think first."
    assert {d.item_id for d in deltas} == {"rs-1"}
    rollout = await closed_state(agent, thread)
    [item] = [i for i in rollout.conversation_items.values() if i.responses_item_id == "rs-1"]
    assert item.kind == state_pb2.ITEM_KIND_REASONING
    assert [(p.type, p.text) for p in item.content] == [("summary_text", "Think first.")]


@pytest.mark.parametrize("how", ["sigterm", "kill"])
async def test_a_served_agent_stopped_while_awaiting(tmp_path: Path, how: str) -> None:
    traces = tmp_path / "traces"
    async with serve("--local-word-delay", "0", ROLLOUT_TRACE_ROOT=str(traces)) as served:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            thread = (await stub.StartThread(agent_pb2.StartThreadRequest(tools=[LOOKUP]))).thread
            events = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id)))
            await stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="lookup it")]
                )
            )
            await events.wait_for(lambda e: e.HasField("tool_call_requested"))
            served.process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
            await events.until_end()
        code = await served.process.wait()
    rollout = await reduce_with_cli(Path(thread.bundle_path))
    [tool_call] = rollout.tool_calls.values()
    [turn] = rollout.turns.values()
    if how == "sigterm":
        assert code == 0
        assert rollout.recording_complete
        assert tool_call.execution.status == CANCELLED
        assert turn.execution.status == CANCELLED
    else:
        assert code == -signal.SIGKILL
        assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_UNCLOSED
        # Unfinished, exactly as an unfinished inference call: RUNNING, with its call item.
        assert tool_call.execution.status == RUNNING
        assert turn.execution.status == RUNNING
        assert rollout.conversation_items[tool_call.call_item_id].name == "lookup"


# A tool_output_timeout no other wait in the server uses: only the tool wait gets the stand-in.
_RACED_TIMEOUT = 123.25


async def test_outputs_taken_as_the_timer_fires_answer_the_round(
    start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: the timer fired, SubmitToolOutputs ran before the turn task resumed and answered
    # OK, and the turn still failed with tool_output_timeout. The stand-in timer expires at
    # the moment the outputs wake the wait: the order the race produced.
    real_timeout = asyncio.timeout

    @contextlib.asynccontextmanager
    async def expires_as_answered(delay: float | None) -> AsyncIterator[None]:
        if delay != _RACED_TIMEOUT:
            async with real_timeout(delay):
                yield
            return
        yield
        raise TimeoutError

    monkeypatch.setattr(asyncio, "timeout", expires_as_answered)
    agent = await start_agent(
        provider_url=None, local_word_delay=0.0, tool_output_timeout=_RACED_TIMEOUT
    )
    thread, events, turn = await start_tool_turn(agent, "lookup it", [LOOKUP])
    [call] = await requested(events, 1)
    shown = await submit(agent, thread.id, turn.id, (call.call_id, "found", False))
    assert shown.status == agent_pb2.TURN_STATUS_IN_PROGRESS
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_COMPLETED, done.error
    rollout = await closed_state(agent, thread)
    assert rollout.turns[turn.id].execution.status == COMPLETED
