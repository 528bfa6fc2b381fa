"""Hostile input at the gateway: session keys, request and upstream bodies, rewards, sizes.

Each case is answered with the documented status and a one-line OpenAI-style error, never a
500 `internal_error` (or a dropped connection) with a traceback in the log, and what was
recorded before stays readable."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from agent_server.agent import MAX_MODEL_CHARS
from agent_server.config import Secret
from agent_server.gateway import MAX_CALL_ITEMS, Gateway
from agent_server.sse import MAX_EVENT_BYTES
from grpc_common import AccessControl
from rollout.trace.v1 import common_pb2, state_pb2
from tests.gateway.conftest import StartGateway, bundles, calls, items_text, reduce_all, sdk
from tests.malformed_http import (
    MALFORMED_REQUESTS,
    SECRET,
    refusals,
    status_line,
    until_closed,
)

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Upstream:
    """A real HTTP upstream on loopback whose next answer each test sets."""

    def __init__(self) -> None:
        self.answer: Answer = _chat_completion
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Upstream:
        app = web.Application()

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.answer(request)

        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_post("/v1/responses", handle)
        app.router.add_get("/v1/models", handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _chat_completion(request: web.Request) -> web.StreamResponse:
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
        }
    )


def _json_answer(body: Any) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    return answer


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = await Upstream().start()
    yield server
    await server.stop()


@pytest.fixture
def tracebacks(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The gateway's log records of the test that carry a traceback (the test's upstream may
    log the gateway hanging up on it)."""
    caplog.set_level(logging.INFO)
    return lambda: [
        r.getMessage()
        for r in caplog.records
        if r.exc_info is not None and r.name.startswith("agent_server")
    ]


def _root_url(gateway: Gateway) -> str:
    return gateway.url.removesuffix("/v1")


def _user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


async def _one_session(http: httpx.AsyncClient, key: str) -> None:
    answer = await http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [_user()]},
        headers={"x-rollout-session": key},
    )
    assert answer.status_code == 200, answer.text


# -- session keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path_key",
    ["%0d%0aSet-Cookie:%20x=1", "a%00b", "%7f", "x" * 300, "%C3%A9t%C3%A9"],
    ids=["crlf", "nul", "del", "300-chars", "non-ascii"],
)
async def test_a_session_key_that_is_no_header_value_is_refused(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    path_key: str,
) -> None:
    gateway = await start_gateway(upstream.url)
    async with httpx.AsyncClient(base_url=_root_url(gateway)) as http:
        answer = await http.post(
            f"/s/{path_key}/v1/chat/completions", json={"model": "m", "messages": [_user()]}
        )
    # Was: the key echoed into x-rollout-session, aiohttp refused the header, the client's
    # connection dropped without an answer (and a bundle made for nothing).
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_session"
    assert "\n" not in answer.json()["error"]["message"]
    assert bundles(gateway.settings.trace_root) == []
    assert tracebacks() == []


async def test_a_hint_that_is_no_header_value_still_groups_its_session(
    start_gateway: StartGateway, upstream: Upstream, tracebacks: Callable[[], list[str]]
) -> None:
    gateway = await start_gateway(upstream.url)
    hint = "conv\r\nSet-Cookie: x=1 été " + "y" * 400
    keys = []
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for text in ("one", "two"):
            answer = await http.post(
                "/chat/completions",
                json={"model": "m", "messages": [_user(text)], "prompt_cache_key": hint},
            )
            assert answer.status_code == 200, answer.text
            keys.append(answer.headers["x-rollout-session"])
    assert keys[0] == keys[1]
    assert keys[0].startswith("prompt_cache_key#")
    assert keys[0].isascii()
    assert len(keys[0]) < 100
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 2
    assert tracebacks() == []


# -- request bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": [1, 2]}]},
        {"role": "assistant", "tool_calls": ["call"], "content": None},
        {"role": ["user"], "content": {"text": 1}},
        {"role": "tool", "tool_call_id": {"a": 1}, "content": [None, 1, {"text": 2}]},
    ],
    ids=["function-str", "function-list", "call-str", "role-list", "tool-junk"],
)
async def test_chat_messages_of_any_shape_are_forwarded_and_recorded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    message: dict[str, Any],
) -> None:
    gateway = await start_gateway(upstream.url)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post(
            "/chat/completions", json={"model": "m", "messages": [_user(), message]}
        )
    # Was: 500 internal_error after the call was forwarded (fingerprinting the messages).
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "hello"
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert [c.execution.status for c in calls(trace)] == [COMPLETED]
    assert tracebacks() == []


