"""Sessions: keys from a header, a path prefix, hints or continuation; closes; rewards; access."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from agent_server.gateway import Gateway
from agent_server.gateway._sessions import Session, SessionKey, Sessions
from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    UntilClosed,
    answer,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from tests.gateway.conftest import StartGateway, bundles, calls, items_text, reduce_all, sdk
from trace_reducer import build_sample, read_rewards, replay_bundle

CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
FAILED = common_pb2.EXECUTION_STATUS_FAILED


def _client(gateway: Gateway, **headers: str) -> openai.AsyncOpenAI:
    return sdk(
        base_url=gateway.url, api_key="unused", max_retries=0, default_headers=headers or None
    )


def _metadata(path: Path) -> dict[str, str]:
    trace = replay_bundle(path)
    (thread,) = trace.threads.values()
    return dict(thread.metadata)


async def test_a_header_names_the_session(gateway: Gateway) -> None:
    one = _client(gateway, **{"x-rollout-session": "run-1"})
    other = _client(gateway, **{"x-rollout-session": "run-2"})
    await one.responses.create(model="m", input="first")
    await one.responses.create(model="m", input="unrelated, same session")
    await other.responses.create(model="m", input="another run")
    await gateway.stop()
    found = {
        _metadata(path)["gateway.session"]: path for path in bundles(gateway.settings.trace_root)
    }
    assert sorted(found) == ["run-1", "run-2"]
    assert _metadata(found["run-1"])["gateway.session_source"] == "header"
    assert len(calls(replay_bundle(found["run-1"]))) == 2


async def test_a_path_prefix_names_the_session(gateway: Gateway) -> None:
    base = gateway.url.removesuffix("/v1") + "/s/job-7/v1"
    client = sdk(base_url=base, api_key="unused", max_retries=0)
    await client.responses.create(model="m", input="a")
    await client.responses.create(model="m", input="b")
    await gateway.stop()
    (path,) = bundles(gateway.settings.trace_root)
    assert _metadata(path)["gateway.session"] == "job-7"
    assert _metadata(path)["gateway.session_source"] == "path"
    assert len(replay_bundle(path).turns) == 2


async def test_continuation_without_a_key_and_why_a_session_started(gateway: Gateway) -> None:
    client = _client(gateway)
    first = await client.responses.create(model="m", input="start here")
    echo = [item.model_dump(exclude_none=True) for item in first.output]
    history: list[Any] = [{"role": "user", "content": "start here"}, *echo]
    await client.responses.create(model="m", input=[*history, {"role": "user", "content": "more"}])
    # Input that extends nothing open: a session of its own.
    await client.responses.create(model="m", input="something else entirely")
    await gateway.stop()
    traces = reduce_all(gateway.settings.trace_root)
    assert sorted(len(calls(t)) for t in traces) == [1, 2]
    for trace in traces:
        (thread,) = trace.threads.values()
        assert thread.metadata["gateway.session_source"] == "new"
        assert "extends no open session" in thread.metadata["gateway.session_reason"]


async def test_an_sdk_retry_stays_in_the_session_of_the_call_it_retries(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # The SDK's default: two retries of a 408, 409, 429, 5xx or timeout, each the same body.
    # Was: the retry's input repeats the failed call's, extending no exchange, so it started a
    # session of its own and the conversation went on there, split across two bundles.
    gateway = await start_gateway(provider.url)
    client = sdk(base_url=gateway.url, api_key="unused")
    busy = {"error": {"message": "overloaded", "code": "server_error"}}

    async def ask(input_: Any) -> str:
        stream = await client.responses.create(model="m", input=input_, stream=True)
        return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

    provider.queue(answer("one", response_id="resp-1"))
    history: list[Any] = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": await ask("first")},
        {"role": "user", "content": "second"},
    ]
    provider.queue_error(503, busy, headers={"retry-after-ms": "1"})
    provider.queue(answer("two", response_id="resp-2"))
    history.append({"role": "assistant", "content": await ask(history)})
    provider.queue(answer("three", response_id="resp-3"))
    assert await ask([*history, {"role": "user", "content": "third"}]) == "three"
    # A first call retried (a 429) is its session's too.
    provider.queue_error(429, busy, headers={"retry-after-ms": "1"})
    provider.queue(answer("other", response_id="resp-4"))
    assert await ask("another run") == "other"
    # The same input again, not said to be a retry, is a new run of the same prompt.
    once = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    for _ in range(2):
        provider.queue_error(500, busy)
        with pytest.raises(openai.InternalServerError):
            await once.responses.create(model="m", input="a prompt run twice", stream=True)
    retries = [request.headers.get("x-stainless-retry-count") for request in provider.requests]
    assert retries == ["0", "0", "1", "0", "0", "1", "0", "0"]
    await gateway.stop()
    traces = reduce_all(gateway.settings.trace_root)
    assert all(trace.integrity.status == CLEAN for trace in traces)
    shapes = sorted(
        ([c.execution.status for c in calls(trace)], len(trace.turns)) for trace in traces
    )
    assert shapes == sorted(
        [
            ([COMPLETED, FAILED, COMPLETED, COMPLETED], 3),
            ([FAILED, COMPLETED], 1),
            ([FAILED], 1),
            ([FAILED], 1),
        ]
    )


async def test_runs_of_one_prompt_that_got_one_answer_go_on_in_a_bundle_each(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Rollouts of one task at temperature 0: each run's first call got the same answer, so
    # their sessions share one exchange. Was: the last to end kept it, so every follow-up went
    # into that run's bundle (two runs mixed in one, the other's stopped after one call), or,
    # once it had moved on, started a session without the history.
    gateway = await start_gateway(provider.url)
    client = _client(gateway)
    task = [{"role": "user", "content": "the task"}]

    async def call(input_: Any) -> str:
        stream = await client.responses.create(model="m", input=input_, stream=True)
        return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

    for number in range(4):
        provider.queue(answer("the same answer", response_id=f"resp-first-{number}"))
    firsts = await asyncio.gather(*(call(task) for _ in range(4)))
    history = [*task, {"role": "assistant", "content": firsts[0]}]

    def follow_up(run: int) -> list[Any]:
        return [*history, {"role": "user", "content": f"go on, run {run}"}]

    # Runs 0 and 1 one after the other; runs 2 and 3 at once, 2 still streaming as 3 comes.
    provider.queue(answer("zero", response_id="resp-0"))
    assert await call(follow_up(0)) == "zero"
    provider.queue(answer("one", response_id="resp-1"))
    assert await call(follow_up(1)) == "one"
    held = asyncio.Event()
    provider.queue(held, answer("two", response_id="resp-2"))
    provider.queue(answer("three", response_id="resp-3"))
    # Its answer's head has come: the gateway is answering run 2, the upstream holds the rest.
    two = await client.responses.create(model="m", input=follow_up(2), stream=True)
    assert await call(follow_up(3)) == "three"
    held.set()
    assert "".join([e.delta async for e in two if e.type == "response.output_text.delta"]) == "two"
    await gateway.stop()
    traces = reduce_all(gateway.settings.trace_root)
    assert len(traces) == 4
    for trace in traces:
        first, second = calls(trace)
        assert items_text(trace, first.response_item_ids) == "the same answer"
        assert len(second.request_item_ids) == 3
        assert len(trace.turns) == 2


async def test_runs_told_apart_by_their_instructions_stay_apart(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # A request whose instructions changed goes on with the conversation it extends (a
    # handoff), but a session whose exchange it extends instructions and all comes first: two
    # agents given one question that answered it alike go on in their own bundles.
    gateway = await start_gateway(provider.url)
    client = _client(gateway)

    async def call(input_: Any) -> str:
        stream = await client.responses.create(model="m", input=input_, stream=True)
        return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

    runs = {
        name: [{"role": "system", "content": f"you are {name}"}, {"role": "user", "content": "q"}]
        for name in ("ana", "bo")
    }
    for name, history in runs.items():
        provider.queue(answer("alike", response_id=f"resp-{name}"))
        history.append({"role": "assistant", "content": await call(history)})
    # The later run first: the earlier session shares its exchange, but not its instructions.
    for name, history in reversed(runs.items()):
        provider.queue(answer(f"to {name}", response_id=f"resp-{name}-2"))
        assert await call([*history, {"role": "user", "content": "again"}]) == f"to {name}"
    await gateway.stop()
    for trace in reduce_all(gateway.settings.trace_root):
        first, second = calls(trace)
        texts = [trace.conversation_items[i].content[0].text for i in second.request_item_ids]
        assert texts[0] == trace.conversation_items[first.request_item_ids[0]].content[0].text
        assert items_text(trace, second.response_item_ids) == f"to {texts[0].split()[-1]}"


def _compact(arguments: str) -> str:
    """Arguments as pydantic-ai sends a call back: its JSON re-encoded without spaces."""
    return json.dumps(json.loads(arguments), separators=(",", ":"))


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_tool_calls_arguments_sent_back_re_encoded_continue_the_run(
    gateway: Gateway, api: str
) -> None:
    # The built-in model writes `{"city": "…"}`; the client sends `{"city":"…"}` back. Was: the
    # arguments compared as text, so the tool result extended no exchange and the run was
    # split in two bundles, the first ending on an unanswered call.
    client = _client(gateway)
    question = "use lookup_weather for Paris"
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    if api == "chat":
        function = {"name": "lookup_weather", "parameters": parameters}
        tools: Any = [{"type": "function", "function": function}]
        messages: list[Any] = [{"role": "user", "content": question}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        (call,) = first.choices[0].message.tool_calls or []
        assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
        assert _compact(call.function.arguments) != call.function.arguments
        echoed = {"name": "lookup_weather", "arguments": _compact(call.function.arguments)}
        messages += [
            {
                "role": "assistant",
                "tool_calls": [{"id": call.id, "type": "function", "function": echoed}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        await client.chat.completions.create(model="m", messages=messages, tools=tools)
    else:
        tool: Any = {"type": "function", "name": "lookup_weather", "parameters": parameters}
        asked = await client.responses.create(model="m", input=question, tools=[tool])
        (made,) = asked.output
        assert made.type == "function_call"
        sent_back = {
            "type": "function_call",
            "call_id": made.call_id,
            "name": made.name,
            "arguments": _compact(made.arguments),
        }
        output = {"type": "function_call_output", "call_id": made.call_id, "output": "sunny"}
        history: list[Any] = [{"role": "user", "content": question}, sent_back, output]
        await client.responses.create(model="m", input=history, tools=[tool])
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 2
    assert len(trace.turns) == 1
    (tool_call,) = trace.tool_calls.values()
    assert tool_call.execution.status == COMPLETED


@pytest.mark.parametrize("echo", ["chat", "chat-exclude-none", "responses-string"])
async def test_a_conversation_holds_each_answer_once(gateway: Gateway, echo: str) -> None:
    # Each request sends the earlier answers back as the client spells them: Chat's string
    # content (with the SDK's nulls, or without), a Responses message with a string. Was: each
    # was keyed as input text, not the output text the model made, so the trace held every
    # answer twice (once as the model's output, once more as new input of the next call).
    async with _client(gateway) as client:
        history: list[Any] = []
        for text in ("one", "two", "three"):
            history.append({"role": "user", "content": text})
            if echo == "responses-string":
                made = await client.responses.create(model="m", input=history)
                history.append({"role": "assistant", "content": made.output_text})
            else:
                answer = await client.chat.completions.create(model="m", messages=history)
                message = answer.choices[0].message
                history.append(message.model_dump(exclude_none=echo == "chat-exclude-none"))
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    (thread,) = trace.threads.values()
    conversation = list(thread.conversation_item_ids)
    roles = [trace.conversation_items[i].role for i in conversation]
    user, assistant = state_pb2.CONVERSATION_ROLE_USER, state_pb2.CONVERSATION_ROLE_ASSISTANT
    assert roles == [user, assistant] * 3
    for number, call in enumerate(calls(trace)):
        # The earlier answers are the items the earlier calls made, in the order they came.
        assert list(call.request_item_ids) == conversation[: 2 * number + 1]
        assert list(call.response_item_ids) == [conversation[2 * number + 1]]
    # A trainer's sample holds each answer once, the model's (the loss is taken on it).
    (bundle,) = bundles(gateway.settings.trace_root)
    sample = build_sample(bundle, trace)
    assert sample is not None
    assert [(m["role"], m["loss_mask"]) for m in sample.messages] == [
        ("user", 0),
        ("assistant", 1),
    ] * 3


async def test_a_session_keeps_a_digest_of_each_entry_not_its_text(gateway: Gateway) -> None:
    # Was: each entry's JSON, a second copy of the conversation held while the session is open.
    client = _client(gateway)
    long = "word " * 20_000
    first = await client.responses.create(model="m", input=long)
    echo = [item.model_dump(exclude_none=True) for item in first.output]
    history: list[Any] = [{"role": "user", "content": long}, *echo]
    await client.responses.create(model="m", input=[*history, {"role": "user", "content": "more"}])
    (session,) = gateway.sessions.open
    assert len(session.exchange) == len(history) + 1 + 1
    assert {len(fingerprint) for fingerprint in session.exchange} == {32}
    assert len(calls(reduce_all(gateway.settings.trace_root)[0])) == 2


async def test_previous_response_id_continues_its_session(gateway: Gateway) -> None:
    client = _client(gateway)
    first = await client.responses.create(model="m", input="remember me")
    await client.responses.create(model="m", input="what did I say?", previous_response_id=first.id)
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 2
    assert len(trace.turns) == 2


async def test_a_coding_agents_session_header_is_a_hint(gateway: Gateway) -> None:
    client = _client(gateway, session_id="0195-conversation")
    await client.responses.create(model="m", input="first")
    await client.responses.create(model="m", input="second, unrelated input")
    await gateway.stop()
    (path,) = bundles(gateway.settings.trace_root)
    assert _metadata(path)["gateway.session_source"] == "hint:session_id"


async def _closed(path: Path) -> state_pb2.RolloutTrace:
    """The bundle once its footer is written (the idle sweep closes it on its own schedule)."""
    async with asyncio.timeout(20):
        while True:
            trace = replay_bundle(path)
            if trace.integrity.status == CLEAN:
                return trace
            await asyncio.sleep(0.05)


async def test_an_idle_session_is_closed(start_gateway: StartGateway) -> None:
    gateway = await start_gateway(session_idle_timeout=0.2)
    await _client(gateway).responses.create(model="m", input="then silence")
    (path,) = bundles(gateway.settings.trace_root)
    trace = await _closed(path)
    (thread,) = trace.threads.values()
    assert thread.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert gateway.sessions.open == []


async def test_close_endpoint_finishes_the_bundle(gateway: Gateway) -> None:
    client = _client(gateway, **{"x-rollout-session": "to-close"})
    await client.responses.create(model="m", input="bye")
    async with httpx.AsyncClient(base_url=gateway.url.removesuffix("/v1")) as http:
        answer = await http.post("/rollout/v1/sessions/to-close/close")
        assert answer.status_code == 200
        body = answer.json()
        assert replay_bundle(Path(body["bundle_path"])).integrity.status == CLEAN
        again = await http.post("/rollout/v1/sessions/to-close/close")
        assert again.json()["bundle_path"] == body["bundle_path"]
        missing = await http.post("/rollout/v1/sessions/never/close")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "session_not_found"


async def test_shutdown_closes_every_session_cleanly(gateway: Gateway) -> None:
    for key in ("a", "b", "c"):
        await _client(gateway, **{"x-rollout-session": key}).responses.create(model="m", input=key)
    await gateway.stop()
    traces = reduce_all(gateway.settings.trace_root)
    assert [t.integrity.status for t in traces] == [CLEAN] * 3


async def test_two_gateways_share_one_trace_root(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    first = await start_gateway(trace_root=root)
    second = await start_gateway(trace_root=root)
    # What a load balancer with affinity on the key does: each key always to the same one.
    results = await asyncio.gather(
        *(
            _client(gateway, **{"x-rollout-session": f"{name}-{n}"}).responses.create(
                model="m", input=f"{name} {n}"
            )
            for gateway, name in ((first, "left"), (second, "right"))
            for n in range(3)
        )
    )
    assert all(result.output_text for result in results)
    await first.stop()
    await second.stop()
    traces = reduce_all(root)
    keys = sorted(next(iter(t.threads.values())).metadata["gateway.session"] for t in traces)
    assert keys == sorted(f"{name}-{n}" for name in ("left", "right") for n in range(3))
    assert all(t.integrity.status == CLEAN for t in traces)


async def test_a_reward_is_never_written_through_a_bundle_swapped_for_a_link(
    gateway: Gateway, tmp_path: Path
) -> None:
    # Was: the session's bundle written to by its path: a directory of the trace root
    # swapped for a symbolic link put the reward outside the root.
    client = _client(gateway, **{"x-rollout-session": "swapped"})
    await client.responses.create(model="m", input="grade me")
    (bundle,) = bundles(gateway.settings.trace_root)
    copy = tmp_path / "outside" / bundle.name
    shutil.copytree(bundle, copy)
    bundle.rename(bundle.with_name(bundle.name + ".moved"))
    bundle.symlink_to(copy, target_is_directory=True)
    async with httpx.AsyncClient(base_url=gateway.url.removesuffix("/v1")) as http:
        answer = await http.post(
            "/rollout/v1/rewards", json={"session": "swapped", "name": "pass", "value": 1.0}
        )
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "bundle_unreadable")
    assert not (copy / "rewards.binpb").exists()


async def test_rewards_over_http(gateway: Gateway) -> None:
    client = _client(gateway, **{"x-rollout-session": "scored"})
    reply = await client.responses.create(model="m", input="grade me")
    async with httpx.AsyncClient(base_url=gateway.url.removesuffix("/v1")) as http:
        ok = await http.post(
            "/rollout/v1/rewards",
            json={"session": "scored", "name": "pass", "value": 1.0, "item_id": reply.output[0].id},
        )
        assert ok.status_code == 200, ok.text
        bad = await http.post("/rollout/v1/rewards", json={"session": "scored", "name": "x"})
        assert bad.status_code == 400
        nobody = await http.post(
            "/rollout/v1/rewards", json={"session": "nope", "name": "x", "value": 1}
        )
        assert nobody.status_code == 404
        unknown = await http.post(
            "/rollout/v1/rewards",
            json={"session": "scored", "name": "x", "value": 1, "item_id": "msg_nobody"},
        )
        assert unknown.status_code == 404
        # Was: 404 "no session None".
        unnamed = await http.post("/rollout/v1/rewards", json={"name": "x", "value": 1})
        assert (unnamed.status_code, unnamed.json()["error"]["code"]) == (400, "invalid_session")
        closed = await http.post("/rollout/v1/sessions/scored/close")
        assert closed.status_code == 200, closed.text
        # A closed session's turn and item are checked against its bundle (was: recorded).
        for field, code in (("turn_id", "turn_not_found"), ("item_id", "item_not_found")):
            late = await http.post(
                "/rollout/v1/rewards",
                json={"session": "scored", "name": "x", "value": 1, field: "nope"},
            )
            assert (late.status_code, late.json()["error"]["code"]) == (404, code), late.text
        after = await http.post(
            "/rollout/v1/rewards",
            json={
                "session": "scored",
                "name": "late",
                "value": 0.5,
                "item_id": reply.output[0].id,
                "metadata": {"grader": {"v": 2}, "note": "kept"},
            },
        )
        assert after.status_code == 200, after.text
    rewards = read_rewards(Path(ok.json()["bundle_path"]))
    assert [(r.name, r.value, r.item_id) for _, r in rewards.rewards] == [
        ("pass", 1.0, reply.output[0].id),
        ("late", 0.5, reply.output[0].id),
    ]
    # A metadata value that is not a string is kept as JSON (was: Python's repr).
    assert dict(rewards.rewards[-1][1].metadata) == {"grader": '{"v": 2}', "note": "kept"}


async def test_the_gateway_token_is_required_and_never_recorded(
    start_gateway: StartGateway,
) -> None:
    from grpc_common import AccessControl

    token = "gw-secret-token-123"
    gateway = await start_gateway(access=AccessControl(token=token))
    with_token = sdk(base_url=gateway.url, api_key=token, max_retries=0)
    without = sdk(base_url=gateway.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        await without.responses.create(model="m", input="let me in")
    assert refused.value.status_code == 401
    await with_token.responses.create(model="m", input="let me in")
    await gateway.stop()
    for path in bundles(gateway.settings.trace_root):
        assert token.encode() not in (path / "trace.binpb").read_bytes()


async def test_unknown_paths_get_an_openai_style_404(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post("/embeddings", json={"input": "x"})
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "not_found_error"


async def test_models_are_forwarded(start_gateway: StartGateway) -> None:
    seen: list[str] = []

    async def models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response(
            {"object": "list", "data": [{"id": "engine-1", "object": "model"}]}
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        from agent_server.config import Secret

        gateway = await start_gateway(f"http://127.0.0.1:{port}/v1", api_key=Secret("upstream-key"))
        listed = await _client(gateway).models.list()
        assert [model.id for model in listed.data] == ["engine-1"]
        assert seen == ["Bearer upstream-key"]
    finally:
        await runner.cleanup()


async def test_a_turn_begun_while_the_last_one_streams_keeps_the_bundle_readable(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Was: the second user message ended the first turn while its call still streamed; the
    # call's later records then contradicted its ended turn and the bundle did not reduce.
    gateway = await start_gateway(provider.url)
    go_on = asyncio.Event()
    first = message("", "msg-1")
    provider.queue(
        sse(created("resp-1"), item_added(first), text_delta("first ", "msg-1")),
        go_on,
        sse(item_done(message("first answer", "msg-1")), completed("resp-1")),
    )
    provider.queue(answer("second answer", "msg-2", "resp-2"))
    client = _client(gateway, **{"x-rollout-session": "overlap"})
    stream = await client.responses.create(model="m", input="first question", stream=True)
    async for event in stream:
        if event.type == "response.output_text.delta":
            break
    second = await client.responses.create(model="m", input="second question", stream=True)
    texts = [event.delta async for event in second if event.type == "response.output_text.delta"]
    assert "".join(texts) == "second answer"
    go_on.set()
    async for _ in stream:
        pass
    await gateway.stop()
    (path,) = bundles(gateway.settings.trace_root)
    trace = replay_bundle(path)
    assert trace.integrity.status == CLEAN
    turns = sorted(trace.turns.values(), key=lambda turn: turn.execution.started_seq)
    assert [turn.execution.status for turn in turns] == [COMPLETED, COMPLETED]
    assert [call.execution.status for call in calls(trace)] == [COMPLETED, COMPLETED]
    # The first turn ended after its call did, not when the second began.
    assert turns[0].execution.ended_seq > turns[1].execution.started_seq


def _close(gateway: Gateway, key: str) -> Any:
    """POST the session's close, within a bound: a close never waits on an upstream."""

    async def close() -> httpx.Response:
        async with (
            asyncio.timeout(10),
            httpx.AsyncClient(base_url=gateway.url.removesuffix("/v1")) as http,
        ):
            return await http.post(f"/rollout/v1/sessions/{key}/close")

    return close()


