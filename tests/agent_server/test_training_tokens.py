"""Tokens for training: logprobs and engine ids recorded with their deltas, sampling settings,
policy versions and stop reasons, on the built-in local model and a scripted provider."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_server import toy_tokens
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, error_reason, reduce_with_cli
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
)
from trace_reducer import read_bundle, request_body


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def run_turn(agent: Harness, thread_id: str, text: str, **overrides: Any) -> agent_pb2.Turn:
    events = agent.events(thread_id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(
            thread_id=thread_id, input=[agent_pb2.UserInput(text=text)], **overrides
        )
    )
    return await events.turn_completed(reply.turn.id)


async def closed(agent: Harness, thread: agent_pb2.Thread) -> state_pb2.RolloutTrace:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return await reduce_with_cli(Path(thread.bundle_path))


def token_records(bundle: str) -> list[Any]:
    with read_bundle(bundle) as reader:
        return [
            r.output_text_delta
            for r in reader
            if r.WhichOneof("body") == "output_text_delta"
            and r.output_text_delta.HasField("tokens")
        ]


async def test_logprobs_and_engine_ids_are_recorded_with_their_deltas(local: Harness) -> None:
    thread = await local.start_thread(
        instructions="Answer briefly.",
        capture_logprobs=True,
        top_logprobs=3,
        request_token_ids=True,
        temperature=0.5,
        top_p=0.9,
        policy_version="step-7",
    )
    assert (thread.capture_logprobs, thread.top_logprobs, thread.request_token_ids) == (
        True,
        3,
        True,
    )
    assert thread.temperature == 0.5
    assert thread.policy_version == "step-7"
    turn = await run_turn(local, thread.id, "count the stars", policy_version="step-8")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(local, thread)
    [call] = rollout.inference_calls.values()
    [item_id] = call.response_item_ids
    text = rollout.conversation_items[item_id].content[0].text

    body = json.loads(request_body(thread.bundle_path, call.inference_call_id))
    assert body["include"] == ["message.output_text.logprobs"]
    assert body["top_logprobs"] == 3
    assert body["return_token_ids"] is True
    assert (body["temperature"], body["top_p"]) == (0.5, 0.9)
    # The prompt is the engine's, the output the tokens it sampled: nothing re-tokenized here
    # (the toy tokenizer is the engine's own).
    assert list(call.prompt_token_ids) == toy_tokens.render_prompt("Answer briefly.", body["input"])
    tokens = call.output_tokens
    assert tokens.exact
    assert tokens.source == common_pb2.TOKEN_SOURCE_ENGINE
    assert list(tokens.ids) == [*toy_tokens.encode(text), toy_tokens.END]
    assert tokens.count == len(tokens.ids) == call.usage.output_tokens
    assert [(s.item_id, s.start, s.count) for s in tokens.spans] == [(item_id, 0, tokens.count)]
    prompt_length = len(call.prompt_token_ids)
    for position, (token_id, value) in enumerate(zip(tokens.ids, tokens.logprobs, strict=True)):
        assert math.isclose(
            value, toy_tokens.logprob(token_id, prompt_length + position), abs_tol=1e-6
        )
    assert "".join(tokens.texts[:-1]) == text
    assert tokens.texts[-1] == toy_tokens.END_TEXT
    assert list(tokens.top_counts) == [3] * tokens.count
    assert list(tokens.top_ids[::3]) == list(tokens.ids)
    assert call.sampling.temperature == 0.5
    assert call.sampling.top_p == 0.9
    assert call.sampling.logprobs
    assert call.sampling.token_ids
    assert call.sampling.top_logprobs == 3
    assert not call.sampling.HasField("max_output_tokens")
    # The turn's policy version wins over the thread's.
    assert call.policy_version == "step-8"
    assert call.stop_reason == common_pb2.STOP_REASON_COMPLETED

    # Packed columns in the delta record: a word's tokens cost bytes, not messages.
    records = token_records(thread.bundle_path)
    assert records
    assert all(r.tokens.text_lengths or r.tokens.texts for r in records)
    word_records = [r for r in records if r.tokens.text_lengths]
    assert word_records, "token strings that spell the delta are kept as lengths"
    for record in word_records:
        assert sum(record.tokens.text_lengths) == len(record.delta)


async def test_capture_off_asks_for_nothing_and_records_no_tokens(local: Harness) -> None:
    thread = await local.start_thread()
    assert not thread.capture_logprobs
    assert not thread.HasField("temperature")
    await run_turn(local, thread.id, "hello")
    rollout = await closed(local, thread)
    [call] = rollout.inference_calls.values()
    body = json.loads(request_body(thread.bundle_path, call.inference_call_id))
    assert not {"include", "top_logprobs", "return_token_ids", "temperature"} & set(body)
    assert not call.HasField("output_tokens")
    assert not call.prompt_token_ids
    assert not call.sampling.logprobs
    assert not call.sampling.HasField("temperature")
    assert token_records(thread.bundle_path) == []
    assert call.stop_reason == common_pb2.STOP_REASON_COMPLETED


async def test_max_output_tokens_stops_at_length_and_keeps_the_tokens(local: Harness) -> None:
    thread = await local.start_thread(capture_logprobs=True, request_token_ids=True)
    turn = await run_turn(local, thread.id, "say a lot", max_output_tokens=9)
    # A truncated answer is still an answer: the turn completes, the call says LENGTH.
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(local, thread)
    [call] = rollout.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert call.end_reason == "response.incomplete:max_output_tokens"
    assert call.stop_reason == common_pb2.STOP_REASON_LENGTH
    assert call.sampling.max_output_tokens == 9
    assert call.output_tokens.count == 9
    assert call.output_tokens.exact
    [item_id] = call.response_item_ids
    text = rollout.conversation_items[item_id].content[0].text
    assert list(call.output_tokens.ids) == toy_tokens.encode(text)


async def test_openai_style_logprobs_without_ids_are_derived_not_exact(
    start_agent: StartAgent, provider: ScriptedProvider
) -> None:
    agent = await start_agent()
    item = message("Hi there", "msg-1")

    def delta(text: str, pieces: list[str]) -> dict[str, Any]:
        return {
            "type": "response.output_text.delta",
            "item_id": "msg-1",
            "delta": text,
            "logprobs": [
                {"token": p, "logprob": -0.25, "top_logprobs": [{"token": p, "logprob": -0.25}]}
                for p in pieces
            ],
        }

    provider.queue(
        sse(
            created(),
            item_added(item),
            delta("Hi", ["Hi"]),
            delta(" there", [" the", "re"]),
            item_done(item),
            completed(),
        )
    )
    thread = await agent.start_thread(top_logprobs=1)
    await run_turn(agent, thread.id, "hello")
    sent = provider.requests[0].json()
    assert sent["include"] == ["message.output_text.logprobs"]
    assert sent["top_logprobs"] == 1
    assert "return_token_ids" not in sent
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    tokens = call.output_tokens
    assert tokens.source == common_pb2.TOKEN_SOURCE_LOGPROBS
    assert not tokens.exact
    assert not tokens.ids
    assert list(tokens.texts) == ["Hi", " the", "re"]
    assert list(tokens.logprobs) == [-0.25] * 3
    assert list(tokens.top_counts) == [1] * 3


async def test_logprobs_that_come_only_with_the_done_event_are_kept(
    start_agent: StartAgent, provider: ScriptedProvider
) -> None:
    agent = await start_agent()
    item = message("Hello", "msg-1")
    provider.queue(
        sse(
            created(),
            item_added(item),
            {"type": "response.output_text.delta", "item_id": "msg-1", "delta": "Hello"},
            {
                "type": "response.output_text.done",
                "item_id": "msg-1",
                "text": "Hello",
                "logprobs": [{"token": "Hel", "logprob": -1.0}, {"token": "lo", "logprob": -2.0}],
                "token_ids": [11, 12],
            },
            item_done(item),
            completed(),
        )
    )
    thread = await agent.start_thread(capture_logprobs=True)
    await run_turn(agent, thread.id, "hi")
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert list(call.output_tokens.ids) == [11, 12]
    assert list(call.output_tokens.texts) == ["Hel", "lo"]
    assert call.output_tokens.exact
    [item_id] = call.response_item_ids
    assert rollout.conversation_items[item_id].content[0].text == "Hello"


async def test_stop_reasons_keep_infrastructure_apart_from_the_model(
    start_agent: StartAgent, provider: ScriptedProvider
) -> None:
    agent = await start_agent()
    provider.queue_error(503)
    provider.queue_error(400, {"error": {"code": "invalid_prompt", "message": "no"}})
    thread = await agent.start_thread()
    first = await run_turn(agent, thread.id, "one")
    second = await run_turn(agent, thread.id, "two")
    assert first.status == second.status == agent_pb2.TURN_STATUS_FAILED
    rollout = await closed(agent, thread)
    reasons = [
        rollout.inference_calls[c].stop_reason
        for turn_id in rollout.threads[thread.id].turn_ids
        for c in rollout.turns[turn_id].inference_call_ids
    ]
    assert reasons == [common_pb2.STOP_REASON_INFRA_ERROR, common_pb2.STOP_REASON_PROVIDER_ERROR]


async def test_an_interrupted_call_stops_interrupted(
    local: Harness, start_agent: StartAgent
) -> None:
    agent = await start_agent(provider_url=None, local_word_delay=0.05)
    thread = await agent.start_thread(capture_logprobs=True, request_token_ids=True)
    events = agent.events(thread.id)
    turn = (
        await agent.stub.StartTurn(
            agent_pb2.StartTurnRequest(
                thread_id=thread.id, input=[agent_pb2.UserInput(text="talk")]
            )
        )
    ).turn
    await events.wait_for(lambda e: e.HasField("agent_message_delta"))
    await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.stop_reason == common_pb2.STOP_REASON_INTERRUPTED
    # The tokens of the unfinished item are kept, tied to no accepted item.
    assert call.output_tokens.count > 0
    assert [s.item_id for s in call.output_tokens.spans] == [""]


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"policy_version": "v\n1"}, "policy_version"),
    ],
)
async def test_bad_sampling_settings_are_refused(
    local: Harness, fields: dict[str, Any], where: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await local.start_thread(**fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(refused.value) == "INVALID_SAMPLING"
    assert where in (refused.value.details() or "")
    if where != "top_logprobs":
        thread = await local.start_thread()
        with pytest.raises(grpc.aio.AioRpcError) as on_turn:
            await local.stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="x")], **fields
                )
            )
        assert error_reason(on_turn.value) == "INVALID_SAMPLING"


async def test_hostile_token_fields_never_break_a_turn(
    start_agent: StartAgent, provider: ScriptedProvider
) -> None:
    agent = await start_agent()
    item = message("abc", "msg-1")
    hostile: list[dict[str, Any]] = [
        {"logprobs": "not a list", "token_ids": [1, -2]},
        {"logprobs": [1, None, {"token": 5, "logprob": 10**400}], "token_ids": [2**40]},
        {"logprobs": [{"token": "c", "logprob": "x", "top_logprobs": [3, {"token": None}]}]},
    ]
    provider.queue(
        sse(
            {"type": "response.created", "response": {"id": "r", "prompt_token_ids": ["x"]}},
            item_added(item),
            *(
                {"type": "response.output_text.delta", "item_id": "msg-1", "delta": d, **fields}
                for d, fields in zip("abc", hostile, strict=True)
            ),
            item_done(item),
            completed(),
        )
    )
    thread = await agent.start_thread(capture_logprobs=True)
    turn = await run_turn(agent, thread.id, "go")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert not call.prompt_token_ids
    tokens = call.output_tokens
    # What made sense was kept, the rest left out or marked unknown (NaN), never guessed.
    assert not tokens.exact
    assert not tokens.ids
    assert len(tokens.logprobs) == tokens.count == 2
    assert all(math.isnan(value) for value in tokens.logprobs)
    assert rollout.recording_complete
