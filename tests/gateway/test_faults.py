"""Faults: client disconnect, upstream stall, disk full, kill -9, a slow client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web
from openai.types.responses import ResponseTextDeltaEvent

from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    created,
    item_added,
    message,
    sse,
    text_delta,
)
from tests.agent_server.test_recording import _redirect_to_dev_full
from tests.gateway.conftest import StartGateway, bundles, calls, only_trace, sdk
from trace_reducer import replay_bundle

CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


def _opening(text: str) -> str:
    """A response that has streamed `text` of one message and then waits."""
    item = message("", "msg-1")
    return sse(created("resp-1"), item_added(item), text_delta(text, "msg-1"))


async def _call_status(root: Path, status: int) -> state_pb2.RolloutTrace:
    """The one bundle under root once its only call has the status (recorded by the gateway
    on its own schedule, after the client left)."""
    async with asyncio.timeout(20):
        while True:
            found = bundles(root)
            if found:
                trace = replay_bundle(found[0])
                if trace.inference_calls and calls(trace)[0].execution.status == status:
                    return trace
            await asyncio.sleep(0.02)


async def _read_until(chunks: AsyncIterator[str], needle: str) -> str:
    seen = ""
    async for chunk in chunks:
        seen += chunk
        if needle in seen:
            return seen
    raise AssertionError(f"the stream ended before {needle!r}")


async def test_client_disconnect_cancels_the_call_and_keeps_what_came(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    never = asyncio.Event()
    provider.queue(_opening("partial words"), never)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        body = {"model": "m", "input": "hi", "stream": True}
        async with http.stream("POST", "/responses", json=body) as answer:
            await _read_until(answer.aiter_text(), "partial words")
    trace = await _call_status(gateway.settings.trace_root, CANCELLED)
    (call,) = calls(trace)
    assert call.execution.status == CANCELLED
    assert [d.partial_text for d in call.discarded_outputs] == ["partial words"]
    never.set()


async def test_upstream_stall_mid_stream_fails_the_call(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url, stream_idle_timeout=0.3)
    never = asyncio.Event()
    provider.queue(_opening("before the stall"), never)
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    stream = await client.responses.create(model="m", input="hi", stream=True)
    got: list[str] = []

    async def read() -> None:
        async for event in stream:
            if isinstance(event, ResponseTextDeltaEvent):
                got.append(event.delta)

    with pytest.raises((httpx.HTTPError, openai.APIError)):
        await read()
    assert got == ["before the stall"]
    never.set()
    await gateway.stop()
    (call,) = calls(only_trace(gateway.settings.trace_root))
    assert (call.execution.status, call.error.code) == (FAILED, "stream_idle_timeout")
    assert [d.partial_text for d in call.discarded_outputs] == ["before the stall"]


async def test_a_session_that_cannot_be_recorded_is_refused_with_503(
    start_gateway: StartGateway, provider: ScriptedProvider, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    gateway = await start_gateway(provider.url, trace_root=blocker / "traces")
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="failed to start rollout recording") as e:
        await client.responses.create(model="m", input="hi")
    assert e.value.status_code == 503
    assert provider.requests == [], "an unrecorded call was forwarded"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_disk_full_before_a_call_answers_503_and_forwards_nothing(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    client = sdk(
        base_url=gateway.url,
        api_key="unused",
        max_retries=0,
        default_headers={"x-rollout-session": "full"},
    )
    provider.queue(sse(created("resp-1")) + sse({"type": "response.completed", "response": {}}))
    await client.responses.create(model="m", input="recorded", stream=True)
    (path,) = bundles(gateway.settings.trace_root)
    _redirect_to_dev_full(path / "trace.binpb")
    with pytest.raises(openai.InternalServerError, match="could not record") as refused:
        await client.responses.create(model="m", input="not recorded")
    assert refused.value.status_code == 503
    assert len(provider.requests) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_disk_full_mid_stream_stops_forwarding(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    go_on = asyncio.Event()
    provider.queue(_opening("recorded part"), go_on, sse(text_delta(" UNRECORDED", "msg-1")))
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        body = {"model": "m", "input": "hi", "stream": True}
        async with http.stream("POST", "/responses", json=body) as answer:
            chunks = answer.aiter_text()
            seen = await _read_until(chunks, "recorded part")
            (path,) = bundles(gateway.settings.trace_root)
            _redirect_to_dev_full(path / "trace.binpb")
            go_on.set()
            async for chunk in chunks:
                seen += chunk
    assert "UNRECORDED" not in seen
    assert "recording_failed" in seen


async def test_kill_9_keeps_every_chunk_a_client_received(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        *("gateway", "--listen", "127.0.0.1:0", "--trace-root", str(root)),
        *("--local-word-delay", "0.05", "--log-level", "warning"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await process.stdout.readline()).decode()
        assert line.startswith("listening on "), line
        url = line.removeprefix("listening on ").strip()
        received: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": "m", "input": "tell me everything", "stream": True}
            async with http.stream("POST", "/responses", json=body) as answer:
                buffer = ""
                async for chunk in answer.aiter_text():
                    buffer += chunk
                    *blocks, buffer = buffer.split("\n\n")
                    for block in blocks:
                        data = [x[6:] for x in block.split("\n") if x.startswith("data: ")]
                        event = json.loads("".join(data)) if data else {}
                        if event.get("type") == "response.output_text.delta":
                            received.append(event["delta"])
                    if len(received) >= 5:
                        os.kill(process.pid, signal.SIGKILL)
                        break
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    (path,) = bundles(root)
    trace = replay_bundle(path)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_UNCLOSED
    (call,) = calls(trace)
    (discarded,) = call.discarded_outputs
    assert discarded.partial_text.startswith("".join(received))


async def test_a_slow_client_never_makes_the_gateway_hold_the_stream(
    start_gateway: StartGateway,
) -> None:
    """The upstream can only write as fast as the client reads, give or take the buffers."""
    piece = "x" * (64 * 1024)
    # 20 MiB in all: the loopback sockets' buffers between upstream and client hold a few MiB.
    count = 320
    written = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal written
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        # The upstream's own send buffer small too: less data between it and the client.
        upstream_socket = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
        upstream_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        await answer.prepare(request)
        item = message("", "msg-1")
        await answer.write(sse(created("resp-1"), item_added(item)).encode())
        for _ in range(count):
            await answer.write(sse(text_delta(piece, "msg-1")).encode())
            written += 1
        done = {**item, "content": [{"type": "output_text", "text": piece * count}]}
        await answer.write(
            sse(
                {"type": "response.output_item.done", "item": done},
                {"type": "response.completed", "response": {"id": "resp-1"}},
            ).encode()
        )
        return answer

    app = web.Application()
    app.router.add_post("/v1/responses", stream)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        gateway = await start_gateway(f"http://127.0.0.1:{port}/v1")
        _, gateway_port = gateway.host, gateway.port
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port, limit=64 * 1024)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        body = json.dumps({"model": "m", "input": "hi", "stream": True}).encode()
        writer.write(
            b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        # The client reads nothing: the upstream stops once the buffers between are full.
        async with asyncio.timeout(30):
            last = -1
            while written != last:
                last = written
                await asyncio.sleep(0.5)
        assert written < count // 2, f"the upstream wrote {written} of {count} pieces unread"
        # Now a fast reader: the rest flows at loopback speed.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        received = 0
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
        writer.close()
        assert written == count
        assert received > count * len(piece)
    finally:
        await runner.cleanup()
    await gateway.stop()
    (call,) = calls(only_trace(gateway.settings.trace_root))
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED


async def test_closing_a_session_mid_stream_forwards_nothing_unrecorded(
    start_gateway: StartGateway, provider: ScriptedProvider
) -> None:
    gateway = await start_gateway(provider.url)
    go_on = asyncio.Event()
    provider.queue(_opening("recorded part"), go_on, sse(text_delta(" UNRECORDED", "msg-1")))
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        body = {"model": "m", "input": "hi", "stream": True}
        headers = {"x-rollout-session": "closing"}
        async with http.stream("POST", "/responses", json=body, headers=headers) as answer:
            chunks = answer.aiter_text()
            seen = await _read_until(chunks, "recorded part")
            closed = await http.post(
                gateway.url.removesuffix("/v1") + "/rollout/v1/sessions/closing/close"
            )
            assert closed.status_code == 200
            go_on.set()
            async for chunk in chunks:
                seen += chunk
    assert "UNRECORDED" not in seen
    # The close cut the call off: its stream ends with the error event saying so.
    assert seen.endswith("\n\n")
    assert '"code": "session_closed"' in seen
    trace = replay_bundle(Path(closed.json()["bundle_path"]))
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