async def test_a_model_named_with_a_lone_surrogate_is_forwarded_and_recorded(
    start_gateway: StartGateway, upstream: Upstream, tracebacks: Callable[[], list[str]]
) -> None:
    # JSON's `\ud800` escape names a model no UTF-8 record holds: the session's first call
    # (its thread's model) and a later call of a session with another model.
    sent: list[bytes] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        sent.append(await request.read())
        return await _chat_completion(request)

    upstream.answer = answer
    gateway = await start_gateway(upstream.url)
    odd = b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    plain = json.dumps({"model": "m", "messages": [_user()]}).encode()
    json_body = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        first = await http.post("/chat/completions", content=odd, headers=json_body)
        later = [
            await http.post(
                "/chat/completions", content=body, headers={**json_body, "x-rollout-session": "s"}
            )
            for body in (plain, odd)
        ]
    # Was: 500 internal_error, nothing forwarded, the first one's bundle left UNCLOSED.
    assert [a.status_code for a in (first, *later)] == [200, 200, 200], first.text
    assert sent == [odd, plain, odd]  # the upstream gets the body as the client sent it
    await gateway.stop()
    traces = reduce_all(gateway.settings.trace_root)
    assert [t.integrity.status for t in traces] == [state_pb2.INTEGRITY_STATUS_CLEAN] * 2
    models = sorted(
        (
            t.threads[t.root_thread_id].model,
            [c.model for c in calls(t)],
            [c.execution.status for c in calls(t)],
        )
        for t in traces
    )
    assert models == [
        ("m", ["m", "m\ufffd"], [COMPLETED, COMPLETED]),
        ("m\ufffd", ["m\ufffd"], [COMPLETED]),
    ]
    assert tracebacks() == []


@pytest.mark.parametrize(
    "odd",
    [
        {"model": "m" * (MAX_MODEL_CHARS + 1), "messages": [_user()]},
        {"model": ["m" * 100] * 50_000, "messages": [_user()]},  # 5 MB as text
        {"model": "m", "messages": [_user(str(i)) for i in range(MAX_CALL_ITEMS + 1)]},
        {
            "model": "m",
            "messages": [
                _user(),
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": f"c{i}", "type": "function", "function": {"name": "f"}}
                        for i in range(MAX_CALL_ITEMS)
                    ],
                },
            ],
        },
    ],
    ids=["long-model", "model-list", "items", "tool-call-items"],
)
async def test_a_request_no_record_can_hold_is_refused_and_the_session_goes_on(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    odd: dict[str, Any],
) -> None:
    # A model past the agent API's 256 characters is written whole into the thread's and
    # each call's record; each item is named in the call's record: past 4 MiB, no record.
    gateway = await start_gateway(upstream.url)
    plain = {"model": "m", "messages": [_user()]}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        first = await http.post("/chat/completions", json=odd)  # a new session's first call
        answers = [
            await http.post("/chat/completions", json=body, headers={"x-rollout-session": "s"})
            for body in (plain, odd, plain)
        ]
    # Was: 503 recording_failed (recording_unavailable for a first call), and the session's
    # recording stopped for good: every later call 503, its bundle UNCLOSED.
    assert first.status_code in (400, 413), first.text
    assert [a.status_code for a in answers] == [200, first.status_code, 200], answers[1].text
    assert first.json()["error"]["code"] in ("invalid_model", "too_many_items")
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert [c.execution.status for c in calls(trace)] == [COMPLETED, COMPLETED]
    assert tracebacks() == []


# -- upstream bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"id": "c", "choices": 5},
        {"id": "c", "choices": [{"message": "hello"}]},
        {"id": "c", "choices": [{"message": [1]}]},
        {"id": "c", "choices": [{"message": {"content": 5, "tool_calls": [1, {"function": 2}]}}]},
        {"id": 5, "choices": [None, "x", {"index": "zero", "message": {"role": 1}}]},
        {"id": "c", "choices": "many", "usage": "lots"},
    ],
    ids=["choices-int", "message-str", "message-list", "junk-calls", "junk-ids", "junk-usage"],
)
async def test_a_chat_answer_of_any_shape_is_recorded_and_forwarded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    body: dict[str, Any],
) -> None:
    gateway = await start_gateway(upstream.url)
    upstream.answer = _json_answer(body)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post("/chat/completions", json={"model": "m", "messages": [_user()]})
    # Was: 500 internal_error, the upstream's answer lost and the call left RUNNING.
    assert answer.status_code == 200, answer.text
    assert answer.json() == body
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert call.execution.status in (COMPLETED, FAILED)
    assert tracebacks() == []


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"error": {"message": "bad \\ud800 value", "code": "x"}}', "x"),
        (b'{"error": {"message": "bad", "code": "\\udc00"}}', "\ufffd"),
        (b'{"error": {"message": "a\xed\xa0\x80b", "code": "x"}}', "x"),
        (b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "http_400"),
    ],
    ids=["escaped-surrogate", "surrogate-code", "surrogate-bytes", "nested-100000"],
)
async def test_an_upstream_error_of_any_shape_is_forwarded_and_recorded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    body: bytes,
    code: str,
) -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.Response(status=400, body=body, content_type="application/json")

    upstream.answer = refuse
    gateway = await start_gateway(upstream.url)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post("/chat/completions", json={"model": "m", "messages": [_user()]})
    # Was: 500 internal_error (UnicodeEncodeError or RecursionError reading the error), the
    # upstream's 400 lost and the call not recorded as failed.
    assert (answer.status_code, answer.content) == (400, body)
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert (call.execution.status, call.error.code, call.error.http_status) == (FAILED, code, 400)
    assert tracebacks() == []


