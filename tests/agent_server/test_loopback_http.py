"""The loopback HTTP server of the local model and the test providers, on aiohttp's server:
whole and streamed responses, keep-alive, the faults the provider tests rely on (a dropped
connection, a stall ended by the client or by stop), and what aiohttp's parser brings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from agent_server.local_model import LocalModel
from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer, json_post


async def test_the_local_model_is_served_by_aiohttp() -> None:
    model = await LocalModel.start(0.0)
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.post(
                f"{model.url}/responses", json={"model": "m", "input": "hi", "stream": False}
            )
    finally:
        await model.stop()
    assert "aiohttp" in reply.headers["server"]


async def test_whole_and_streamed_responses_share_one_connection() -> None:
    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        posted = await json_post(request, response, ("/whole", "/stream"))
        if posted is None:
            return
        route, body = posted
        if route == "/whole":
            await response.send(201, b'{"ok":true}', headers={"x-seen": str(body["n"])})
            return
        await response.start()
        for n in range(3):
            await response.event({"n": n}, event="tick")

    server = await LoopbackHttpServer.start(handle, keep_requests=True)
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            whole = await client.post("/whole?x=1", json={"n": 7})
            streamed = await client.post("/stream", json={})
            missing = await client.get("/nowhere")
            bad = await client.post("/whole", content=b"{not json")
    finally:
        await server.stop()
    assert (whole.status_code, whole.json(), whole.headers["x-seen"]) == (201, {"ok": True}, "7")
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text == "".join(f'event: tick\ndata: {{"n":{n}}}\n\n' for n in range(3))
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert bad.status_code == 400
    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", "/whole?x=1"),
        ("POST", "/stream"),
        ("GET", "/nowhere"),
        ("POST", "/whole"),
    ]
    assert server.requests[0].headers["content-type"] == "application/json"


async def test_a_reset_drops_the_stream_mid_way() -> None:
    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        await response.start()
        await response.write(b"data: one\n\n")
        response.reset()

    server = await LoopbackHttpServer.start(handle)
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            seen: list[bytes] = []

            async def read() -> None:
                async with client.stream("POST", "/", content=b"{}") as reply:
                    async for chunk in reply.aiter_raw():
                        seen.append(chunk)

            with pytest.raises(httpx.RemoteProtocolError):
                await read()
    finally:
        await server.stop()
    assert b"".join(seen) == b"data: one\n\n"


async def test_a_handler_that_fails_answers_an_openai_style_500() -> None:
    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    server = await LoopbackHttpServer.start(handle)
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            reply = await client.post("/", content=b"{}")
    finally:
        await server.stop()
    # Was: `internal error` as plain text, which an OpenAI SDK cannot read as an error.
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "internal_error"
    assert reply.json()["error"]["type"] == "server_error"


async def test_a_held_stream_ends_when_the_client_leaves() -> None:
    left = asyncio.Event()
    started = asyncio.Event()

    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        await response.start()
        await response.write(b"data: held\n\n")
        started.set()
        await response.wait_disconnected()
        left.set()
        response.reset()

    server = await LoopbackHttpServer.start(handle)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url) as client,
            client.stream("POST", "/", content=b"{}") as reply,
        ):
            async for _ in reply.aiter_raw():
                break
            await asyncio.wait_for(started.wait(), 10)
        # The client closed the stream: the handler's wait ended and its cleanup ran.
        await asyncio.wait_for(left.wait(), 10)
    finally:
        await server.stop()


async def test_stop_ends_a_stalled_stream() -> None:
    stalled = asyncio.Event()

    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        await response.start()
        await response.write(b"data: first\n\n")
        stalled.set()
        await asyncio.Event().wait()  # a provider that never sends again

    server = await LoopbackHttpServer.start(handle)
    async with httpx.AsyncClient(base_url=server.url) as client:

        async def read() -> bytes:
            seen = b""
            async with client.stream("POST", "/", content=b"{}") as reply:
                async for chunk in reply.aiter_raw():
                    seen += chunk
            return seen

        reading = asyncio.create_task(read())
        await asyncio.wait_for(stalled.wait(), 10)
        await asyncio.wait_for(server.stop(), 10)
        with pytest.raises(httpx.RemoteProtocolError):
            await asyncio.wait_for(reading, 10)


async def test_aiohttp_parses_what_the_hand_written_server_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, request.body)

    server = await LoopbackHttpServer.start(handle)
    try:

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"a":'
            yield b"1}"

        async with httpx.AsyncClient(base_url=server.url) as client:
            # A chunked request body (it answered 411).
            echoed = await client.post("/", content=chunks())
        # A malformed request line gets aiohttp's 400, and the server keeps serving.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"NOT HTTP\r\n\r\n")
        head = await asyncio.wait_for(reader.read(1024), 10)
        writer.close()
        async with httpx.AsyncClient(base_url=server.url) as client:
            after = await client.post("/", content=b"still here")
    finally:
        await server.stop()
    assert echoed.content == b'{"a":1}'
    assert head.split(b" ")[1] == b"400", head
    assert after.content == b"still here"
    # Answered, not logged as a fault with a traceback.
    assert not [record for record in caplog.records if record.exc_info]
