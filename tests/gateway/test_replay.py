"""`agent-server gateway --replay-from`: the unmodified `openai` SDK against a gateway that answers
from a recorded gateway run — the same run again, and a divergence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from agent_server.gateway import Gateway
from tests.agent_server.scripted_provider import ScriptedProvider
from tests.agent_server.test_chat_dialect import chunk, stream
from tests.agent_server.test_replay import assert_same_run
from tests.gateway.conftest import StartGateway, bundles, sdk
from trace_reducer import read_recorded_thread, replay_bundle, request_body

QUESTIONS = ("hello gateway", "and again, please")


async def _client(gateway: Gateway, dialect: str, questions: tuple[str, ...] = QUESTIONS) -> str:
    """One conversation of two turns, the first whole, the second streamed; what it was told."""
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    told: list[str] = []
    if dialect == "responses":
        history: list[Any] = [{"role": "user", "content": questions[0]}]
        whole = await client.responses.create(model="local", input=history)
        told.append(whole.output_text)
        history += [item.model_dump(exclude_none=True) for item in whole.output]
        history.append({"role": "user", "content": questions[1]})
        stream = await client.responses.create(model="local", input=history, stream=True)
        told.append(
            "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        )
    else:
        messages: list[Any] = [{"role": "user", "content": questions[0]}]
        completion = await client.chat.completions.create(model="local", messages=messages)
        told.append(completion.choices[0].message.content or "")
        messages += [
            {"role": "assistant", "content": told[0]},
            {"role": "user", "content": questions[1]},
        ]
        chunks = await client.chat.completions.create(model="local", messages=messages, stream=True)
        told.append("".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]))
    await client.close()
    return "\n".join(told)


@pytest.mark.parametrize(("dialect", "pace"), [("responses", "fast"), ("chat", "recorded")])
async def test_a_gateway_run_replays_to_the_same_state(
    start_gateway: StartGateway, tmp_path: Path, dialect: str, pace: str
) -> None:
    live = await start_gateway()
    told = await _client(live, dialect)
    await live.stop()
    (original,) = bundles(live.settings.trace_root)

    replay = await start_gateway(
        replay_from=live.settings.trace_root, replay_pace=pace, trace_root=tmp_path / "replayed"
    )
    assert await _client(replay, dialect) == told
    assert replay.replay is not None
    assert (replay.replay.answered, replay.replay.diverged) == (2, 0)
    await replay.stop()
    (replayed,) = bundles(replay.settings.trace_root)
    await assert_same_run(original, replayed)


async def test_a_changed_request_diverges_and_can_go_live(
    start_gateway: StartGateway, provider: ScriptedProvider, tmp_path: Path
) -> None:
    live = await start_gateway()
    await _client(live, "chat")
    await live.stop()

    replay = await start_gateway(replay_from=live.settings.trace_root, trace_root=tmp_path / "a")
    changed = (QUESTIONS[0], "something else")
    with pytest.raises(openai.ConflictError) as raised:
        await _client(replay, "chat", changed)
    error = raised.value
    assert isinstance(error.body, dict)
    assert error.body["code"] == "replay_divergence"
    assert "something else" in error.body["message"]
    assert "recorded call 2" in error.body["message"]
    await replay.stop()

    provider.queue(
        stream(
            chunk({"role": "assistant", "content": "a live "}),
            chunk({"content": "answer"}, finish_reason="stop"),
        )
    )
    onward = await start_gateway(
        provider.url,
        replay_from=live.settings.trace_root,
        replay_on_divergence="live",
        trace_root=tmp_path / "b",
    )
    told = await _client(onward, "chat", changed)
    assert told.endswith("a live answer")
    assert onward.replay is not None
    assert (onward.replay.answered, onward.replay.diverged) == (1, 1)
    assert len(provider.requests) == 1


async def _ask(gateway: Gateway, inputs: tuple[Any, ...]) -> list[str]:
    """One session of Responses calls, the first whole and the rest streamed; what each was told."""
    client = sdk(
        base_url=gateway.url,
        api_key="unused",
        max_retries=0,
        default_headers={"x-rollout-session": "plain-strings"},
    )
    told: list[str] = []
    for index, given in enumerate(inputs):
        if index == 0:
            whole = await client.responses.create(model="local", input=given)
            told.append(whole.output_text)
            continue
        stream = await client.responses.create(model="local", input=given, stream=True)
        told.append(
            "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        )
    await client.close()
    return told


def _sent(bundle: Path) -> list[Any]:
    """The `input` of each request of a bundle, as `trace-reducer request` gives it back."""
    return [
        json.loads(request_body(bundle, call.inference_call_id))["input"]
        for call in read_recorded_thread(bundle).calls
    ]


async def test_a_string_input_replays(start_gateway: StartGateway, tmp_path: Path) -> None:
    # The OpenAI SDK's most common shape: `input` a string (was: 409, the recorded request
    # rebuilt as the one user message and compared with the string).
    asked = ("hello str whole", "hello str stream")
    live = await start_gateway()
    told = await _ask(live, asked)
    await live.stop()
    (original,) = bundles(live.settings.trace_root)
    assert _sent(original) == list(asked)

    replay = await start_gateway(replay_from=live.settings.trace_root, trace_root=tmp_path / "r")
    assert await _ask(replay, asked) == told
    assert replay.replay is not None
    assert (replay.replay.answered, replay.replay.diverged) == (2, 0)
    await replay.stop()
    (replayed,) = bundles(replay.settings.trace_root)
    assert _sent(replayed) == list(asked)
    await assert_same_run(original, replayed)


async def test_a_string_and_its_one_user_message_are_one_request(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    # A string `input` is the one user message it stands for (the API's short form): a run
    # recorded with either shape replays to a client sending the other, and `diff` sees the
    # same run (was: 409, `input: [{"content": ..., "role": "user"}] vs "..."`).
    texts = ("one shape", "or the other")
    as_string: tuple[Any, ...] = texts
    as_message = tuple([{"role": "user", "content": text}] for text in texts)
    shapes = ((as_message, as_string), (as_string, as_message))
    for index, (recorded, replayed_with) in enumerate(shapes):
        root = tmp_path / f"recorded-{index}"
        live = await start_gateway(trace_root=root)
        told = await _ask(live, recorded)
        await live.stop()
        (original,) = bundles(root)
        assert _sent(original) == list(recorded)

        replay = await start_gateway(replay_from=root, trace_root=root.with_name(root.name + "-r"))
        assert await _ask(replay, replayed_with) == told
        assert replay.replay is not None
        assert (replay.replay.answered, replay.replay.diverged) == (2, 0)
        await replay.stop()
        (replayed,) = bundles(replay.settings.trace_root)
        assert _sent(replayed) == list(replayed_with)
        await assert_same_run(original, replayed)


_WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "lookup_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


async def _tool_loop(gateway: Gateway) -> tuple[str, list[bytes]]:
    """The SDK's documented Chat tool loop, a picture in the question: the answer, and the
    bytes of each request the SDK sent."""
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    question = [{"type": "text", "text": "use lookup_weather for Paris"}, _PICTURE]
    messages: list[Any] = [{"role": "user", "content": question, "name": "ana"}]
    sent = []
    first = await client.chat.completions.with_raw_response.create(
        model="local", messages=messages, tools=[_WEATHER_TOOL]
    )
    sent.append(first.http_request.content)
    message = first.parse().choices[0].message
    assert message.tool_calls
    # The message object itself, as the SDK's documentation has it (against OpenAI it sends
    # back `refusal: null` and `annotations: []` too).
    messages.append(message)
    for call in message.tool_calls:
        result = [{"type": "text", "text": "sunny"}]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = await client.chat.completions.with_raw_response.create(
        model="local", messages=messages, tools=[_WEATHER_TOOL]
    )
    sent.append(final.http_request.content)
    await client.close()
    return final.parse().choices[0].message.content or "", sent


async def test_a_chat_tool_loop_with_a_picture_is_recorded_as_sent_and_replays(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    # Was: a Chat message was recorded as its text, role and tool calls only, so the request
    # `trace-reducer request` gave back had no picture, no `name` and the tool result as a
    # string (and, against OpenAI, not the echoed message's `refusal: null`), and the replay of
    # the same client diverged (409 `messages[0].content: "use lookup_weather…" vs [...]`).
    live = await start_gateway()
    told, sent = await _tool_loop(live)
    await live.stop()
    (original,) = bundles(live.settings.trace_root)
    recorded = [
        json.loads(request_body(original, call.inference_call_id))
        for call in read_recorded_thread(original).calls
    ]
    assert recorded == [json.loads(body) for body in sent]
    assert recorded[1]["messages"][0]["content"][1] == _PICTURE

    replay = await start_gateway(replay_from=live.settings.trace_root, trace_root=tmp_path / "r")
    assert (await _tool_loop(replay))[0] == told
    assert replay.replay is not None
    assert (replay.replay.answered, replay.replay.diverged) == (2, 0)
    await replay.stop()
    (replayed,) = bundles(replay.settings.trace_root)
    await assert_same_run(original, replayed)
    # The tool call echoed back is the item the model made, not a second one.
    trace = replay_bundle(original)
    first, second = sorted(trace.inference_calls.values(), key=lambda c: c.execution.started_seq)
    assert set(first.response_item_ids) <= set(second.request_item_ids)
