"""The Chat Completions dialect: through the agent server against the built-in local model
(speaking Chat with vLLM-shaped token ids) and a scripted Chat provider on loopback."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from agent_server import toy_tokens
from agent_server.chat_completions import CHUNK_EVENT, DONE_EVENT, ChunkMapper, item_id
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.scripted_provider import ScriptedProvider
from trace_reducer import chat_messages, read_bundle, request_body

LOOKUP = agent_pb2.FunctionTool(
    name="lookup",
    description="Look a word up.",
    parameters_json=json.dumps(
        {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        }
    ),
    strict=True,
)


@pytest.fixture
async def chat(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, provider_api="chat", local_word_delay=0.0)


async def run_turn(agent: Harness, thread_id: str, text: str, **fields: Any) -> agent_pb2.Turn:
    events = agent.events(thread_id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(
            thread_id=thread_id, input=[agent_pb2.UserInput(text=text)], **fields
        )
    )
    return await events.turn_completed(reply.turn.id)


async def closed(agent: Harness, thread: agent_pb2.Thread) -> state_pb2.RolloutTrace:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return await reduce_with_cli(Path(thread.bundle_path))


def chunks(bundle: str) -> list[tuple[int, dict[str, Any] | str]]:
    """Every chunk recorded verbatim: (call ordinal, its JSON, or the raw text of [DONE])."""
    with read_bundle(bundle) as reader:
        out: list[tuple[int, dict[str, Any] | str]] = []
        for record in reader:
            if record.WhichOneof("body") != "provider_event":
                continue
            event = record.provider_event
            if event.event_type == CHUNK_EVENT:
                out.append((event.call, json.loads(event.data)))
            elif event.event_type == DONE_EVENT:
                out.append((event.call, event.data))
        return out


def streamed_ids(recorded: list[tuple[int, dict[str, Any] | str]], call: int) -> list[int]:
    ids: list[int] = []
    for ordinal, chunk in recorded:
        if ordinal == call and isinstance(chunk, dict):
            for choice in chunk["choices"]:
                ids.extend(choice.get("token_ids") or [])
    return ids


async def test_a_text_turn_records_every_chunk_and_the_engine_ids(chat: Harness) -> None:
    thread = await chat.start_thread(request_token_ids=True, top_logprobs=2)
    assert (thread.provider_api, thread.provider) == ("chat", "")
    events = chat.events(thread.id)
    turn = await run_turn(chat, thread.id, "hello there")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    deltas = "".join(e.agent_message_delta.delta for e in events.of_kind("agent_message_delta"))
    rollout = await closed(chat, thread)
    [call] = rollout.inference_calls.values()
    [accepted] = call.response_item_ids
    item = rollout.conversation_items[accepted]
    assert item.content[0].text == deltas
    assert deltas.startswith('You said: "hello there".')

    recorded = chunks(thread.bundle_path)
    first = recorded[0][1]
    assert isinstance(first, dict)
    # The item's id is the completion's id and the item's place in it.
    assert item.responses_item_id == item_id(first["id"], 0)
    assert recorded[-1][1] == "[DONE]"
    assert list(call.prompt_token_ids) == first["prompt_token_ids"]
    # Exactly the ids the engine streamed, every one of them, the end token included.
    assert list(call.output_tokens.ids) == streamed_ids(recorded, 1)
    assert call.output_tokens.ids[-1] == toy_tokens.END
    assert call.output_tokens.exact
    assert call.output_tokens.source == common_pb2.TOKEN_SOURCE_ENGINE
    assert len(call.output_tokens.logprobs) == call.output_tokens.count
    assert list(call.output_tokens.top_counts) == [2] * call.output_tokens.count
    assert call.usage.output_tokens == call.output_tokens.count
    assert call.stop_reason == common_pb2.STOP_REASON_COMPLETED
    assert call.sampling.token_ids
    assert call.sampling.logprobs


async def test_a_tool_round_trip_in_chat_continues_the_engine_ids_exactly(
    chat: Harness,
) -> None:
    thread = await chat.start_thread(request_token_ids=True, tools=[LOOKUP])
    events = chat.events(thread.id)
    reply = await chat.stub.StartTurn(
        agent_pb2.StartTurnRequest(
            thread_id=thread.id,
            input=[agent_pb2.UserInput(text="please lookup otters")],
        )
    )
    requested = await events.wait_for(lambda e: e.HasField("tool_call_requested"))
    call = requested.tool_call_requested
    assert call.name == "lookup"
    assert json.loads(call.arguments) == {"query": "please lookup otters"}
    await chat.stub.SubmitToolOutputs(
        agent_pb2.SubmitToolOutputsRequest(
            thread_id=thread.id,
            turn_id=reply.turn.id,
            outputs=[agent_pb2.ToolOutput(call_id=call.call_id, output="otters are mustelids")],
        )
    )
    turn = await events.turn_completed(reply.turn.id)
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    second_turn = await run_turn(chat, thread.id, "thanks")
    assert second_turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(chat, thread)
    calls = sorted(rollout.inference_calls.values(), key=lambda c: c.execution.started_seq)
    assert len(calls) == 3
    assert [c.token_drift for c in calls] == [
        common_pb2.TOKEN_DRIFT_UNSPECIFIED,
        common_pb2.TOKEN_DRIFT_EXACT,
        common_pb2.TOKEN_DRIFT_EXACT,
    ]
    for before, after in itertools.pairwise(calls):
        held = [*before.prompt_token_ids, *before.output_tokens.ids]
        assert after.held_token_count == len(held)
        assert list(after.prompt_token_ids[: len(held)]) == held

    # What was posted, rebuilt from the trace: Chat messages, the call and its output as
    # Chat spells them.
    second = json.loads(request_body(thread.bundle_path, calls[1].inference_call_id))
    assert "input" not in second
    assert second["stream_options"] == {"include_usage": True}
    assert second["tools"][0]["function"]["name"] == "lookup"
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["user", "assistant", "tool"]
    assert second["messages"][1]["tool_calls"][0]["id"] == call.call_id
    assert second["messages"][2] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "otters are mustelids",
    }


async def test_a_cut_at_max_output_tokens_is_a_length_answer_in_both_dialects(
    start_agent: StartAgent,
) -> None:
    for api in ("chat", "responses"):
        agent = await start_agent(provider_url=None, provider_api=api, local_word_delay=0.0)
        thread = await agent.start_thread(request_token_ids=True)
        turn = await run_turn(agent, thread.id, "say a lot", max_output_tokens=7)
        assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, api
        rollout = await closed(agent, thread)
        [call] = rollout.inference_calls.values()
        assert call.stop_reason == common_pb2.STOP_REASON_LENGTH, api
        assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
        assert call.output_tokens.count == 7
        [accepted] = call.response_item_ids
        assert rollout.conversation_items[accepted].content[0].text.startswith("You said")


async def test_tool_choice_is_sent_in_both_dialects_and_a_turn_overrides_it(
    start_agent: StartAgent,
) -> None:
    required = agent_pb2.ToolChoice(mode=agent_pb2.TOOL_CHOICE_MODE_REQUIRED)
    for api in ("chat", "responses"):
        agent = await start_agent(provider_url=None, provider_api=api, local_word_delay=0.0)
        thread = await agent.start_thread(
            tools=[LOOKUP], tool_choice=required, parallel_tool_calls=False
        )
        assert thread.tool_choice.mode == agent_pb2.TOOL_CHOICE_MODE_REQUIRED
        events = agent.events(thread.id)
        # The message names no tool: only tool_choice makes the model call one.
        await agent.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=thread.id, input=[agent_pb2.UserInput(text="hi")])
        )
        requested = await events.wait_for(lambda e: e.HasField("tool_call_requested"))
        assert requested.tool_call_requested.name == "lookup"
        await agent.stub.Interrupt(
            agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=requested.turn_id)
        )
        none = agent_pb2.ToolChoice(mode=agent_pb2.TOOL_CHOICE_MODE_NONE)
        turn = await run_turn(agent, thread.id, "lookup again", tool_choice=none)
        assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
        assert not turn.tool_calls
        rollout = await closed(agent, thread)
        calls = sorted(rollout.inference_calls.values(), key=lambda c: c.execution.started_seq)
        bodies = [json.loads(request_body(thread.bundle_path, c.inference_call_id)) for c in calls]
        assert [b["tool_choice"] for b in bodies] == ["required", "none"], api
        assert {b["parallel_tool_calls"] for b in bodies} == {False}


async def test_a_named_function_must_be_a_tool_of_the_thread(chat: Harness) -> None:
    named = agent_pb2.ToolChoice(mode=agent_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name="nope")
    with pytest.raises(Exception, match="not a tool of the thread"):
        await chat.start_thread(tools=[LOOKUP], tool_choice=named)
    bare = agent_pb2.ToolChoice(mode=agent_pb2.TOOL_CHOICE_MODE_FUNCTION)
    with pytest.raises(Exception, match="needs a function_name"):
        await chat.start_thread(tools=[LOOKUP], tool_choice=bare)


# -- against a scripted Chat provider -------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}}
    choice.update(fields)
    return {"id": "chatcmpl-7", "object": "chat.completion.chunk", "choices": [choice]}


def stream(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


async def test_optional_fields_a_provider_refuses_are_best_effort_by_default(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(provider_api="chat")
    refusal = {"detail": [{"loc": ["body", "return_token_ids"], "msg": "Extra inputs"}]}
    provider.queue_error(422, {"error": {"message": json.dumps(refusal)}})
    provider.queue(stream(chunk({"content": "Hi."}), chunk(finish_reason="stop")))
    thread = await agent.start_thread(request_token_ids=True)
    turn = await run_turn(agent, thread.id, "hello")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    first, second = (json.loads(r.body) for r in provider.requests)
    assert first["return_token_ids"] is True
    assert "return_token_ids" not in second
    shown = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert list(shown.thread.refused_fields) == ["return_token_ids"]
    rollout = await closed(agent, thread)
    calls = sorted(rollout.inference_calls.values(), key=lambda c: c.attempt)
    assert [c.execution.status for c in calls] == [
        common_pb2.EXECUTION_STATUS_FAILED,
        common_pb2.EXECUTION_STATUS_COMPLETED,
    ]
    assert "return_token_ids" in calls[0].error.message
    # The call that went on has no engine ids: its tokens are not exact.
    assert not calls[1].output_tokens.exact
    assert not calls[1].sampling.token_ids


async def test_a_required_optional_field_that_is_refused_fails_the_turn_naming_it(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(provider_api="chat")
    provider.queue_error(400, {"error": {"message": "top_logprobs is not supported"}})
    thread = await agent.start_thread(
        top_logprobs=3, optional_fields=agent_pb2.OPTIONAL_FIELD_POLICY_REQUIRED
    )
    turn = await run_turn(agent, thread.id, "hello")
    assert turn.status == agent_pb2.TURN_STATUS_FAILED
    assert turn.error.code == "optional_field_refused"
    assert "top_logprobs" in turn.error.message
    assert "is not supported" in turn.error.message
    assert len(provider.requests) == 1


async def test_reasoning_parallel_calls_and_a_mid_stream_error_chunk(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(provider_api="chat")
    calls = [
        {"index": 0, "id": "call_a", "function": {"name": "lookup", "arguments": '{"query":'}},
        {"index": 1, "id": "call_b", "function": {"name": "lookup", "arguments": ""}},
    ]
    provider.queue(
        stream(
            chunk({"role": "assistant", "reasoning_content": "Two lookups."}),
            chunk({"tool_calls": [calls[0]]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "a"}'}}]}),
            chunk({"tool_calls": [calls[1]]}),
            chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"query": "b"}'}}]}),
            chunk(finish_reason="tool_calls"),
        )
    )
    provider.queue(
        "data: "
        + json.dumps(chunk({"content": "Half"}))
        + "\n\ndata: "
        + json.dumps({"object": "error", "message": "engine died", "code": 500})
        + "\n\n"
    )
    thread = await agent.start_thread(tools=[LOOKUP])
    events = agent.events(thread.id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread.id, input=[agent_pb2.UserInput(text="go")])
    )
    waiting = await events.wait_for(lambda e: e.HasField("turn_awaiting_tool_outputs"))
    requested = [e.tool_call_requested for e in events.of_kind("tool_call_requested")]
    assert [(r.call_id, json.loads(r.arguments)) for r in requested] == [
        ("call_a", {"query": "a"}),
        ("call_b", {"query": "b"}),
    ]
    await agent.stub.SubmitToolOutputs(
        agent_pb2.SubmitToolOutputsRequest(
            thread_id=thread.id,
            turn_id=waiting.turn_id,
            outputs=[
                agent_pb2.ToolOutput(call_id="call_a", output="A"),
                agent_pb2.ToolOutput(call_id="call_b", output="B"),
            ],
        )
    )
    turn = await events.turn_completed(reply.turn.id)
    assert turn.status == agent_pb2.TURN_STATUS_FAILED
    assert "engine died" in turn.error.message
    second = json.loads(provider.requests[1].body)
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in second["messages"][1]["tool_calls"]] == ["call_a", "call_b"]
    rollout = await closed(agent, thread)
    # Both calls are attempt 1 of their request: the turn's own order says which came first.
    first_call = rollout.inference_calls[rollout.turns[reply.turn.id].inference_call_ids[0]]
    kinds = [rollout.conversation_items[i].kind for i in first_call.response_item_ids]
    assert kinds == [
        state_pb2.ITEM_KIND_REASONING,
        state_pb2.ITEM_KIND_FUNCTION_CALL,
        state_pb2.ITEM_KIND_FUNCTION_CALL,
    ]


def test_the_mapper_puts_tokens_without_text_on_the_item_they_belong_to() -> None:
    mapper = ChunkMapper()
    events = [
        *mapper.chunk({"id": "c1", "prompt_token_ids": [5, 6], "choices": []}),
        *mapper.chunk(chunk({"role": "assistant", "content": ""}, token_ids=[70])),
        *mapper.chunk(chunk({"content": "Hi"}, token_ids=[71])),
        *mapper.chunk(chunk({}, token_ids=[2], finish_reason="length")),
        *mapper.chunk({"id": "c1", "choices": [], "usage": {"prompt_tokens": 2}}),
        *mapper.done(),
    ]
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].data["response"]["prompt_token_ids"] == [5, 6]
    # The id that came before any text goes with the first text; the end token on its own.
    assert [e.data.get("token_ids") for e in events[2:4]] == [[70, 71], [2]]
    assert events[4].data["item"]["status"] == "incomplete"
    assert events[5].data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_messages_from_items_group_calls_under_one_assistant_message() -> None:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    out = chat_messages("be brief", items)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"]
    assert out[2]["content"] == "a"
    assert out[4] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


async def test_a_chat_conversation_holds_each_assistant_answer_once(chat: Harness) -> None:
    # Each request sends the earlier answers back as Chat messages (a string content): the
    # reducer matches each to the output item it was (was: a second, new item per answer).
    thread = await chat.start_thread()
    for text in ("one", "two", "three"):
        turn = await run_turn(chat, thread.id, text)
        assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(chat, thread)
    items = rollout.conversation_items
    conversation = list(rollout.threads[thread.id].conversation_item_ids)
    user, assistant = state_pb2.CONVERSATION_ROLE_USER, state_pb2.CONVERSATION_ROLE_ASSISTANT
    assert [items[i].role for i in conversation] == [user, assistant] * 3
    calls = sorted(rollout.inference_calls.values(), key=lambda c: c.execution.started_seq)
    assert len(calls) == 3
    for number, call in enumerate(calls):
        assert list(call.request_item_ids) == conversation[: 2 * number + 1]
        assert list(call.response_item_ids) == [conversation[2 * number + 1]]


def without_done(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)


async def test_a_stream_that_ends_without_done_after_its_finish_is_an_answer(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    # The stream ends cleanly after the finish_reason and the usage, with no `data: [DONE]`
    # (the openai SDK takes it whole). Was: the turn failed with stream_ended.
    agent = await start_agent(provider_api="chat", max_retries=0)
    usage = {
        "id": "chatcmpl-7",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    provider.queue(without_done(chunk({"content": "Hi."}), chunk(finish_reason="stop"), usage))
    thread = await agent.start_thread()
    turn = await run_turn(agent, thread.id, "hello")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert call.stop_reason == common_pb2.STOP_REASON_COMPLETED
    assert (call.usage.input_tokens, call.usage.output_tokens) == (3, 2)
    [accepted] = call.response_item_ids
    assert rollout.conversation_items[accepted].content[0].text == "Hi."


async def test_a_stream_cut_before_its_finish_reason_still_fails(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(provider_api="chat", max_retries=0)
    provider.queue(without_done(chunk({"content": "Hal"})))
    thread = await agent.start_thread()
    turn = await run_turn(agent, thread.id, "hello")
    assert turn.status == agent_pb2.TURN_STATUS_FAILED
    assert turn.error.code == "stream_ended"
    # Says why, as the gateway does (was: the words a Responses stream gets, no word of the
    # choice that never finished).
    cut = (
        "the provider stream ended without a terminal event (a Chat stream: before every "
        "choice had its finish_reason)"
    )
    assert cut in turn.error.message
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_FAILED
    assert call.end_reason == "stream_ended"
    assert call.error.message == cut
    assert not call.response_item_ids
