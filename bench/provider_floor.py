"""The provider stream read alone: CPU per event of HTTP client stacks on the same SSE streams.

`python -m bench.provider_floor --serve` runs a paced SSE server (its own process) that answers
every POST with `--events` text-delta events of the Responses API, each its own write, one every
`--interval` seconds. The stacks read the same streams, many at once, in alternating rounds:

* `httpx`: httpx on its default transport (httpcore), httpx-sse (what the agent used before);
* `httpx+aiohttp`: httpx on httpx-aiohttp's transport, httpx-sse (what the agent used next);
* `agent`: the agent's own reader, `ProviderClient.batches` (aiohttp read in the caller's task,
  `agent_server.sse`, each event's JSON parsed and checked);
* `aiohttp`: aiohttp alone, events split by hand and each event's JSON read by orjson, as the
  agent reads it (the floor: the read, the split and the parse, no checks, no layers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from httpx_sse import aconnect_sse

from agent_server.provider import ProviderClient
from bench._harness import spawn
from grpc_common import install_signal_handlers

_BODY = b'{"stream":true}'


def _chunk(event: dict[str, object]) -> bytes:
    block = f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
    data = block.encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(events: int, interval: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                writer.write(_chunk({"type": "response.created", "response": {"id": "r"}}))
                for index in range(events):
                    await asyncio.sleep(interval)
                    delta = {
                        "type": "response.output_text.delta",
                        "item_id": "msg_0",
                        "output_index": 0,
                        "content_index": 0,
                        "sequence_number": index,
                        "delta": f" word{index}",
                    }
                    writer.write(_chunk(delta))
                    await writer.drain()
                writer.write(_chunk({"type": "response.completed", "response": {"id": "r"}}))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    host, port = server.sockets[0].getsockname()[:2]
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    print(f"listening on http://{host}:{port}/responses", flush=True)
    await stop.wait()
    server.close()


Reader = Callable[[str], Awaitable[int]]


async def _with_httpx(client: httpx.AsyncClient, url: str) -> int:
    count = 0
    async with aconnect_sse(client, "POST", url, content=_BODY) as source:
        async for sse in source.aiter_sse():
            json.loads(sse.data)
            count += 1
    return count


async def _with_aiohttp(session: aiohttp.ClientSession, url: str) -> int:
    count = 0
    async with session.post(url, data=_BODY) as response:
        rest = b""
        async for chunk in response.content.iter_any():
            *blocks, rest = (rest + chunk).split(b"\n\n")
            for block in blocks:
                for line in block.split(b"\n"):
                    if line.startswith(b"data:"):
                        orjson.loads(line[5:])
                        count += 1
    return count


async def _with_agent(client: ProviderClient) -> int:
    count = 0
    async with client.batches("bench", {"stream": True}) as reader:
        while batch := await reader.next():
            count += len(batch)
    return count


async def _round(stack: str, url: str, streams: int) -> tuple[int, float]:
    """Read `streams` streams at once with one stack; (events, CPU seconds of this process)."""
    started = time.process_time()
    if stack == "agent":
        agent = ProviderClient(
            url.removesuffix("/responses"), None, idle_timeout=60, max_connections=streams
        )
        try:
            counts = await asyncio.gather(*(_with_agent(agent) for _ in range(streams)))
        finally:
            await agent.aclose()
    elif stack == "aiohttp":
        async with aiohttp.ClientSession() as session:
            counts = await asyncio.gather(*(_with_aiohttp(session, url) for _ in range(streams)))
    else:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        transport = AiohttpTransport(limits=limits) if stack == "httpx+aiohttp" else None
        async with httpx.AsyncClient(
            limits=limits, transport=transport, timeout=60, trust_env=False
        ) as client:
            counts = await asyncio.gather(*(_with_httpx(client, url) for _ in range(streams)))
    return sum(counts), time.process_time() - started


@dataclass(frozen=True)
class StackFigures:
    """CPU per event of one stack: lowest, median, highest over the rounds."""

    low_us: float
    median_us: float
    high_us: float


STACKS = ("httpx", "httpx+aiohttp", "agent", "aiohttp")


def measure_stacks(
    streams: int = 100, events: int = 100, interval: float = 0.01, rounds: int = 3
) -> dict[str, StackFigures]:
    argv = [sys.executable, "-m", "bench.provider_floor", "--serve"]
    argv += ["--events", str(events), "--interval", str(interval)]
    samples: dict[str, list[float]] = {stack: [] for stack in STACKS}
    with spawn(argv) as server:
        for round_ in range(rounds):
            order = STACKS if round_ % 2 == 0 else STACKS[::-1]
            for stack in order:
                count, cpu = asyncio.run(_round(stack, server.address, streams))
                samples[stack].append(cpu / count * 1e6)
    return {
        stack: StackFigures(min(values), statistics.median(values), max(values))
        for stack, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.01)
    args = parser.parse_args()
    asyncio.run(_serve(args.events, args.interval))


if __name__ == "__main__":
    main()
