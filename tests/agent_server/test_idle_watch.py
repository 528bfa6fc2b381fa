"""The provider stream's idle timeout: the wait for the answer's headers, and IdleWatch over its
body. Silence fails the attempt once it lasts the timeout, and nothing else does."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from agent_server.provider import IdleWatch, ProviderClient, ProviderError
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    completed,
    created,
    sse,
    text_delta,
)

IDLE = 0.3
# Far past when any of these should have ended: a failure, not a hang, when one does not.
GIVE_UP = 20 * IDLE


def body() -> dict[str, Any]:
    return {"model": "m", "stream": True, "input": []}


async def read_types(client: ProviderClient, seen: list[str]) -> None:
    """Read one attempt to its end, each event's type into seen as it comes."""
    async with asyncio.timeout(GIVE_UP), client.batches("inf_test", body()) as reader:
        while batch := await reader.next():
            seen += [event.type for event in batch]


async def test_a_provider_silent_before_its_headers_fails_the_attempt_after_the_timeout() -> None:
    requests: list[bytes] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Reads the request and says nothing, until the client gives up and closes.
        requests.append(await reader.read())
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = ProviderClient(f"http://127.0.0.1:{port}/v1", None, idle_timeout=IDLE)
    began = time.monotonic()
    try:
        with pytest.raises(ProviderError) as failed:
            await read_types(client, [])
        waited = time.monotonic() - began
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert (failed.value.code, failed.value.retryable) == ("stream_idle_timeout", True)
    assert failed.value.message == "the provider stream was idle too long"
    assert waited >= IDLE


async def test_a_body_that_goes_silent_fails_the_attempt_after_what_it_sent(
    provider: ScriptedProvider,
) -> None:
    provider.queue(sse(created()), asyncio.Event())
    client = ProviderClient(provider.url, None, idle_timeout=IDLE)
    seen: list[str] = []
    try:
        with pytest.raises(ProviderError) as failed:
            await read_types(client, seen)
    finally:
        await client.aclose()
    assert failed.value.code == "stream_idle_timeout"
    assert seen == ["response.created"]


async def test_a_stream_never_silent_for_the_timeout_outlasts_it(
    provider: ScriptedProvider,
) -> None:
    # The provider sends a delta every half timeout, for four timeouts in all.
    gates = [asyncio.Event() for _ in range(8)]
    steps: list[Any] = [sse(created())]
    for number, gate in enumerate(gates):
        steps += [gate, sse(text_delta(f"w{number} "))]
    provider.queue(*steps, sse(completed()))
    loop = asyncio.get_running_loop()
    for number, gate in enumerate(gates, start=1):
        loop.call_later(number * IDLE / 2, gate.set)
    client = ProviderClient(provider.url, None, idle_timeout=IDLE)
    seen: list[str] = []
    began = time.monotonic()
    try:
        await read_types(client, seen)
    finally:
        await client.aclose()
    assert time.monotonic() - began >= 4 * IDLE
    assert seen == ["response.created", *["response.output_text.delta"] * 8, "response.completed"]


async def test_data_waiting_unread_is_not_silence(provider: ScriptedProvider) -> None:
    # The reader is busy for three timeouts while most of what the provider sent (in one write)
    # waits in the buffer: the provider was not the one that stopped. Once that is read,
    # silence counts again.
    sent = sse(created(), text_delta("waiting"))
    provider.queue(sent, asyncio.Event())
    no_read_timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with (
        aiohttp.ClientSession(timeout=no_read_timeout) as session,
        session.post(provider.url + "/responses", json=body()) as response,
    ):
        watch = IdleWatch(response.content, IDLE)
        try:
            async with asyncio.timeout(GIVE_UP):
                head = await response.content.readexactly(5)
                watch.consumed += len(head)
                await asyncio.sleep(3 * IDLE)
                assert response.content.exception() is None
                rest = await response.content.readexactly(len(sent) - len(head))
                watch.consumed += len(rest)
                assert (head + rest).decode() == sent
                began = time.monotonic()
                with pytest.raises(aiohttp.SocketTimeoutError):
                    await response.content.readany()
            assert time.monotonic() - began >= IDLE * 0.75
        finally:
            watch.cancel()


async def test_a_cancelled_watch_fails_nothing(provider: ScriptedProvider) -> None:
    provider.queue(sse(created()), asyncio.Event())
    no_read_timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with (
        aiohttp.ClientSession(timeout=no_read_timeout) as session,
        session.post(provider.url + "/responses", json=body()) as response,
    ):
        watch = IdleWatch(response.content, IDLE)
        watch.cancel()
        chunk = await response.content.readany()
        watch.consumed += len(chunk)
        await asyncio.sleep(3 * IDLE)
        assert response.content.exception() is None
