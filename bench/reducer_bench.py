"""P1, P2 and P6: reducer speed beside its floor and its peer, reducer memory, reduced-state size.

Every contender of P1 is timed in the same process in alternating rounds (the order rotating
each round), as CPU time of the process, so a neighbour's load shifts all of them alike.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.jsonl_peer import reduce_codex_jsonl, write_codex_jsonl
from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import record_pb2
from trace_reducer import TRACE_FILE_NAME, decode_varint, read_bundle, replay_bundle

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


@dataclass(frozen=True)
class Spread:
    """Seconds of several runs of one piece of work."""

    seconds: list[float]

    @property
    def low(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def high(self) -> float:
        return max(self.seconds)


def read_and_parse(trace_file: Path) -> int:
    """The floor: read the file, cut it into frames and ParseFromString each; nothing else."""
    parse = record_pb2.TraceRecord.FromString
    data = trace_file.read_bytes()
    pos = 0
    end = len(data)
    count = 0
    while pos < end:
        size = data[pos]
        if size < 0x80:
            start = pos + 1
        else:
            prefix = decode_varint(data, pos)
            assert prefix is not None
            size, start = prefix
        pos = start + size
        parse(data[start:pos])
        count += 1
    return count


def validating_read(bundle: Path) -> int:
    """What replay_bundle reads: frames with their CRC and seq checked, nothing reduced."""
    with read_bundle(bundle) as reader:
        for _ in reader.batches():
            pass
        return int(reader.integrity.records_read)


@dataclass(frozen=True)
class P1:
    records: int
    bundle_bytes: int
    jsonl_bytes: int
    jsonl_lines: int
    times: dict[str, Spread]


FLOOR = "read frames + ParseFromString"
VALIDATING = "validating read (CRC, seq)"
REPLAY = "replay_bundle"
PEER = "JSONL + orjson"


def measure_p1(root: Path, shape: Shape, rounds: int) -> P1:
    """Alternate the floor, the validating read, replay_bundle and the JSONL peer."""
    bundle = write_conversation(root / "p1", shape)
    trace_file = bundle / TRACE_FILE_NAME
    jsonl = root / "p1.jsonl"
    lines = write_codex_jsonl(bundle, jsonl)
    contenders: list[tuple[str, Callable[[], object]]] = [
        (FLOOR, lambda: read_and_parse(trace_file)),
        (VALIDATING, lambda: validating_read(bundle)),
        (REPLAY, lambda: replay_bundle(bundle)),
        (PEER, lambda: reduce_codex_jsonl(jsonl)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for round_number in range(rounds):
        shift = round_number % len(contenders)
        for name, work in contenders[shift:] + contenders[:shift]:
            gc.collect()
            started = time.process_time()
            work()
            times[name].append(time.process_time() - started)
    return P1(
        records=read_and_parse(trace_file),
        bundle_bytes=trace_file.stat().st_size,
        jsonl_bytes=jsonl.stat().st_size,
        jsonl_lines=lines,
        times={name: Spread(seconds) for name, seconds in times.items()},
    )


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


def peak_rss_of_command(argv: list[str]) -> int:
    """Peak RSS (KiB) of a command run in a fresh child, start-up included."""
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], check=True, capture_output=True, text=True
    ).stdout
    return int(out)
