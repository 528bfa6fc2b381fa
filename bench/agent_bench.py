"""P3, P4 and P5: the agent server end to end, in its own process, through real gRPC clients."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from agent_server.local_model import reply_words
from bench import grpc_floor, relay_floor
from bench._harness import (
    Process,
    ThreadRun,
    agent_server_argv,
    cpu_seconds,
    prompt,
    rotate,
    run_thread,
    spawn,
    stubs,
)
from rollout.trace.v1 import record_pb2
from trace_reducer import decode_varint, request_body

# -- P3 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """Server CPU per delta with recording on and off, one figure per round: the agent's, and
    the bare relay's (bench.relay_floor: the model's stream read, written and sent on, nothing
    else), in the same rounds."""

    on_us: list[float]
    off_us: list[float]
    floor_on_us: list[float]
    floor_off_us: list[float]
    deltas_per_round: int


async def _paced_threads(address: str, threads: int, turns: int) -> int:
    """Run `threads` threads of `turns` turns; the deltas the provider sent, all received."""
    prompts = [prompt(i) for i in range(turns)]
    stamps = 0

    def on_delta(text: str, received_ns: int) -> None:
        nonlocal stamps
        stamps += len(grpc_floor.STAMP.findall(text))

    async with stubs(address, 4) as clients:
        runs = await asyncio.gather(
            *(
                run_thread(clients[i % len(clients)], prompts, on_delta=on_delta, keep_text=False)
                for i in range(threads)
            )
        )
    for run in runs:
        if run.failures:
            raise RuntimeError(f"a streaming thread went wrong: {run.failures}")
    return stamps


P3_THREADS = 20


def measure_recording(
    root: Path,
    rounds: int = 6,
    threads: int = P3_THREADS,
    turns: int = 2,
    word_delay: float = 0.005,
    reply_length: int = 0,
) -> Recording:
    """Server CPU per delta, recording on vs off, at a real pace.

    The model runs in its own process and sends every delta as its own write, `word_delay`
    apart; two agent servers (one recording) and two bare relays (one recording) take turns,
    the order rotating each round, so all share whatever else the machine is doing.
    """
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", str(word_delay)]
    model_argv += ["--reply-length", str(reply_length)]
    with (
        spawn(model_argv) as model,
        spawn(agent_server_argv(trace_root=None, provider_url=model.address)) as off,
        spawn(agent_server_argv(trace_root=root / "p3", provider_url=model.address)) as on,
        relay_floor.serve(model.address, turns, None) as relay_off,
        relay_floor.serve(model.address, turns, root / "p3-relay") as relay_on,
    ):
        for server in (on, off):
            asyncio.run(_paced_threads(server.address, 2, 1))  # warm-up
        for bare in (relay_on, relay_off):
            relay_floor.drive(bare, 2)
        per_delta: dict[str, list[float]] = {}
        deltas = 0

        def agent(name: str, server: Process) -> None:
            nonlocal deltas
            before = cpu_seconds(server.popen.pid)
            deltas = asyncio.run(_paced_threads(server.address, threads, turns))
            per_delta.setdefault(name, []).append(
                (cpu_seconds(server.popen.pid) - before) / deltas * 1e6
            )

        def relay(name: str, server: Process) -> None:
            result = relay_floor.drive(server, threads, channels=4)
            per_delta.setdefault(name, []).append(result.server_cpu_seconds / result.deltas * 1e6)

        contenders = [
            # Rotated, each of a pair (on, off) goes first in half the rounds.
            functools.partial(agent, "on", on),
            functools.partial(relay, "floor on", relay_on),
            functools.partial(agent, "off", off),
            functools.partial(relay, "floor off", relay_off),
        ]
        rotate(contenders, rounds)
        return Recording(
            per_delta["on"], per_delta["off"], per_delta["floor on"], per_delta["floor off"], deltas
        )


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
    # Behind one address: each worker's share of the clients' connections, once all are open.
    connections: tuple[int, ...] = ()


async def _concurrent(
    addresses: list[str],
    threads: int,
    turns: int,
    window: int,
    channels: int = 8,
    on_ready: Callable[[], tuple[int, ...]] | None = None,
) -> Concurrency:
    """`threads` threads at once over `channels` connections per address, thread i owned by the
    server at addresses[i % len]; on_ready is asked, once every thread is set up, for each
    worker's share of the connections."""
    latencies: list[int] = []

    def on_delta(text: str, received_ns: int) -> None:
        for stamp in grpc_floor.STAMP.findall(text):
            latencies.append(received_ns - int(stamp))

    prompts = [prompt(i) for i in range(turns)]
    start = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        per_server = [await stack.enter_async_context(stubs(a, channels)) for a in addresses]
        tasks = [
            asyncio.create_task(
                run_thread(
                    per_server[i % len(addresses)][i // len(addresses) % channels],
                    prompts,
                    on_delta=on_delta,
                    keep_text=False,
                    start=start,
                    flush_window_ms=window,
                )
            )
            for i in range(threads)
        ]
        # Every thread is started and subscribed before any turn starts (a bench, not a test:
        # the threads' set-up is not what is measured).
        await asyncio.sleep(2.0)
        connections = on_ready() if on_ready is not None else ()
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
        connections,
    )


