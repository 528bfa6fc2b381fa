"""P3, P4 and P5: the agent server end to end, in its own process, through real gRPC clients."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agent_server.local_model import reply_words
from bench._harness import ThreadRun, agent_server_argv, run_thread, spawn, stubs
from rollout.trace.v1 import record_pb2
from trace_reducer import decode_varint, request_body


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(index: int) -> str:
    return f"Question {index}: what did the model see when it answered the previous question?"


# -- P3 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Streaming:
    deltas: int
    events: int
    seconds: float
    server_cpu_seconds: float = 0.0

    @property
    def deltas_per_second(self) -> float:
        return self.deltas / self.seconds


async def _stream_threads(address: str, threads: int, turns: int) -> Streaming:
    prompts = [prompt(i) for i in range(turns)]
    expected = "".join("".join(reply_words(p)) for p in prompts)
    async with stubs(address, threads) as clients:
        started = time.perf_counter()
        runs = await asyncio.gather(*(run_thread(clients[i], prompts) for i in range(threads)))
        seconds = time.perf_counter() - started
    for run in runs:
        if run.failures or "".join(run.text) != expected:
            raise RuntimeError(f"a streaming thread went wrong: {run.failures}")
    deltas = threads * sum(len(reply_words(p)) for p in prompts)
    return Streaming(deltas, sum(run.delta_events for run in runs), seconds)


def measure_streaming(
    root: Path, rounds: int = 12, threads: int = 8, turns: int = 5
) -> dict[bool, Streaming]:
    """Provider deltas delivered per second with recording off and on, local model at full
    speed (word delay 0).

    Both servers run side by side and take turns in short bursts, so the two figures share
    whatever else the machine is doing; each sums its bursts.
    """
    with (
        spawn(agent_server_argv(trace_root=None, word_delay=0.0)) as off,
        spawn(agent_server_argv(trace_root=root / "p3", word_delay=0.0)) as on,
    ):
        servers = {False: off, True: on}
        totals = {rec: Streaming(0, 0, 0.0) for rec in servers}
        for server in servers.values():
            asyncio.run(_stream_threads(server.address, threads, 2))  # warm-up
        for round_ in range(rounds):
            for rec in (False, True) if round_ % 2 else (True, False):
                pid = servers[rec].popen.pid
                before = cpu_seconds(pid)
                burst = asyncio.run(_stream_threads(servers[rec].address, threads, turns))
                spent = cpu_seconds(pid) - before
                total = totals[rec]
                totals[rec] = Streaming(
                    total.deltas + burst.deltas,
                    total.events + burst.events,
                    total.seconds + burst.seconds,
                    total.server_cpu_seconds + spent,
                )
        return totals


# -- P4 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleSize:
    turns: int
    bundle_bytes: int
    unique_text_bytes: int
    history_layout_bytes: int
    delta_records: int
    delta_overhead_max: int
    delta_overhead_mean: float

    @property
    def bytes_per_turn(self) -> float:
        return self.bundle_bytes / self.turns


def _frames(path: Path) -> list[tuple[int, record_pb2.TraceRecord]]:
    """(frame bytes including the length prefix, record) for every frame of a bundle."""
    data = path.read_bytes()
    frames = []
    pos = 0
    while pos < len(data):
        decoded = decode_varint(data, pos)
        assert decoded is not None
        size, start = decoded
        frames.append(
            (start + size - pos, record_pb2.TraceRecord.FromString(data[start : start + size]))
        )
        pos = start + size
    return frames


def analyse_bundle(bundle: Path, turns: int, unique_text: int) -> BundleSize:
    frames = _frames(bundle / "trace.binpb")
    total = sum(size for size, _ in frames)
    overheads = []
    request_payload_bytes = 0
    call_ids = []
    for size, record in frames:
        kind = record.WhichOneof("body")
        if kind == "output_text_delta":
            overheads.append(size - len(record.output_text_delta.delta.encode()))
        elif kind == "payload" and record.payload.kind in (
            record_pb2.PAYLOAD_KIND_INPUT_ITEM,
            record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE,
        ):
            request_payload_bytes += size
        elif kind == "inference_started":
            call_ids.append(record.inference_started.inference_call_id)
    # The other layout: every call keeps its whole request body instead of new items by reference.
    bodies = sum(len(request_body(bundle, call_id)) for call_id in call_ids)
    return BundleSize(
        turns=turns,
        bundle_bytes=total,
        unique_text_bytes=unique_text,
        history_layout_bytes=total - request_payload_bytes + bodies,
        delta_records=len(overheads),
        delta_overhead_max=max(overheads),
        delta_overhead_mean=sum(overheads) / len(overheads),
    )


async def _conversation(address: str, turns: int) -> tuple[ThreadRun, int]:
    prompts = [prompt(i) for i in range(turns)]
    async with stubs(address, 1) as clients:
        run = await run_thread(clients[0], prompts)
    if run.failures:
        raise RuntimeError(f"the conversation went wrong: {run.failures}")
    unique = sum(len(p.encode()) for p in prompts) + len("".join(run.text).encode())
    return run, unique


def measure_bundle_size(root: Path, turns: int, word_delay: float) -> BundleSize:
    """One conversation through the agent server; the bundle against its text."""
    with spawn(agent_server_argv(trace_root=root / f"p4-{turns}", word_delay=word_delay)) as server:
        run, unique = asyncio.run(_conversation(server.address, turns))
    assert run.thread is not None
    return analyse_bundle(Path(run.thread.bundle_path), turns, unique)


# -- P5 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Concurrency:
    threads: int
    completed: int
    deltas: int
    delta_events: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    seconds: float
    cpu_seconds: dict[str, float]


_STAMP = re.compile(r"@(\d+) ")


async def _concurrent(address: str, threads: int, turns: int) -> Concurrency:
    latencies: list[int] = []

    def on_delta(text: str, received_ns: int) -> None:
        for stamp in _STAMP.findall(text):
            latencies.append(received_ns - int(stamp))

    prompts = [prompt(i) for i in range(turns)]
    start = asyncio.Event()
    async with stubs(address, 8) as clients:
        tasks = [
            asyncio.create_task(
                run_thread(
                    clients[i % len(clients)],
                    prompts,
                    on_delta=on_delta,
                    keep_text=False,
                    start=start,
                )
            )
            for i in range(threads)
        ]
        # Every thread exists and is subscribed before any turn starts.
        while sum(1 for t in tasks if not t.done()) and len(latencies) == 0:
            await asyncio.sleep(0.2)
            if all(t.done() for t in tasks):
                break
            break
        await asyncio.sleep(2.0)
        began = time.perf_counter()
        start.set()
        runs = await asyncio.gather(*tasks, return_exceptions=True)
        seconds = time.perf_counter() - began
    completed = sum(
        1 for run in runs if isinstance(run, ThreadRun) and not run.failures and run.turns == turns
    )
    latencies.sort()
    events = sum(run.delta_events for run in runs if isinstance(run, ThreadRun))

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] / 1e6

    return Concurrency(
        threads,
        completed,
        len(latencies),
        events,
        pct(0.50),
        pct(0.99),
        latencies[-1] / 1e6,
        seconds,
        {},
    )


def measure_concurrency(
    root: Path, threads: int = 200, turns: int = 2, word_delay: float = 0.02
) -> Concurrency:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", str(word_delay)]
    with (
        spawn(model_argv) as model,
        spawn(agent_server_argv(trace_root=root / "p5", provider_url=model.address)) as server,
    ):
        before = {"server": cpu_seconds(server.popen.pid), "model": cpu_seconds(model.popen.pid)}
        mine = os.times()
        result = asyncio.run(_concurrent(server.address, threads, turns))
        spent = {
            name: cpu_seconds(pid) - before[name]
            for name, pid in (("server", server.popen.pid), ("model", model.popen.pid))
        }
        now = os.times()
        spent["clients"] = now.user + now.system - mine.user - mine.system
        return replace(result, cpu_seconds=spent)
