"""B1-B3: `trace-reducer reduce-all` over thousands of small real bundles: pool vs Ray, Parquet."""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench._harness import agent_server_argv, run_thread, spawn, stubs

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
# Keeps the bench's Ray on loopback and quiet (see tests/batch/conftest.py).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}


async def _record(address: str, count: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    async with stubs(address, 4) as clients:

        async def one(index: int) -> None:
            async with gate:
                run = await run_thread(
                    clients[index % len(clients)],
                    [f"Rollout {index}: answer briefly."],
                    keep_text=False,
                )
                failures.extend(run.failures)

        await asyncio.gather(*(one(i) for i in range(count)))
    if failures:
        raise RuntimeError(f"{len(failures)} threads failed: {failures[:3]}")


def make_bundles(root: Path, count: int) -> float:
    """`count` one-turn threads through `agent-server serve` on its local model; seconds taken."""
    started = time.perf_counter()
    with spawn(agent_server_argv(trace_root=root, word_delay=0.0)) as server:
        asyncio.run(_record(server.address, count, concurrency=32))
    found = sum(1 for _ in root.glob("*/trace.binpb"))
    if found != count:
        raise RuntimeError(f"expected {count} bundles, found {found}")
    return time.perf_counter() - started


@dataclass
class Mode:
    name: str
    args: list[str]
    seconds: list[float] = field(default_factory=list)
    # CPU of the command's own process: the driver (its pool's workers are reaped by the
    # forkserver, so their CPU is not counted here).
    cpu_seconds: list[float] = field(default_factory=list)
    # What the summary says the workers spent per bundle (process CPU time, pool or Ray).
    worker_cpu_ms: list[float] = field(default_factory=list)

    def rate(self, bundles: int, pick: str = "median") -> float:
        chosen = {
            "min": max(self.seconds),
            "median": statistics.median(self.seconds),
            "max": min(self.seconds),
        }[pick]
        return bundles / chosen

    def rates(self, bundles: int) -> str:
        return (
            f"{self.rate(bundles):,.0f} bundles/s "
            f"(min {self.rate(bundles, 'min'):,.0f}, max {self.rate(bundles, 'max'):,.0f})"
        )


@dataclass
class BatchResult:
    bundles: int
    record_seconds: float
    modes: dict[str, Mode]
    parquet_bytes: int
    trace_bytes: int
    state_bytes: int
    rounds: int


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(root: Path, args: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(
        [TRACE_REDUCER, "reduce-all", str(root), "--force", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"reduce-all {args} failed: {done.stdout}{done.stderr}")
    worker = re.search(r"worker CPU: ([\d.,]+) ms per bundle", done.stdout)
    if worker is None:
        raise RuntimeError(f"no worker CPU in the summary: {done.stdout}")
    return seconds, _children_cpu() - cpu, float(worker.group(1).replace(",", ""))


@contextmanager
def local_ray() -> Iterator[str]:
    """A local Ray with 2 CPUs in this process, for reduce-all to join by address."""
    os.environ.update(RAY_ENV)
    import ray

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _size(paths: Iterator[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def measure_batch(root: Path, bundles: int = 2000, rounds: int = 3) -> BatchResult:
    """reduce-all --force over `bundles` bundles, each mode once per round, in turn."""
    traces = root / "batch" / "traces"
    record_seconds = make_bundles(traces, bundles)
    tables = root / "batch" / "tables"
    with local_ray() as address:
        modes = {
            "jobs1": Mode("pool, --jobs 1", ["--jobs", "1", "--tables", str(tables)]),
            "jobs2": Mode("pool, --jobs 2", ["--jobs", "2", "--tables", str(tables)]),
            "jobs2-no-tables": Mode("pool, --jobs 2, no tables", ["--jobs", "2"]),
            "ray": Mode("Ray joined (2 CPUs)", ["--ray", address, "--tables", str(tables)]),
            "ray-bare": Mode(
                "Ray started by the command", ["--jobs", "2", "--ray", "--tables", str(tables)]
            ),
        }
        # Warm the page cache and every engine once before timing.
        _run(traces, modes["jobs2"].args, RAY_ENV)
        _run(traces, modes["ray"].args, RAY_ENV)
        order = list(modes)
        for round_ in range(rounds):
            for name in order if round_ % 2 == 0 else reversed(order):
                seconds, cpu, worker_ms = _run(traces, modes[name].args, RAY_ENV)
                modes[name].seconds.append(seconds)
                modes[name].cpu_seconds.append(cpu)
                modes[name].worker_cpu_ms.append(worker_ms)
    return BatchResult(
        bundles=bundles,
        record_seconds=record_seconds,
        modes=modes,
        parquet_bytes=_size(tables.rglob("*.parquet")),
        trace_bytes=_size(traces.glob("*/trace.binpb")),
        state_bytes=_size(traces.glob("*/state.json")),
        rounds=rounds,
    )
