"""P1 and P2: reducer throughput against the read+parse floor, and reducer peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.synthetic import Shape, write_conversation
from trace_reducer import read_bundle, replay_bundle


@dataclass(frozen=True)
class Throughput:
    records: int
    megabytes: float
    floor_seconds: float
    reduce_seconds: float

    @property
    def records_per_second(self) -> float:
        return self.records / self.reduce_seconds

    @property
    def ratio_to_floor(self) -> float:
        return self.reduce_seconds / self.floor_seconds


def _best_of(runs: int, work: object) -> float:
    assert callable(work)
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def measure_throughput(bundle: Path, runs: int = 3) -> Throughput:
    """Best-of-runs time of replay_bundle against merely reading and parsing every record."""
    count = 0

    def read_only() -> None:
        nonlocal count
        with read_bundle(bundle) as reader:
            count = sum(1 for _ in reader)

    floor = _best_of(runs, read_only)
    reduce = _best_of(runs, lambda: replay_bundle(bundle))
    size = (bundle / "trace.binpb").stat().st_size / 1e6
    return Throughput(count, size, floor, reduce)


def _peak_rss_child(bundle: Path) -> int:
    """Peak RSS growth (KiB) of a fresh interpreter while it reduces bundle.

    Linux resets the high-water mark when "5" is written to clear_refs, so imports and
    interpreter start-up do not count.
    """
    code = (
        "import sys, json\n"
        "from trace_reducer import replay_bundle\n"
        "def hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(('VmHWM', 'VmRSS')):\n"
        "            yield int(line.split()[1])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = max(hwm())\n"
        "replay_bundle(sys.argv[1])\n"
        "print(json.dumps([base, max(hwm())]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(bundle)], check=True, capture_output=True, text=True
    ).stdout
    base, peak = json.loads(out)
    return int(peak) - int(base)


def measure_memory(root: Path, turns: int, delta_counts: list[int]) -> list[tuple[int, int]]:
    """(records, extra peak KiB) for bundles of the same state size and more and more deltas.

    The state is held constant (same turns, same final text per item); only how finely the
    text is streamed changes.
    """
    results = []
    total_words = max(delta_counts)
    for deltas in delta_counts:
        words_per_delta = total_words // deltas
        shape = Shape(turns=turns, deltas_per_turn=deltas, words_per_delta=words_per_delta)
        bundle = write_conversation(root / f"mem-{deltas}", shape)
        with read_bundle(bundle) as reader:
            records = sum(1 for _ in reader)
        results.append((records, _peak_rss_child(bundle)))
    return results
