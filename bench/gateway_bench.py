"""P7: the gateway beside the same client straight to the same upstream, in alternating rounds.

The upstream is the stamped model in its own process (each delta carries its send time on the
system-wide monotonic clock); the gateway runs in its own process, recording; the client is one
httpx client in this one, the same code both ways. Measured: time to first chunk and per-chunk
latency (receipt minus stamp) at 1 and at 100 concurrent streams, the gateway's CPU per chunk,
and small non-streamed calls per second and per gateway CPU-second.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._harness import AGENT_SERVER, cpu_seconds, spawn

# A model's pace (20 chunks/s a stream): 2,000 chunks/s at 100 streams, on 2 shared cores.
_WORDS = 20
_WORD_DELAY = 0.05
# Rounds alternating which path goes first (BENCH_P7_ROUNDS to change): the p99 at 100 streams
# moves by more than the 2 ms budget between runs of one path on a shared machine, so the figure
# is each round's gateway p99 minus the direct p99 taken next to it, over many rounds.
ROUNDS = int(os.environ.get("BENCH_P7_ROUNDS", "9"))


@dataclass
class StreamRound:
    """One round of concurrent streams: what the client saw."""

    first_chunk_ms: list[float] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    failures: int = 0


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def _one_stream(http: httpx.AsyncClient, url: str, result: StreamRound, session: str) -> None:
    body = {"model": "bench", "input": [{"role": "user", "content": "go"}], "stream": True}
    # Stream i is always session i: its bundle is made in the warm-up, as an agent's session
    # is made once and then called again and again (the direct upstream ignores the header).
    headers = {"x-rollout-session": session}
    sent = time.monotonic_ns()
    first = True
    buffer = ""
    try:
        async with http.stream("POST", f"{url}/responses", json=body, headers=headers) as answer:
            async for text in answer.aiter_text():
                now = time.monotonic_ns()
                buffer += text
                *blocks, buffer = buffer.split("\n\n")
                for block in blocks:
                    if '"response.output_text.delta"' not in block:
                        continue
                    # `"delta":"word@<ns> "`: the stamp, without parsing the whole event.
                    stamp = int(block.rpartition("@")[2].partition(" ")[0])
                    if first:
                        result.first_chunk_ms.append((now - sent) / 1e6)
                        first = False
                    result.chunk_ms.append((now - stamp) / 1e6)
                    result.chunks += 1
    except httpx.HTTPError:
        result.failures += 1


async def _streams(url: str, count: int) -> StreamRound:
    result = StreamRound()
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(_one_stream(http, url, result, f"stream-{i}") for i in range(count)))
    return result


async def _small_calls(url: str, seconds: float, concurrency: int) -> int:
    body = {"model": "bench", "input": [{"role": "user", "content": "hi"}], "stream": False}
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=30) as http:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                answer = await http.post(f"{url}/responses", json=body)
                answer.raise_for_status()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


@dataclass
class P7Result:
    # By concurrency, by "direct"/"gateway": every round's client view.
    streams: dict[int, dict[str, list[StreamRound]]]
    gateway_cpu_us_per_chunk: list[float]
    calls_per_second: dict[str, list[float]]
    calls_per_gateway_cpu_second: list[float]


@contextmanager
def _servers(root: Path) -> Iterator[tuple[str, str, int]]:
    model_argv = [sys.executable, "-m", "bench._stamped_model"]
    model_argv += ["--word-delay", str(_WORD_DELAY), "--reply-length", str(_WORDS)]
    with spawn(model_argv) as model:
        upstream = model.address
        gateway_argv = [AGENT_SERVER, "gateway", "--listen", "127.0.0.1:0", "--upstream", upstream]
        gateway_argv += ["--trace-root", str(root / "gateway-traces"), "--log-level", "warning"]
        # No session is closed by the idle sweep mid-run.
        gateway_argv += ["--session-idle-timeout", "3600"]
        with spawn(gateway_argv) as gateway:
            yield upstream, gateway.address, gateway.popen.pid


def measure_p7(root: Path, rounds: int = ROUNDS) -> P7Result:
    streams: dict[int, dict[str, list[StreamRound]]] = {
        1: {"direct": [], "gateway": []},
        100: {"direct": [], "gateway": []},
    }
    cpu_per_chunk: list[float] = []
    calls: dict[str, list[float]] = {"direct": [], "gateway": []}
    calls_per_cpu: list[float] = []
    with _servers(root) as (upstream, gateway, pid):
        # Warm both paths (connections, imports, first sessions) outside the figures.
        asyncio.run(_streams(upstream, 100))
        asyncio.run(_streams(gateway, 100))
        for round_ in range(rounds):
            for concurrency in (1, 100):
                ways = ("direct", "gateway") if round_ % 2 else ("gateway", "direct")
                for way in ways:
                    if way == "direct":
                        streams[concurrency]["direct"].append(
                            asyncio.run(_streams(upstream, concurrency))
                        )
                        continue
                    before = cpu_seconds(pid)
                    through = asyncio.run(_streams(gateway, concurrency))
                    used = cpu_seconds(pid) - before
                    streams[concurrency]["gateway"].append(through)
                    if concurrency == 100 and through.chunks:
                        cpu_per_chunk.append(used / through.chunks * 1e6)
            seconds = 2.0
            calls["direct"].append(asyncio.run(_small_calls(upstream, seconds, 16)) / seconds)
            before = cpu_seconds(pid)
            done = asyncio.run(_small_calls(gateway, seconds, 16))
            used = cpu_seconds(pid) - before
            calls["gateway"].append(done / seconds)
            calls_per_cpu.append(done / used if used else 0.0)
    return P7Result(streams, cpu_per_chunk, calls, calls_per_cpu)


def added_per_round(result: P7Result, concurrency: int, share: float) -> list[float]:
    """Each round's gateway percentile minus the direct one of the same round (ms)."""
    ways = result.streams[concurrency]
    return [
        _percentile(gateway.chunk_ms, share) - _percentile(direct.chunk_ms, share)
        for direct, gateway in zip(ways["direct"], ways["gateway"], strict=True)
        if direct.chunk_ms and gateway.chunk_ms
    ]


def summary(result: P7Result) -> dict[str, float]:
    """The medians the table shows: ms added at p50/p99 per chunk, and to the first chunk."""
    out: dict[str, float] = {}
    for concurrency, ways in result.streams.items():
        for way, found in ways.items():
            chunks = [ms for r in found for ms in r.chunk_ms]
            firsts = [ms for r in found for ms in r.first_chunk_ms]
            out[f"{way}_{concurrency}_p50"] = _percentile(chunks, 0.50)
            out[f"{way}_{concurrency}_p99"] = _percentile(chunks, 0.99)
            out[f"{way}_{concurrency}_first"] = statistics.median(firsts)
            out[f"{way}_{concurrency}_failures"] = sum(r.failures for r in found)
    return out
