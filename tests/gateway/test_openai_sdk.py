"""The unmodified `openai` SDK, only its base URL pointed at the gateway: every call recorded."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseTextDeltaEvent

from agent_server.gateway import Gateway
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import TRACE_REDUCER
from tests.agent_server.scripted_provider import ScriptedProvider, answer, sse
from tests.gateway.conftest import (
    StartGateway,
    bundles,
    calls,
    items_text,
    only_trace,
    reduce_all,
    sdk,
    sync_sdk,
)
from trace_reducer import canonical_json, request_body

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED


def _root(gateway: Gateway) -> Path:
    return gateway.settings.trace_root


async def test_async_responses_whole_and_streamed(gateway: Gateway) -> None:
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    whole = await client.responses.create(model="local", input="hello gateway")
    assert whole.output_text
    # The client sends back the answer as it got it and a new message: the same session, a
    # second turn.
    streamed_text: list[str] = []
    history: list[Any] = [
        {"role": "user", "content": "hello gateway"},
        *(item.model_dump(exclude_none=True) for item in whole.output),
        {"role": "user", "content": "and again"},
    ]
    stream = await client.responses.create(model="local", input=history, stream=True)
    async for event in stream:
        if isinstance(event, ResponseTextDeltaEvent):
            streamed_text.append(event.delta)
    await gateway.stop()
    trace = only_trace(_root(gateway))
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    first, second = calls(trace)
    assert (first.execution.status, second.execution.status) == (COMPLETED, COMPLETED)
    assert items_text(trace, first.response_item_ids) == whole.output_text
    assert items_text(trace, second.response_item_ids) == "".join(streamed_text)
    assert len(trace.turns) == 2
    # The second request's input is the first exchange plus the new message.
    assert list(second.request_item_ids[:2]) == [*first.request_item_ids, *first.response_item_ids]


async def test_a_base_url_without_v1_is_told_the_one_to_use(gateway: Gateway) -> None:
    # Was: `the gateway serves no POST /chat/completions`, which says what failed and not what
    # to set OPENAI_BASE_URL to.
    bare = gateway.url.removesuffix("/v1")
    client = sdk(base_url=bare, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.message == (
        "Error code: 404 - the gateway serves no POST /chat/completions: an OpenAI client's base "
        f"URL (OPENAI_BASE_URL) is {gateway.url}, where it serves POST /v1/responses, "
        "POST /v1/chat/completions and GET /v1/models"
    )
    await gateway.stop()
    assert not bundles(gateway.settings.trace_root)


async def test_a_token_guarded_gateway_tells_the_sdk_where_its_token_goes(
    start_gateway: StartGateway,
) -> None:
    # Was `the gateway needs `Authorization: Bearer <token>``: nothing said that an SDK's API
    # key is what it sends there.
    from grpc_common import AccessControl

    gateway = await start_gateway(access=AccessControl(token="gateway-token"))
    refused = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        await refused.responses.create(model="local", input="hello")
    assert raised.value.message == (
        "Error code: 401 - the gateway needs `Authorization: Bearer <token>`: an OpenAI client "
        "sends its API key (OPENAI_API_KEY) as the token, so set it to the gateway's"
    )
    allowed = sdk(base_url=gateway.url, api_key="gateway-token", max_retries=0)
    assert (await allowed.responses.create(model="local", input="hello")).output_text


async def test_sync_client_and_its_stream_helper(gateway: Gateway) -> None:
    # The sync client blocks its thread: it runs on a worker while the gateway serves here.
    def call() -> tuple[str, str]:
        client = sync_sdk(base_url=gateway.url, api_key="unused", max_retries=0)
        whole = client.responses.create(model="local", input="sync hello")
        with client.responses.stream(model="local", input="helper hello") as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        return whole.output_text, final.output_text

    whole_text, helper_text = await asyncio.to_thread(call)
    await gateway.stop()
    traces = reduce_all(_root(gateway))
    recorded = sorted(items_text(t, calls(t)[0].response_item_ids) for t in traces)
    assert recorded == sorted([whole_text, helper_text])
    assert all(t.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN for t in traces)


async def test_upstream_error_reaches_the_sdk_as_its_error_class(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    provider.queue_error(500, {"error": {"message": "engine fell over", "code": "server_error"}})
    provider.queue_error(429, {"error": {"message": "slow down", "code": "rate_limited"}})
    provider.queue_error(400, {"error": {"message": "bad field", "code": "invalid_value"}})
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="engine fell over"):
        await client.responses.create(model="m", input="one")
    with pytest.raises(openai.RateLimitError, match="slow down"):
        await client.responses.create(model="m", input="two", stream=True)
    with pytest.raises(openai.BadRequestError, match="bad field") as caught:
        await client.responses.create(model="m", input="three")
    assert caught.value.code == "invalid_value"
    await gateway.stop()
    failures = [
        (call.execution.status, call.error.http_status, call.error.code)
        for trace in reduce_all(_root(gateway))
        for call in calls(trace)
    ]
    assert sorted(failures) == sorted(
        [
            (FAILED, 500, "server_error"),
            (FAILED, 429, "rate_limited"),
            (FAILED, 400, "invalid_value"),
        ]
    )


async def test_stream_bytes_pass_through_unchanged(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    script = answer("exactly these bytes", response_id="resp-pass")
    provider.queue(script)
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    raw = await client.responses.with_raw_response.create(model="m", input="x", stream=True)
    body = b"".join([chunk async for chunk in raw.http_response.aiter_bytes()])
    assert body == script.encode()
    assert raw.http_response.headers["content-type"].startswith("text/event-stream")
    assert raw.http_response.headers["x-rollout-thread-id"].startswith("thread_")


async def test_async_chat_whole_and_streamed(gateway: Gateway) -> None:
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello chat"},
    ]
    whole = await client.chat.completions.create(model="local", messages=messages)
    answer = whole.choices[0].message.content
    assert answer
    # Was: no usage in the built-in model's whole answer, and 0 tokens in the bundle.
    assert whole.usage is not None
    assert whole.usage.completion_tokens > 0
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    pieces = []
    stream = await client.chat.completions.create(
        model="local", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    await gateway.stop()
    trace = only_trace(_root(gateway))
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    first, second = calls(trace)
    assert items_text(trace, first.response_item_ids) == answer
    assert items_text(trace, second.response_item_ids) == "".join(pieces)
    assert first.usage.output_tokens == whole.usage.completion_tokens
    assert second.usage.output_tokens > 0
    assert len(trace.turns) == 2
    # The exact messages each call sent come back from the trace.
    (bundle,) = bundles(_root(gateway))
    sent = json.loads(request_body(bundle, second.inference_call_id))
    assert sent["messages"] == messages
    assert sent["stream"] is True


async def test_sync_chat_and_its_stream_helper(gateway: Gateway) -> None:
    def call() -> tuple[str, str]:
        client = sync_sdk(base_url=gateway.url, api_key="unused", max_retries=0)
        whole = client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "sync chat"}]
        )
        with client.chat.completions.stream(
            model="local", messages=[{"role": "user", "content": "helper chat"}]
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        return whole.choices[0].message.content or "", final.choices[0].message.content or ""

    whole_text, helper_text = await asyncio.to_thread(call)
    await gateway.stop()
    traces = reduce_all(_root(gateway))
    recorded = sorted(items_text(t, calls(t)[0].response_item_ids) for t in traces)
    assert recorded == sorted([whole_text, helper_text])


async def test_token_ids_are_recorded_and_kept_from_a_client_that_did_not_ask(
    start_gateway: StartGateway,
) -> None:
    gateway = await start_gateway(token_ids=True)
    messages: list[Any] = [{"role": "user", "content": "count my tokens"}]
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        first = await http.post("/chat/completions", json={"model": "m", "messages": messages})
        assert "token_ids" not in first.text
        answer = first.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        body = {"model": "m", "messages": messages, "stream": True}
        async with http.stream("POST", "/chat/completions", json=body) as streamed:
            raw = b"".join([chunk async for chunk in streamed.aiter_bytes()])
    assert b"token_ids" not in raw
    assert b"[DONE]" in raw
    await gateway.stop()
    trace = only_trace(_root(gateway))
    one, two = calls(trace)
    for call in (one, two):
        assert call.prompt_token_ids
        assert call.output_tokens.exact
        assert call.output_tokens.ids
    assert two.token_drift != common_pb2.TOKEN_DRIFT_UNSPECIFIED


async def test_upstream_url_credentials_go_as_basic_auth_and_nowhere_else(
    start_gateway: StartGateway, provider: ScriptedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    upstream = (
        provider.url.replace("http://", "http://gw-user:s3cret-pw@") + "?api-version=s3cret-q"
    )
    gateway = await start_gateway(upstream)
    provider.queue(answer("through basic auth"))
    client = sdk(base_url=gateway.url, api_key="client-key", max_retries=0)
    stream = await client.responses.create(model="m", input="hi", stream=True)
    text = "".join([e.delta async for e in stream if isinstance(e, ResponseTextDeltaEvent)])
    assert text == "through basic auth"
    (request,) = provider.requests
    expected = base64.b64encode(b"gw-user:s3cret-pw").decode()
    assert request.headers["authorization"] == f"Basic {expected}"
    assert request.path.endswith("/responses?api-version=s3cret-q")
    await gateway.stop()
    (call,) = calls(only_trace(_root(gateway)))
    shown = caplog.text + call.provider_base_url + gateway.upstream_url
    assert "s3cret" not in shown
    assert "127.0.0.1" in call.provider_base_url


async def test_request_gives_back_a_string_input_as_it_was_sent(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # `input` a string, the API's short form of one user message, is recorded as that message
    # (the conversation every reader knows), and `trace-reducer request` gives back the body the
    # upstream got (was: the message list, `{"input":[{"content":...,"role":"user"}],...}`).
    gateway = await start_gateway(provider.url)
    session = {"x-rollout-session": "one-session"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=session) as http:
        provider.queue(answer("first"))
        sent = await http.post("/responses", json={"model": "m", "input": "a string input"})
        assert sent.status_code == 200
        # The same text as a list stays a list.
        provider.queue(answer("second", response_id="resp-2"))
        listed = {"model": "m", "input": [{"role": "user", "content": "a string input"}]}
        assert (await http.post("/responses", json=listed)).status_code == 200
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0, default_headers=session)
    provider.queue(answer("third", response_id="resp-3"))
    stream = await client.responses.create(model="m", input="a streamed string", stream=True)
    assert "".join([e.delta async for e in stream if isinstance(e, ResponseTextDeltaEvent)])
    await gateway.stop()
    upstream_got = [json.loads(request.body) for request in provider.requests]
    assert upstream_got[0] == {"model": "m", "input": "a string input"}
    assert [body["input"] for body in upstream_got] == [
        "a string input",
        [{"role": "user", "content": "a string input"}],
        "a streamed string",
    ]
    (bundle,) = bundles(_root(gateway))
    trace = only_trace(_root(gateway))
    for call, got in zip(calls(trace), upstream_got, strict=True):
        process = await asyncio.create_subprocess_exec(
            TRACE_REDUCER,
            "request",
            str(bundle),
            call.inference_call_id,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        printed, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()
        assert printed == canonical_json(got) + b"\n"
        assert request_body(bundle, call.inference_call_id) == canonical_json(got)
    # The trace's conversation is the user message either way.
    first = calls(trace)[0]
    (item,) = (trace.conversation_items[i] for i in first.request_item_ids)
    assert (item.role, item.content[0].text) == (state_pb2.CONVERSATION_ROLE_USER, "a string input")


@pytest.mark.parametrize("api_key", ["x", "EMPTY", "unused"])
async def test_a_placeholder_key_leaves_the_answer_whole(gateway: Gateway, api_key: str) -> None:
    # What clients of a server that wants no key send (vLLM's docs: `EMPTY`). The gateway
    # passes it upstream, and used to take it out of the answer as a secret: with `x`, every
    # `x` of the stream and body, `output_te***t` events and `te***t` fields, so the SDK saw
    # no text and the bundle recorded none; with `EMPTY`, the word gone from the reply.
    prompt = "say EMPTY text, unused x"
    # Closed here: a client left for the collector logs on a later test's loop.
    async with sdk(base_url=gateway.url, api_key=api_key, max_retries=0) as client:
        whole = await client.responses.create(model="local", input=prompt)
        stream = await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": prompt}], stream=True
        )
        streamed = "".join(
            [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        )
    await gateway.stop()
    assert f'"{prompt}"' in whole.output_text
    assert f'"{prompt}"' in streamed
    recorded = [
        items_text(trace, call.response_item_ids)
        for trace in reduce_all(_root(gateway))
        for call in calls(trace)
    ]
    assert sorted(recorded) == sorted([whole.output_text, streamed])


def _refusal_completion(refusal: str) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "refusal": refusal,
        "annotations": [],
    }
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
    usage = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    return {"id": "chatcmpl-r1", "object": "chat.completion", "choices": [choice], "usage": usage}


def _refusal_chunks(refusal: str) -> str:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": "chatcmpl-r2", "object": "chat.completion.chunk", "choices": [choice]}

    first, rest = refusal[:5], refusal[5:]
    events = [
        chunk({"role": "assistant", "content": None, "refusal": ""}),
        chunk({"refusal": first}),
        chunk({"refusal": rest}),
        chunk({}, "stop"),
    ]
    return sse(*events) + "data: [DONE]\n\n"


async def test_a_chat_refusal_is_recorded(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Structured outputs: the model refuses in `message.refusal` (streamed: `delta.refusal`),
    # `content` null. Was: the SDK got it, the bundle recorded a call with no output at all.
    gateway = await start_gateway(provider.url)
    refusal = "I'm sorry, I can't help with that."
    provider.queue_json(_refusal_completion(refusal))
    provider.queue(_refusal_chunks(refusal))
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "something I may not answer"}]
    whole = await client.chat.completions.create(model="m", messages=messages)
    assert whole.choices[0].message.refusal == refusal
    stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
    streamed = "".join([c.choices[0].delta.refusal or "" async for c in stream if c.choices])
    assert streamed == refusal
    await gateway.stop()
    traces = reduce_all(_root(gateway))
    assert len(traces) == 2
    for trace in traces:
        (call,) = calls(trace)
        assert call.execution.status == COMPLETED
        (item_id,) = call.response_item_ids
        item = trace.conversation_items[item_id]
        assert item.role == state_pb2.CONVERSATION_ROLE_ASSISTANT
        assert [(part.type, part.text) for part in item.content] == [("refusal", refusal)]


async def test_n_choices_reach_the_client_and_choice_0_is_the_output(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # As docs/gateway.md says: the client gets every choice; the trace's conversation has one
    # answer a call, choice 0, and the others stay in the call's raw body.
    gateway = await start_gateway(provider.url)
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        for i, text in enumerate(["the first", "the second"])
    ]
    provider.queue_json({"id": "chatcmpl-n", "object": "chat.completion", "choices": choices})
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    completion = await client.chat.completions.create(
        model="m", n=2, messages=[{"role": "user", "content": "twice"}]
    )
    assert [c.message.content for c in completion.choices] == ["the first", "the second"]
    await gateway.stop()
    (call,) = calls(only_trace(_root(gateway)))
    assert items_text(only_trace(_root(gateway)), call.response_item_ids) == "the first"
    (bundle,) = bundles(_root(gateway))
    dumped = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "dump", "--json", str(bundle), stdout=asyncio.subprocess.PIPE
    )
    printed, _ = await dumped.communicate()
    assert b"the second" in printed


def _completion(usage: dict[str, Any]) -> dict[str, Any]:
    message = {"role": "assistant", "content": "42"}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": "chatcmpl-u", "object": "chat.completion", "choices": [choice], "usage": usage}


def _usage_chunks(usage: dict[str, Any]) -> str:
    choice = {"index": 0, "delta": {"role": "assistant", "content": "42"}, "finish_reason": "stop"}
    answer = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "choices": [choice]}
    last = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    return sse(answer, last) + "data: [DONE]\n\n"


async def test_usage_details_that_are_no_objects_cost_nothing(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Was: `"prompt_tokens_details": "n/a"` raised AttributeError recording the answer; the
    # client got 500 `internal_error` for the upstream's 200, a traceback in the log.
    gateway = await start_gateway(provider.url)
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    odd = {**usage, "prompt_tokens_details": "n/a", "completion_tokens_details": ["x"]}
    provider.queue_json(_completion(odd))
    provider.queue(_usage_chunks(odd))
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "the answer?"}]
    whole = await client.chat.completions.create(model="m", messages=messages)
    assert whole.choices[0].message.content == "42"
    stream = await client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "42"
    await gateway.stop()
    for trace in reduce_all(_root(gateway)):
        (call,) = calls(trace)
        assert call.execution.status == COMPLETED
        assert (call.usage.input_tokens, call.usage.output_tokens) == (5, 1)


async def test_a_chat_answers_reasoning_tokens_are_recorded(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # An o-series model on Chat Completions counts its thinking in
    # `completion_tokens_details.reasoning_tokens`. Was: 0 in the trace (the Responses API's
    # `output_tokens_details` was read, Chat's never), so the bundle's reasoning went uncounted.
    gateway = await start_gateway(provider.url)
    usage = {
        "prompt_tokens": 19,
        "completion_tokens": 80,
        "total_tokens": 99,
        "prompt_tokens_details": {"cached_tokens": 7},
        "completion_tokens_details": {"reasoning_tokens": 64},
    }
    provider.queue_json(_completion(usage))
    provider.queue(_usage_chunks(usage))
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "think first"}]
    whole = await client.chat.completions.create(model="o3", messages=messages)
    assert whole.usage is not None
    stream = await client.chat.completions.create(
        model="o3", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    [chunk async for chunk in stream]
    await gateway.stop()
    traces = reduce_all(_root(gateway))
    assert len(traces) == 2
    for trace in traces:
        (call,) = calls(trace)
        assert (call.usage.reasoning_tokens, call.usage.cached_input_tokens) == (64, 7)
        assert call.usage.output_tokens == 80


def _chat_chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-e", "object": "chat.completion.chunk", "choices": [choice]}


async def test_a_chat_stream_whose_choices_finished_needs_no_done(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Some servers end the stream (a clean EOF) after the last finish_reason, with no
    # `data: [DONE]`; the openai SDK takes that as the whole answer. Was: recorded FAILED,
    # `stream_ended`. A stream cut before a choice finished stays FAILED.
    gateway = await start_gateway(provider.url)
    provider.queue(
        sse(
            _chat_chunk(0, {"role": "assistant", "content": "one"}),
            _chat_chunk(1, {"role": "assistant", "content": "two"}),
            _chat_chunk(0, {}, "stop"),
            _chat_chunk(1, {}, "stop"),
        )
    )
    provider.queue(
        sse(
            _chat_chunk(0, {"role": "assistant", "content": "one"}),
            _chat_chunk(1, {"role": "assistant", "content": "tw"}),
            _chat_chunk(0, {}, "stop"),
        )
    )
    provider.queue(sse(_chat_chunk(0, {"role": "assistant", "content": "cut"})))
    async with sdk(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        texts = []
        for question in ("whole", "choice 1 cut", "choice 0 cut"):
            stream = await client.chat.completions.create(
                model="m", n=2, messages=[{"role": "user", "content": question}], stream=True
            )
            texts.append([c.choices[0].delta.content async for c in stream if c.choices])
    assert texts[0] == ["one", "two", None, None]
    await gateway.stop()
    traces = sorted(reduce_all(_root(gateway)), key=lambda t: t.started_at.ToNanoseconds())
    ended = [
        (call.execution.status, call.end_reason, call.error.message, texts)
        for trace in traces
        for call in calls(trace)
        for texts in [items_text(trace, call.response_item_ids)]
    ]
    cut = (
        "the upstream stream ended without a terminal event (a Chat stream: before every "
        "choice had its finish_reason)"
    )
    assert ended == [
        (COMPLETED, "response.completed", "", "one"),
        (FAILED, "stream_ended", cut, "one"),
        (FAILED, "stream_ended", cut, ""),
    ]


async def test_a_chat_stream_without_usage_is_recorded_as_unknown_tokens(
    start_gateway: StartGateway, provider: ScriptedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    # A client that does not ask for `stream_options.include_usage` gets no usage chunk, and
    # the gateway does not ask on its behalf (its stream stays the upstream's, byte for byte):
    # the call's tokens are unknown. Was: `list` (and the served run list) said 0 tokens.
    from trace_reducer import cli

    gateway = await start_gateway(provider.url)
    script = sse(
        _chat_chunk(0, {"role": "assistant", "content": "no count"}), _chat_chunk(0, {}, "stop")
    )
    script += "data: [DONE]\n\n"
    provider.queue(script)
    async with sdk(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "count?"}], stream=True
        )
        body = b"".join([chunk async for chunk in raw.http_response.aiter_bytes()])
    assert body == script.encode()
    sent = json.loads(provider.requests[0].body)
    assert "stream_options" not in sent
    await gateway.stop()
    (call,) = calls(only_trace(_root(gateway)))
    assert call.execution.status == COMPLETED
    assert not call.HasField("usage")
    capsys.readouterr()
    assert cli.main(["list", "--json", str(_root(gateway))]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    tokens = {"input": None, "output": None, "total": None, "unknown_calls": 1}
    assert json.loads(line)["tokens"] == tokens
    assert cli.main(["list", str(_root(gateway))]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert row.split()[header.split().index("TOKENS")] == "?"
    (bundle,) = bundles(_root(gateway))
    assert cli.main(["reduce", "--stdout", str(bundle)]) == 0
    (reduced,) = json.loads(capsys.readouterr().out)["inference_calls"].values()
    assert "usage" not in reduced