async def test_closing_a_session_cuts_off_its_streaming_call_and_its_upstream_request(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    # Was: the turn and call were recorded CANCELLED, but the gateway went on reading the
    # upstream, which held its request open until it sent more or the stream idle timeout
    # (300 s) passed; the client was left waiting as long.
    gateway = await start_gateway(provider.url)
    provider.queue(answer("kept answer"))
    silent = UntilClosed()
    provider.queue(
        sse(
            created("resp-2"),
            item_added(message("", "msg-2")),
            text_delta("cut ", "msg-2"),
            text_delta("off", "msg-2"),
        ),
        silent,
    )
    async with _client(gateway, **{"x-rollout-session": "closed-mid-call"}) as client:
        await client.responses.create(model="m", input="first question")
        stream = await client.responses.create(model="m", input="second question", stream=True)
        deltas = []
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                if len(deltas) == 2:
                    break
        closed = await _close(gateway, "closed-mid-call")
        assert closed.status_code == 200, closed.text
        # The upstream saw its request end at the close, not at the next byte it sent.
        await asyncio.wait_for(silent.closed.wait(), 10)
        # The client's stream ends with an error event saying why.
        with pytest.raises(openai.APIError, match="was closed while this call ran") as raised:
            async for _ in stream:
                pass
    assert raised.value.code == "session_closed"
    trace = replay_bundle(Path(closed.json()["bundle_path"]))
    assert trace.integrity.status == CLEAN
    turns = sorted(trace.turns.values(), key=lambda turn: turn.execution.started_seq)
    assert [turn.execution.status for turn in turns] == [COMPLETED, CANCELLED]
    first, cut = calls(trace)
    assert (first.execution.status, cut.execution.status) == (COMPLETED, CANCELLED)
    assert cut.end_reason == "session_closed"
    assert [d.partial_text for d in cut.discarded_outputs] == ["cut off"]
    # What was recorded before the close is all there.
    assert items_text(trace, first.response_item_ids) == "kept answer"


async def test_a_cut_off_stream_ends_cleanly_after_a_session_closed_event(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    silent = UntilClosed()
    provider.queue(sse(created("resp-1"), item_added(message("", "msg-1"))), silent)
    body = {"model": "m", "input": "hi", "stream": True}
    headers = {"x-rollout-session": "cut"}
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as http,
        http.stream("POST", "/responses", json=body, headers=headers) as reply,
    ):
        seen = b""
        chunks = reply.aiter_bytes()
        async for chunk in chunks:
            seen += chunk
            if b"output_item.added" in seen:
                break
        assert (await _close(gateway, "cut")).status_code == 200
        # The rest arrives and the stream ends: no broken connection, no wait.
        async for chunk in chunks:
            seen += chunk
    await asyncio.wait_for(silent.closed.wait(), 10)
    *_, last = seen.decode().strip().split("\n\n")
    assert last.startswith("event: error\ndata: ")
    error = json.loads(last.partition("data: ")[2])
    assert (error["code"], error["error"]["code"]) == ("session_closed", "session_closed")


async def test_closing_a_session_cuts_off_a_call_waiting_for_its_upstream(
    start_gateway: StartGateway,
) -> None:
    # An upstream that has not answered yet: the client gets 409 session_closed, not retried.
    arrived, hung_up = asyncio.Event(), asyncio.Event()

    async def silent(request: HttpRequest, response: HttpResponse) -> None:
        arrived.set()
        await response.wait_disconnected()
        hung_up.set()
        response.reset()

    upstream = await LoopbackHttpServer.start(silent, keep_requests=True)
    try:
        gateway = await start_gateway(upstream.url)
        client = sdk(
            base_url=gateway.url,
            api_key="unused",
            max_retries=2,
            default_headers={"x-rollout-session": "waiting"},
        )
        async with client:
            call = asyncio.create_task(client.responses.create(model="m", input="hi"))
            await asyncio.wait_for(arrived.wait(), 10)
            # Two closes at once: the second waits for the first and answers the same.
            closed, again = await asyncio.gather(
                _close(gateway, "waiting"), _close(gateway, "waiting")
            )
            assert (closed.status_code, again.status_code) == (200, 200), again.text
            assert again.json() == closed.json()
            await asyncio.wait_for(hung_up.wait(), 10)
            with pytest.raises(openai.ConflictError) as raised:
                await call
        assert raised.value.code == "session_closed"
        assert len(upstream.requests) == 1, "the SDK retried a call its session's close ended"
    finally:
        await upstream.stop()
    trace = replay_bundle(Path(closed.json()["bundle_path"]))
    assert trace.integrity.status == CLEAN
    (call_record,) = calls(trace)
    assert call_record.execution.status == CANCELLED
    assert call_record.end_reason == "session_closed"


async def test_the_built_in_model_lists_itself(gateway: Gateway) -> None:
    # Was: 404 from the built-in upstream, so an SDK's models.list() failed on a default
    # gateway.
    listed = await _client(gateway).models.list()
    assert [model.id async for model in listed] == ["local-echo-1"]


async def test_runs_sharing_an_exchange_are_told_apart_in_few_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs of one prompt that got one answer share an exchange; each continuation goes on one
    # that no call is answering. Was: every lookup walked all of them (and taking one out
    # walked them again), so k runs cost k^2 steps: 2,000 runs, 4 million.
    sessions = Sessions(tmp_path, idle_timeout=60.0)
    runs = 200
    opened = [
        (await sessions.get_or_create(SessionKey(f"run-{i}", "header"), model="m", reason="t"))[0]
        for i in range(runs)
    ]
    shared = ("question", "answer")
    for session in opened:
        sessions.exchanged(session, shared, None, "")
    looked_at = 0

    def running(session: Session) -> int:
        nonlocal looked_at
        looked_at += 1
        return int(session.__dict__.get("_running", 0))

    def set_running(session: Session, value: int) -> None:
        session.__dict__["_running"] = value

    # Counts how many sessions a lookup looks at (each asks whether a call is running).
    monkeypatch.setattr(Session, "calls_running", property(running, set_running))
    picked = []
    for _ in range(runs):
        found = sessions.continuing([*shared, "next"])
        assert found is not None
        found.calls_running += 1
        picked.append(found)
    assert {id(s) for s in picked} == {id(s) for s in opened}
    assert picked == opened  # oldest first, as before
    assert looked_at <= 4 * runs
    for index, session in enumerate(picked):
        sessions.exchanged(session, (*shared, "next", f"reply {index}"), None, "")
        session.calls_running -= 1
        sessions.calls_ended(session)
    await sessions.close_all("test")


def _two_choices(completion_id: str, texts: list[str], stream: bool) -> str | dict[str, Any]:
    if not stream:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
            for i, t in enumerate(texts)
        ]
        return {"id": completion_id, "object": "chat.completion", "choices": choices}
    chunks = [
        {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "choices": [{"index": i, "delta": delta, "finish_reason": finish}],
        }
        for i, text in enumerate(texts)
        for delta, finish in (({"role": "assistant", "content": text}, None), ({}, "stop"))
    ]
    return sse(*chunks) + "data: [DONE]\n\n"


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_going_on_with_another_choice_continues_the_session(
    start_gateway: StartGateway, provider: ScriptedProvider, stream: bool, named: bool
) -> None:
    # With n=2 the recorded output is choice 0; a client that goes on with choice 1 sends
    # choice 1 back. Was: that extended no exchange, so the run's second call started a
    # bundle of its own (and, with the session named, choice 1 was taken for new input of
    # the turn, as if the user had said it).
    gateway = await start_gateway(provider.url)
    for step, texts in (("c1", ["first", "second"]), ("c2", ["next"])):
        script = _two_choices(step, texts, stream)
        if isinstance(script, str):
            provider.queue(script)
        else:
            provider.queue_json(script)
    headers = {"x-rollout-session": "branching"} if named else {}
    async with _client(gateway, **headers) as client:
        messages: list[Any] = [{"role": "user", "content": "twice"}]
        if stream:
            chunks = await client.chat.completions.create(
                model="m", n=2, messages=messages, stream=True
            )
            pieces = [c.choices[0] async for c in chunks if c.choices]
            second = "".join(c.delta.content or "" for c in pieces if c.index == 1)
        else:
            whole = await client.chat.completions.create(model="m", n=2, messages=messages)
            second = whole.choices[1].message.content or ""
        assert second == "second"
        messages += [{"role": "assistant", "content": second}, {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="m", messages=messages)
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    one, two = calls(trace)
    assert items_text(trace, one.response_item_ids) == "first"
    # The second call sent choice 1 back, as the client did; its turn's new input is the
    # user's message alone.
    assert [items_text(trace, [i]) for i in two.request_item_ids] == ["twice", "second", "go on"]
    turn = trace.turns[two.turn_id]
    assert [items_text(trace, [i]) for i in turn.input_item_ids] == ["go on"]


async def test_going_on_with_another_choices_tool_call_continues_the_session(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    call = {"id": "call-9", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    streamed = [
        {"index": 0, "delta": {"role": "assistant", "content": "no tool"}, "finish_reason": None},
        {"index": 1, "delta": {"role": "assistant", "tool_calls": [{**call, "index": 0}]}},
        {"index": 0, "delta": {}, "finish_reason": "stop"},
        {"index": 1, "delta": {}, "finish_reason": "tool_calls"},
    ]
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "choices": [c]} for c in streamed]
    provider.queue(sse(*chunks) + "data: [DONE]\n\n")
    whole = _two_choices("c2", ["looked"], stream=False)
    assert isinstance(whole, dict)
    provider.queue_json(whole)
    async with _client(gateway) as client:
        messages: list[Any] = [{"role": "user", "content": "look it up"}]
        stream = await client.chat.completions.create(
            model="m", n=2, messages=messages, stream=True
        )
        made = [c.choices[0].delta.tool_calls async for c in stream if c.choices]
        assert [calls[0].id for calls in made if calls] == ["call-9"]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-9", "content": "found"},
        ]
        await client.chat.completions.create(model="m", messages=messages)
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 2