@dataclass(frozen=True)
class P5:
    """Each window's runs of the agent and of the bare floor, in alternating rounds; and the
    default window's runs with the threads spread over two server processes: two addresses,
    the client choosing (spread), and one address, `serve --workers 2` (workers)."""

    agent: dict[int, list[Concurrency]]
    floor: dict[int, list[grpc_floor.Floor]]
    spread: list[Concurrency]
    workers: list[Concurrency]
    # The bare relay, recording (bench.relay_floor): the whole job's floor, at window 0.
    relay: list[grpc_floor.Floor]


def _children(pid: int) -> list[int]:
    """The processes pid started (a supervisor's workers)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _connections_to(pids: list[int], port: int) -> tuple[int, ...]:
    """How many established TCP connections on `port` each process holds (its socket fds
    matched against the kernel's table): how the kernel spread the clients over the workers."""
    established: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":
                established.add(fields[9])
    counts = []
    for pid in pids:
        held = 0
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in established:
                held += 1
        counts.append(held)
    return tuple(counts)


def measure_p5(
    root: Path,
    threads: int = 200,
    windows: tuple[int, ...] = (0, 10),
    rounds: int = 3,
    turns: int = 2,
    word_delay: float = 0.02,
) -> P5:
    """The agent server (recording) and the bare grpc.aio floor streaming to `threads` clients
    at each flush window, the bare relay (reading the same model, recording) at window 0, and
    two agent servers sharing the threads at the last window (each thread owned by one
    process, the client choosing), the order rotating each round."""
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", str(word_delay)]
    agent: dict[int, list[Concurrency]] = {window: [] for window in windows}
    floor: dict[int, list[grpc_floor.Floor]] = {window: [] for window in windows}
    spread: list[Concurrency] = []
    workers: list[Concurrency] = []
    relay: list[grpc_floor.Floor] = []
    # The floor streams as many deltas to each client as the model sends a thread.
    per_stream = sum(len(reply_words(prompt(i))) for i in range(turns))
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(spawn(model_argv))
        servers = [
            stack.enter_context(
                spawn(agent_server_argv(trace_root=root / f"p5-{n}", provider_url=model.address))
            )
            for n in range(2)
        ]
        # One address, two worker processes behind it: the kernel spreads the clients'
        # connections, each thread stays with the worker its StartThread reached.
        supervised = stack.enter_context(
            spawn(
                [
                    *agent_server_argv(trace_root=root / "p5-workers", provider_url=model.address),
                    "--workers",
                    "2",
                ]
            )
        )
        bare = stack.enter_context(grpc_floor.serve(word_delay))
        relay_server = stack.enter_context(
            relay_floor.serve(model.address, turns, root / "p5-relay")
        )

        def run(into: list[Concurrency], used: list[Process], window: int) -> None:
            on_ready: Callable[[], tuple[int, ...]] | None = None
            # Behind one address the kernel's spread of connections decides each worker's
            # share, so more connections than the two addresses' 8 each even it out.
            channels = 8
            if used == [supervised]:
                # The supervisor's own CPU counts too (it only waits), with its workers'.
                loops = _children(supervised.popen.pid)
                pids = {f"server{n}": pid for n, pid in enumerate(loops)}
                pids["server-supervisor"] = supervised.popen.pid
                port = int(supervised.address.rsplit(":", 1)[1])
                on_ready = functools.partial(_connections_to, loops, port)
                channels = 16
            else:
                loops = [s.popen.pid for s in used]
                pids = {f"server{n}": pid for n, pid in enumerate(loops)}
            pids["model"] = model.popen.pid
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            loop_before = sum(cpu_seconds(pid, main_thread=True) for pid in loops)
            mine = os.times()
            addresses = [s.address for s in used]
            result = asyncio.run(_concurrent(addresses, threads, turns, window, channels, on_ready))
            spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            spent["server"] = sum(v for k, v in spent.items() if k.startswith("server"))
            # The servers' event loop threads: a loop busier than its core is what queues.
            spent["loop"] = sum(cpu_seconds(pid, main_thread=True) for pid in loops) - loop_before
            now = os.times()
            spent["clients"] = now.user + now.system - mine.user - mine.system
            into.append(replace(result, cpu_seconds=spent))

        contenders: list[Callable[[], None]] = []
        for window in windows:
            contenders.append(functools.partial(run, agent[window], servers[:1], window))
            contenders.append(
                functools.partial(
                    lambda w: floor[w].append(grpc_floor.drive(bare, threads, per_stream, w)),
                    window,
                )
            )
        contenders.append(lambda: relay.append(relay_floor.drive(relay_server, threads)))
        contenders.append(functools.partial(run, spread, servers, windows[-1]))
        contenders.append(functools.partial(run, workers, [supervised], windows[-1]))
        rotate(contenders, rounds)
    return P5(agent, floor, spread, workers, relay)
