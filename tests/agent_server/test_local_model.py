"""The built-in local model speaks the Responses SSE protocol through the real client."""

from __future__ import annotations

import json

import aiohttp
import pytest

from agent_server.local_model import LocalModel, last_user_text, reply_words
from agent_server.provider import ProviderClient, ProviderError


async def stream_text(model: LocalModel, text: str) -> tuple[list[str], str]:
    client = ProviderClient(model.url, None, idle_timeout=10)
    try:
        body = {
            "model": "local-echo-1",
            "stream": True,
            "store": False,
            "input": [{"type": "message", "role": "user", "content": text}],
        }
        types: list[str] = []
        out = ""
        async with client.batches("inf_test", body) as reader:
            while batch := await reader.next():
                for event in batch:
                    assert event.data is not None
                    types.append(event.type)
                    if event.type == "response.output_text.delta":
                        out += event.data["delta"]
        return types, out
    finally:
        await client.aclose()


async def test_reply_is_deterministic_and_streamed_word_by_word() -> None:
    model = await LocalModel.start(word_delay=0)
    try:
        types, first = await stream_text(model, "tell me about traces")
        _, again = await stream_text(model, "tell me about traces")
    finally:
        await model.stop()
    assert first == again == "".join(reply_words("tell me about traces"))
    assert first.startswith('You said: "tell me about traces".')
    assert len(first.split()) > 40
    assert types[:2] == ["response.created", "response.output_item.added"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    assert types.count("response.output_text.delta") == len(reply_words("tell me about traces"))


async def test_it_refuses_what_it_does_not_speak() -> None:
    model = await LocalModel.start(word_delay=0)
    client = ProviderClient(model.url + "/nowhere", None, idle_timeout=10)
    try:
        with pytest.raises(ProviderError) as raised:
            async with client.batches("inf_test", {"stream": True}) as reader:
                await reader.next()
    finally:
        await client.aclose()
        await model.stop()
    assert (raised.value.http_status, raised.value.code) == (404, "not_found")
    assert not raised.value.retryable


def test_last_user_text() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "old"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "reply"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "new"}]},
    ]
    assert last_user_text(items) == "new"
    assert last_user_text("garbage") == ""


@pytest.mark.parametrize(
    ("route", "body"),
    [
        # JSON's escape of a lone surrogate, as a gateway client sends it (was: HTTP 500).
        ("/responses", b'{"model": "m", "input": "\\ud800"}'),
        ("/responses", b'{"model": "m", "stream": true, "input": "a\\udfff\\ud800"}'),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
        ),
        # The surrogate encoded as bytes, which json reads with surrogatepass.
        ("/responses", b'{"model": "m", "input": "x\xed\xa0\x80y"}'),
    ],
)
async def test_lone_surrogates_in_a_request_become_u_fffd(route: str, body: bytes) -> None:
    model = await LocalModel.start(word_delay=0, full_protocol=True)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(model.url + route, data=body) as answer,
        ):
            status, text = answer.status, await answer.text()
    finally:
        await model.stop()
    assert status == 200, text  # was 500 "internal error": UnicodeEncodeError
    assert "\\ufffd" in text or "\ufffd" in text
    assert "\\ud8" not in text
    assert "\\udf" not in text


@pytest.mark.parametrize("options", ["yes", ["include_usage"], None, {"include_usage": True}])
async def test_any_stream_options_shape_is_answered(options: object) -> None:
    # Was: a string or list made the model fail (AttributeError), a 500 through the gateway.
    model = await LocalModel.start(word_delay=0)
    try:
        async with aiohttp.ClientSession() as session:
            body = {
                "model": "local-echo-1",
                "stream": True,
                "stream_options": options,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with session.post(f"{model.url}/chat/completions", json=body) as reply:
                status, text = reply.status, await reply.text()
    finally:
        await model.stop()
    assert status == 200, text
    assert text.rstrip().endswith("data: [DONE]")
    assert ('"usage"' in text) == (options == {"include_usage": True})


async def test_a_whole_chat_answer_counts_its_tokens_as_the_stream_does() -> None:
    # Was: no `usage` in a non-streamed chat.completion, so gateway bundles recorded 0 tokens.
    model = await LocalModel.start(word_delay=0, full_protocol=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{model.url}/chat/completions"
            async with session.post(url, json={"model": "m", "messages": messages}) as reply:
                whole = await reply.json()
            body = {
                "model": "m",
                "messages": messages,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with session.post(url, json=body) as reply:
                chunks = [
                    line.removeprefix("data: ")
                    for line in (await reply.text()).splitlines()
                    if line.startswith("data: ")
                ]
    finally:
        await model.stop()
    assert chunks[-1] == "[DONE]"
    # OpenAI's last chunk before [DONE]: no choices, the usage.
    last = json.loads(chunks[-2])
    assert last["choices"] == []
    usage = whole["usage"]
    assert usage == last["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        # A call id that is no string, where the model looks up the tool a call named.
        (
            "/responses",
            {
                "stream": True,
                "input": [
                    {"type": "function_call", "call_id": ["c"], "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                ],
            },
        ),
        (
            "/responses",
            {"input": [{"type": "function_call_output", "call_id": {"a": 1}, "output": "x"}]},
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "tool", "tool_call_id": {"a": 1}, "content": "x"}]},
        ),
    ],
)
async def test_a_call_id_of_any_shape_is_answered(route: str, body: dict[str, object]) -> None:
    # Was: TypeError (unhashable type), a 500 with a traceback in the log, through the gateway.
    model = await LocalModel.start(word_delay=0, full_protocol=True)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(model.url + route, json={"model": "m", **body}) as answer,
        ):
            status, text = answer.status, await answer.text()
    finally:
        await model.stop()
    assert status == 200, text
    assert 'returned: \\"x\\"' in text or 'returned: "x"' in text