@pytest.mark.parametrize("surrogate", [b"\\ud800", b"\xed\xa0\x80"], ids=["escaped", "bytes"])
@pytest.mark.parametrize("route", ["/chat/completions", "/responses"])
async def test_a_whole_answer_with_lone_surrogates_is_forwarded_and_recorded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    surrogate: bytes,
    route: str,
) -> None:
    s = surrogate
    if route == "/responses":
        body = (
            b'{"id": "r' + s + b'", "object": "response", "status": "completed", "output": '
            b'[{"type": "message", "id": "m' + s + b'", "role": "assistant", "status": '
            b'"completed", "content": [{"type": "output_text", "text": "t' + s + b'"}]}]}'
        )
    else:
        body = (
            b'{"id": "c' + s + b'", "object": "chat.completion", "choices": [{"index": 0, '
            b'"message": {"role": "assistant", "content": "t' + s + b'"}, '
            b'"finish_reason": "stop"}]}'
        )

    async def whole(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    upstream.answer = whole
    gateway = await start_gateway(upstream.url)
    request = {"model": "m", "messages": [_user()], "input": "hi"}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post(route, json=request)
    # Was: 500 internal_error (UnicodeEncodeError recording the answer's id) for the
    # upstream's 200, and the call recorded CANCELLED. A stream's events were read already.
    assert (answer.status_code, answer.content) == (200, body)
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert call.execution.status == COMPLETED
    assert items_text(trace, call.response_item_ids) == "t\ufffd"
    assert tracebacks() == []


class _Endless:
    """An upstream answer that never ends: `head`, then 1 MiB blocks of `fill` up to three
    times the gateway's bound, counting what it `sent` before the gateway stopped reading."""

    def __init__(self, content_type: str, head: bytes, fill: bytes) -> None:
        self.content_type, self.head, self.block = content_type, head, fill * (1 << 20)
        self.sent = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": self.content_type})
        await response.prepare(request)
        try:
            if self.head:
                await response.write(self.head)
            for _ in range(3 * MAX_EVENT_BYTES // len(self.block)):
                await response.write(self.block)
                self.sent += len(self.block)
        except ConnectionResetError:
            pass
        return response


async def test_an_upstream_event_past_the_bound_fails_the_call(
    start_gateway: StartGateway, upstream: Upstream, tracebacks: Callable[[], list[str]]
) -> None:
    # One event that never ends: a gateway that holds it all runs out of memory.
    endless_event = _Endless("text/event-stream", b"data: ", b"x")
    gateway = await start_gateway(upstream.url)
    upstream.answer = endless_event
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        received = b""
        broke = False
        async with http.stream(
            "POST",
            "/chat/completions",
            json={"model": "m", "messages": [_user()], "stream": True},
        ) as answer:
            assert answer.status_code == 200
            try:
                async for chunk in answer.aiter_bytes():
                    received += chunk
            except httpx.RemoteProtocolError:
                broke = True
    # The connection broke (a client cannot mistake it for an end) and nothing of the event
    # went out.
    assert broke
    assert received.count(b"x") == 0, f"{received.count(b'x')} bytes of the event"
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert call.execution.status == FAILED
    assert call.error.code == "event_too_large"
    # The gateway stopped reading soon after the bound, not at the stream's end.
    assert endless_event.sent < 2 * MAX_EVENT_BYTES
    assert tracebacks() == []


async def test_an_upstream_body_past_the_bound_is_a_502(
    start_gateway: StartGateway, upstream: Upstream, tracebacks: Callable[[], list[str]]
) -> None:
    async def huge_body(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        block = b" " * (1 << 20)
        try:
            for _ in range(2 * MAX_EVENT_BYTES // len(block)):
                await response.write(block)
        except ConnectionResetError:
            pass
        return response

    gateway = await start_gateway(upstream.url)
    upstream.answer = huge_body
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        answer = await http.post("/chat/completions", json={"model": "m", "messages": [_user()]})
    assert answer.status_code == 502, answer.text[:200]
    assert answer.json()["error"]["code"] == "response_too_large"
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert call.execution.status == FAILED
    assert call.error.code == "response_too_large"
    assert tracebacks() == []


async def test_a_models_answer_past_the_bound_is_a_502(
    start_gateway: StartGateway, upstream: Upstream, tracebacks: Callable[[], list[str]]
) -> None:
    endless = _Endless("application/json", b"", b" ")
    gateway = await start_gateway(upstream.url)
    upstream.answer = endless
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        answer = await http.get("/models")
    # Was: read whole into memory however long it went on, then forwarded (200).
    assert answer.status_code == 502, answer.text[:200]
    assert answer.json()["error"]["code"] == "response_too_large"
    assert endless.sent < 2 * MAX_EVENT_BYTES
    assert tracebacks() == []


def _silent(release: asyncio.Event, *, after_headers: bool) -> Answer:
    """An upstream that goes quiet: before its headers, or after them and half a body."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.content_length = 100
        if after_headers:
            await response.prepare(request)
            await response.write(b'{"id": "chatcmpl-1", ')
        await release.wait()
        return response

    return answer


@pytest.mark.parametrize("after_headers", [False, True], ids=["before-headers", "mid-body"])
async def test_a_silent_upstream_is_a_504_recorded_as_the_idle_timeout(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    after_headers: bool,
) -> None:
    release = asyncio.Event()
    upstream.answer = _silent(release, after_headers=after_headers)
    gateway = await start_gateway(upstream.url, stream_idle_timeout=0.3)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        answer = await http.post("/chat/completions", json={"model": "m", "messages": [_user()]})
        models = await http.get("/models")
    release.set()
    for got in (answer, models):
        assert got.status_code == 504, got.text[:200]
        error = got.json()["error"]
        assert error["code"] == "stream_idle_timeout"
        assert error["type"] == "server_error"
        assert "idle too long" in error["message"]
    (trace,) = reduce_all(gateway.settings.trace_root)
    (call,) = calls(trace)
    assert (call.execution.status, call.error.code) == (FAILED, "stream_idle_timeout")
    assert tracebacks() == []


def _echoing(mode: str) -> Answer:
    """An upstream that repeats the Authorization header and query it was sent."""

    async def answer(request: web.Request) -> web.StreamResponse:
        echo = f"{request.headers.get('Authorization', '')} {request.path_qs}"
        if mode == "error-body":
            return web.json_response({"error": {"message": echo, "code": echo}}, status=401)
        event = {"type": "error", "code": "denied", "message": f"bad key: {echo}"}
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"event: error\ndata: {json.dumps(event)}\n\n".encode())
        await response.write_eof()
        return response

    return answer


@pytest.mark.parametrize("mode", ["error-body", "error-event"])
@pytest.mark.parametrize("auth", ["upstream-key", "url-password", "client-token"])
async def test_what_an_upstream_echoes_of_credentials_is_neither_recorded_nor_forwarded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    mode: str,
    auth: str,
) -> None:
    upstream.answer = _echoing(mode)
    url, key, client = upstream.url + "?sig=S3CRETSIG", None, "S3CRETCLIENT"
    if auth == "upstream-key":
        key = Secret("sk-S3CRETKEY")
    elif auth == "url-password":
        url = url.replace("http://", "http://alice:S3CRETPW@")
    gateway = await start_gateway(url, api_key=key)
    headers = {"Authorization": f"Bearer {client}"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, headers=headers) as http:
        body = {"model": "m", "input": "hi", "stream": mode == "error-event"}
        answer = await http.post("/responses", json=body)
        models = await http.get("/models")
    for got in (answer, models):
        assert "S3CRET" not in got.text, got.text[:300]
        assert "UzNDUkVU" not in got.text, got.text[:300]
    (bundle,) = bundles(gateway.settings.trace_root)
    for path in bundle.iterdir():
        data = path.read_bytes()
        assert b"S3CRET" not in data, path.name
        assert b"UzNDUkVU" not in data, path.name
    assert "S3CRET" not in str(reduce_all(gateway.settings.trace_root))
    assert tracebacks() == []


@pytest.mark.parametrize("cut", [1, 7, 11], ids=lambda cut: f"key[:{cut}]")
async def test_a_key_an_upstream_echoes_across_two_reads_is_neither_recorded_nor_forwarded(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    cut: int,
) -> None:
    # Was: the gateway redacted each read alone, neither half matched, and the key reached
    # the client and the bundle.
    key = "sk-S3CRETKEY"
    first_event_out = asyncio.Event()

    async def split_echo(request: web.Request) -> web.StreamResponse:
        created = {"type": "response.created", "response": {"id": "resp_1", "output": []}}
        echo = request.headers.get("Authorization", "")
        event = {"type": "error", "code": "denied", "message": f"bad key: {echo}"}
        text = f"event: error\ndata: {json.dumps(event)}\n\n"
        at = text.index(key) + cut
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(created)}\n\n{text[:at]}".encode())
        # The second half goes out once the client has the first event: the gateway has read
        # the first half alone by then.
        await first_event_out.wait()
        await response.write(text[at:].encode())
        await response.write_eof()
        return response

    upstream.answer = split_echo
    gateway = await start_gateway(upstream.url, api_key=Secret(key))
    received = b""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        body = {"model": "m", "input": "hi", "stream": True}
        async with http.stream("POST", "/responses", json=body) as answer:
            async for chunk in answer.aiter_bytes():
                received += chunk
                if b"response.created" in received:
                    first_event_out.set()
    assert b"bad key: Bearer ***" in received, received
    assert b"S3CRET" not in received, received
    (bundle,) = bundles(gateway.settings.trace_root)
    trace = (bundle / "trace.binpb").read_bytes()
    assert b"***" in trace
    for path in bundle.iterdir():
        assert b"S3CRET" not in path.read_bytes(), path.name
    assert "S3CRET" not in str(reduce_all(gateway.settings.trace_root))
    assert tracebacks() == []


async def test_models_never_sends_the_gateway_s_own_token_upstream(
    start_gateway: StartGateway, upstream: Upstream
) -> None:
    seen: list[str] = []

    async def models(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"object": "list", "data": []})

    upstream.answer = models
    gateway = await start_gateway(upstream.url, access=AccessControl(token="S3CRETGATEWAY"))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        answer = await http.get("/models", headers={"Authorization": "Bearer S3CRETGATEWAY"})
    assert answer.status_code == 200, answer.text
    assert seen == [""]


async def test_a_client_s_key_headers_never_go_upstream(
    start_gateway: StartGateway, upstream: Upstream
) -> None:
    # Was: `x-api-key` passed on as it came (`api-key` was dropped): an upstream that quoted it
    # in an error put the client's key where the redactor, which knows only Authorization,
    # did not look.
    seen: list[dict[str, str]] = []

    async def models(request: web.Request) -> web.StreamResponse:
        seen.append({name.lower(): value for name, value in request.headers.items()})
        return web.json_response({"object": "list", "data": []})

    upstream.answer = models
    gateway = await start_gateway(upstream.url)
    keys = {"x-api-key": "S3CRETX", "api-key": "S3CRETA", "x-other": "kept"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        answer = await http.get("/models", headers=keys)
    assert answer.status_code == 200, answer.text
    [headers] = seen
    assert "x-api-key" not in headers
    assert "api-key" not in headers
    assert headers["x-other"] == "kept"


# -- rewards -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"value": 10**400}, "invalid_reward_value"),
        ({"value": 1, "weight": -(10**400)}, "invalid_reward_value"),
        ({"value": 1, "metadata": {"k": "\ud800"}}, None),
        ({"value": 1, "metadata": [1]}, "invalid_reward"),
        ({"value": 1, "name": ["x"]}, "invalid_reward"),
        ({"value": 1, "turn": "turn_1"}, "invalid_reward"),
    ],
    ids=[
        "value-10^400",
        "weight-10^400",
        "surrogate-metadata",
        "metadata-list",
        "name-list",
        "misspelt-turn-id",
    ],
)
async def test_a_hostile_reward_is_a_400(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    fields: dict[str, Any],
    code: str | None,
) -> None:
    gateway = await start_gateway(upstream.url)
    async with httpx.AsyncClient(base_url=_root_url(gateway)) as http:
        await _one_session(http, "s1")
        body = {"session": "s1", "name": "score", **fields}
        answer = await http.post(
            "/rollout/v1/rewards",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
    # Was: 500 internal_error (OverflowError converting the number) and a traceback.
    if code is None:
        assert answer.status_code in (200, 400), answer.text
    else:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == code
    assert tracebacks() == []
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 1


async def test_a_body_that_trickles_is_answered_408(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    # The client sends its headers and part of its body, then nothing: the gateway answers
    # rather than holding the connection and its handler for good, and records nothing.
    gateway = await start_gateway(request_read_timeout=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        await writer.drain()
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            length = int(
                next(
                    line.split(b":", 1)[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
            )
            answer = json.loads(await reader.readexactly(length))
    finally:
        writer.close()
    assert status.split()[1] == b"408"
    assert answer["error"]["code"] == "request_timeout"
    assert bundles(tmp_path / "traces") == []


async def test_a_request_head_that_never_ends_loses_its_connection(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    # Slowloris: a request line and one header, then nothing. aiohttp's own bound was an
    # hour; now the read timeout, as for a body. A stream longer than that is not cut.
    gateway = await start_gateway(request_read_timeout=0.3, local_word_delay=0.02)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    assert await until_closed(gateway.port, head) == b""
    body = {"model": "m", "messages": [_user()], "stream": True}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        started = asyncio.get_running_loop().time()
        answer = await http.post("/chat/completions", json=body)
        took = asyncio.get_running_loop().time() - started
    assert answer.status_code == 200
    assert answer.text.rstrip().endswith("data: [DONE]")
    assert took > 0.3  # streamed for longer than the bound, whole
    assert bundles(tmp_path / "traces") != []


# -- headers -----------------------------------------------------------------------------------

_TOKEN = "gw-client-tok"


@pytest.fixture
def any_traceback(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """Every log record of the test with a traceback from the gateway or aiohttp (its server
    logs an exception that escaped the gateway's handlers, and answers its 500 page). Not
    asyncio's: an SDK client an earlier test left open is closed when it is collected, on a
    loop that is gone, and says so in the middle of whichever test runs then."""
    caplog.set_level(logging.INFO)
    return lambda: [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.exc_info is not None and r.name.startswith(("agent_server", "aiohttp"))
    ]


@pytest.mark.parametrize(
    "authorization",
    [
        b"Bearer \xff\xfe",
        b"Bearer " + _TOKEN.encode() + b"\xe9",
        b"Bearer \xc3\xa9t\xc3\xa9",
        b"\xff\xfe " + _TOKEN.encode(),
    ],
    ids=["invalid-utf8", "token-then-latin1", "non-ascii-utf8", "bad-scheme"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/rollout/v1/sessions"])
async def test_a_token_of_any_bytes_is_a_401(
    start_gateway: StartGateway,
    upstream: Upstream,
    any_traceback: Callable[[], list[str]],
    authorization: bytes,
    path: str,
) -> None:
    from grpc_common import AccessControl

    gateway = await start_gateway(upstream.url, access=AccessControl(token=_TOKEN))
    async with httpx.AsyncClient(base_url=_root_url(gateway)) as http:
        answer = await http.request(
            "POST" if path.endswith("completions") else "GET",
            path,
            json={"model": "m", "messages": [_user()]},
            headers={b"Authorization": authorization},
        )
        good = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [_user()]},
            headers={"Authorization": f"Bearer {_TOKEN}"},
        )
    # Was: 500 with aiohttp's own page ("surrogates not allowed" encoding the header's text).
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"] == {
        "message": "the gateway needs `Authorization: Bearer <token>`: an OpenAI client sends "
        "its API key (OPENAI_API_KEY) as the token, so set it to the gateway's",
        "type": "authentication_error",
        "code": "invalid_api_key",
    }
    assert good.status_code == 200, good.text
    assert any_traceback() == []
    # Only the good request was recorded.
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert len(calls(trace)) == 1


async def test_headers_that_are_not_utf8_are_answered(
    start_gateway: StartGateway, upstream: Upstream, any_traceback: Callable[[], list[str]]
) -> None:
    # The headers the gateway reads itself: a named session key is refused as one, a hint is
    # made into a key, a traceparent that is none is ignored; none of them is a 500.
    gateway = await start_gateway(upstream.url)
    body = {"model": "m", "messages": [_user()]}
    async with httpx.AsyncClient(base_url=_root_url(gateway)) as http:
        named = await http.post(
            "/v1/chat/completions", json=body, headers={b"x-rollout-session": b"\xff\xfe"}
        )
        hinted = [
            await http.post(
                "/v1/chat/completions", json=body, headers={b"session_id": b"conv-\xff"}
            )
            for _ in range(2)
        ]
        traced = await http.post(
            "/v1/chat/completions", json=body, headers={b"traceparent": b"00-\xff\xfe-01"}
        )
    assert named.status_code == 400, named.text
    assert named.json()["error"]["code"] == "invalid_session"
    assert [answer.status_code for answer in hinted] == [200, 200]
    assert hinted[0].headers["x-rollout-session"] == hinted[1].headers["x-rollout-session"]
    assert hinted[0].headers["x-rollout-session"].startswith("session_id#")
    assert traced.status_code == 200, traced.text
    assert any_traceback() == []


@pytest.mark.parametrize("request_bytes", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS)
async def test_a_request_the_parser_refuses_is_logged_without_its_bytes(
    start_gateway: StartGateway, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    from grpc_common import AccessControl

    caplog.set_level(logging.DEBUG)
    gateway = await start_gateway(access=AccessControl(token=SECRET))
    head = await status_line(gateway.port, request_bytes)
    assert head.split(b" ")[1] == b"400", head
    # Was: aiohttp's ERROR with its traceback, quoting the header line and the token in it.
    (line,) = refusals(caplog.records)
    assert line.startswith("WARNING refused a malformed HTTP request from 127.0.0.1: "), line
    assert bundles(gateway.settings.trace_root) == []


# -- request sizes -----------------------------------------------------------------------------


async def _raw_answer(port: int, head: bytes) -> tuple[bytes, dict[str, Any], bool]:
    """Send head on a new connection; the status line, the JSON body, and whether the gateway
    closed the connection after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        async with asyncio.timeout(30):
            answer = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":", 1)[1]
                    for line in answer.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
            )
            body = json.loads(await reader.readexactly(length))
            closed = await reader.read(1) == b""
    finally:
        writer.close()
    return answer.split(b"\r\n", 1)[0], body, closed


async def test_a_declared_length_over_the_bound_is_refused_before_the_body(
    start_gateway: StartGateway, any_traceback: Callable[[], list[str]]
) -> None:
    # A read timeout far past the test's own: a gateway that waits for the body fails it.
    gateway = await start_gateway(request_read_timeout=3600.0)
    status, body, closed = await _raw_answer(
        gateway.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: 99999999999\r\n\r\n{}",
    )
    assert status.split()[1] == b"413"
    assert body["error"] == {
        "message": f"the request body is over {gateway.settings.max_request_bytes} bytes",
        "type": "invalid_request_error",
        "code": "request_too_large",
    }
    # The body is never read: the connection ends with the answer.
    assert closed
    assert bundles(gateway.settings.trace_root) == []
    assert any_traceback() == []


async def test_a_body_over_the_bound_without_a_length_is_a_413(
    start_gateway: StartGateway, any_traceback: Callable[[], list[str]]
) -> None:
    gateway = await start_gateway(max_request_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": [], "pad": "'
        yield b"x" * 5000
        yield b'"}'

    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post("/chat/completions", content=chunks())
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "request_too_large"
    assert bundles(gateway.settings.trace_root) == []
    assert any_traceback() == []


def _chat_body(size: int, text: str = "hello") -> bytes:
    """A Chat Completions body of exactly size bytes (padded inside a field the upstream
    ignores), one user message."""
    head = {"model": "m", "messages": [{"role": "user", "content": text}], "pad": ""}
    empty = json.dumps(head).encode()
    return json.dumps({**head, "pad": "x" * (size - len(empty))}).encode()


async def _holding(gateway: Gateway, size: int) -> None:
    """Once the gateway holds size bytes of request bodies (read on its own schedule)."""
    async with asyncio.timeout(10):
        while True:
            if gateway.body_budget.used >= size:
                return
            await asyncio.sleep(0.01)


async def test_bodies_past_the_budget_are_refused_503_and_the_session_records_on(
    start_gateway: StartGateway, any_traceback: Callable[[], list[str]]
) -> None:
    # Was: no bound on the bodies read and parsed at once: a 31 MiB body of 900,000 small
    # messages took the gateway 16 times its size, and nothing stopped a few clients sending
    # several at once.
    budget = 64 * 1024
    gateway = await start_gateway(max_request_bytes=budget, request_body_budget=budget)
    session = {"x-rollout-session": "budgeted"}
    held = _chat_body(40_000, "held")
    # A client holds 30,000 bytes of the budget: its body has not all arrived yet.
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nx-rollout-session: budgeted\r\n"
        + f"Content-Length: {len(held)}\r\n\r\n".encode()
        + held[:30_000]
    )
    await writer.drain()
    await _holding(gateway, 30_000)
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0, default_headers=session)
    async with client:
        # 40,000 more declared: refused at once, before any of it is read.
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "y" * 40_000}]
            )
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body == {
            "message": (
                "the gateway is reading and recording as many request bodies as its "
                f"--request-body-budget ({budget} bytes) allows; retry after 1 s"
            ),
            "type": "server_error",
            "code": "gateway_busy",
        }
        # A body without a length, refused as it passes the budget: the client, which sends
        # it whole before reading, gets the 503 (the rest is read and dropped), not a reset.

        async def pieces() -> AsyncIterator[bytes]:
            body = _chat_body(40_000, "chunked")
            for start in range(0, len(body), 8192):
                yield body[start : start + 8192]

        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            chunked = await http.post("/chat/completions", content=pieces(), headers=session)
        assert chunked.status_code == 503, chunked.text
        assert chunked.json()["error"]["code"] == "gateway_busy"
        # What fits goes through, in the same session.
        small = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "fits"}]
        )
        assert small.choices[0].message.content
    # The held body ends: its call goes through as well.
    writer.write(held[30_000:])
    await writer.drain()
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert gateway.body_budget.used == 0
    await gateway.stop()
    (trace,) = reduce_all(gateway.settings.trace_root)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    recorded = calls(trace)
    assert [call.execution.status for call in recorded] == [COMPLETED, COMPLETED]
    # The refused requests left nothing in the session's bundle: only what went through.
    texts = [items_text(trace, call.request_item_ids) for call in recorded]
    assert texts == ["fits", "held"]
    assert any_traceback() == []


# -- turns whose call was cancelled ------------------------------------------------------------


@pytest.mark.parametrize(("retry", "status"), [(False, "CANCELLED"), (True, "COMPLETED")])
async def test_a_turn_whose_last_call_the_client_abandoned_ends_cancelled(
    start_gateway: StartGateway,
    upstream: Upstream,
    tracebacks: Callable[[], list[str]],
    retry: bool,
    status: str,
) -> None:
    loop = asyncio.get_running_loop()
    dropped = loop.create_future()

    async def trickle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return await _chat_completion(request)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]}
        try:
            while True:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.05)  # the upstream's pace, not a synchronisation
        except ConnectionResetError:
            # The gateway hangs up once it has recorded the call's end.
            dropped.set_result(None)
        return response

    upstream.answer = trickle
    gateway = await start_gateway(upstream.url)
    request = {"model": "m", "messages": [_user()]}
    headers = {"x-rollout-session": "abandoned"}
    async with httpx.AsyncClient(base_url=_root_url(gateway), timeout=60) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json={**request, "stream": True}, headers=headers
        ) as answer:
            async for text in answer.aiter_lines():
                if text.startswith("data:"):
                    break  # the client goes away mid-answer
        async with asyncio.timeout(30):
            await dropped
        if retry:
            # The same input again: the same turn, answered this time.
            again = await http.post("/v1/chat/completions", json=request, headers=headers)
            assert again.status_code == 200, again.text
        closed = await http.post("/rollout/v1/sessions/abandoned/close")
        assert closed.status_code == 200, closed.text
    (trace,) = reduce_all(gateway.settings.trace_root)
    (turn,) = trace.turns.values()
    assert calls(trace)[0].execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert calls(trace)[0].end_reason == "client_disconnected"
    # An interrupted turn is CANCELLED (SPEC section 4); was COMPLETED.
    assert common_pb2.ExecutionStatus.Name(turn.execution.status) == f"EXECUTION_STATUS_{status}"
    assert tracebacks() == []


# What a browser sends for a page whose own name an attacker pointed at 127.0.0.1 (DNS
# rebinding), and names of loopback the gateway still answers.
REBOUND_HOSTS = ["attacker.example", "attacker.example:8090", "127.0.0.1.attacker.example", ""]
LOOPBACK_HOSTS = ["localhost", "LOCALHOST:8090", "127.0.0.1:8090", "127.9.9.9", "[::1]:8090"]


@pytest.mark.parametrize("host", REBOUND_HOSTS)
async def test_a_tokenless_gateway_refuses_a_request_to_another_name(
    start_gateway: StartGateway, upstream: Upstream, host: str
) -> None:
    gateway = await start_gateway(upstream.url)
    async with httpx.AsyncClient(base_url=_root_url(gateway), headers={"Host": host}) as http:
        sessions = await http.get("/rollout/v1/sessions")
        completion = await http.post(
            "/v1/chat/completions", json={"model": "m", "messages": [_user()]}
        )
    for answer in (sessions, completion):
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["code"] == "forbidden_host"
        assert "--auth-token-env" in answer.json()["error"]["message"]
    # Nothing went upstream, nothing was recorded.
    assert bundles(gateway.settings.trace_root) == []


async def test_a_tokenless_gateway_answers_loopback_s_names_and_a_token_any_name(
    start_gateway: StartGateway, upstream: Upstream
) -> None:
    gateway = await start_gateway(upstream.url)
    for host in LOOPBACK_HOSTS:
        async with httpx.AsyncClient(base_url=_root_url(gateway), headers={"Host": host}) as http:
            answer = await http.get("/rollout/v1/sessions")
        assert answer.status_code == 200, (host, answer.text)
    guarded = await start_gateway(upstream.url, access=AccessControl(token=_TOKEN))
    headers = {"Host": "gateway.internal:8090", "Authorization": f"Bearer {_TOKEN}"}
    async with httpx.AsyncClient(base_url=_root_url(guarded), headers=headers) as http:
        answer = await http.post("/v1/chat/completions", json={"model": "m", "messages": [_user()]})
    assert answer.status_code == 200, answer.text
