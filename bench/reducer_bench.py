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
from unittest import mock

from bench.jsonl_peer import reduce_codex_jsonl, write_codex_jsonl
from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import (
    TRACE_FILE_NAME,
    decode_varint,
    iter_state_json,
    read_bundle,
    replay_bundle,
    state_to_json,
)
from trace_reducer.bundle import _reader, _scan

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


# The first byte of the output_text_delta body's tag: field 11, length-delimited.
_DELTA_TAG = (11 << 3) | 2


def _read_frames(trace_file: Path, *, parse: bool) -> int:
    """Read the file and cut it into frames; then ParseFromString each (how many records), or
    only look at each one's body tag, after its seq and time_us fields (how many deltas)."""
    parse_record = record_pb2.TraceRecord.FromString
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
        if parse:
            parse_record(data[start:pos])
            count += 1
            continue
        # seq (field 1, varint) is always there; time_us (field 2) unless it is 0.
        at = start + 1
        while data[at] & 0x80:
            at += 1
        at += 1
        if data[at] == 0x10:
            at += 1
            while data[at] & 0x80:
                at += 1
            at += 1
        if data[at] == _DELTA_TAG:
            count += 1
    return count


def read_and_parse(trace_file: Path) -> int:
    """The floor: read the file, cut it into frames and ParseFromString each; nothing else."""
    return _read_frames(trace_file, parse=True)


def read_split_tag(trace_file: Path) -> int:
    """The tag floor: read, cut into frames, look at each body tag; how many are deltas."""
    return _read_frames(trace_file, parse=False)


def read_split_tag_c(trace_file: Path) -> int:
    """The C tag floor: read, and the C scanner's bare walk over the frames, each body tag
    looked at (no CRC, no seq, nothing built); how many are deltas."""
    return _scan.count_deltas(trace_file.read_bytes())


def replay_in_python(bundle: Path) -> object:
    """replay_bundle with the frames read by the Python bulk path (where _scan is not built)."""
    with mock.patch.object(_reader, "_scan", None):
        return replay_bundle(bundle)


def validating_read(bundle: Path) -> int:
    """What replay_bundle reads: frames with their CRC and seq checked, nothing reduced."""
    with read_bundle(bundle) as reader:
        for _ in reader.batches():
            pass
        return int(reader.integrity.records_read)


class CompleteRequests:
    """The complete form's own floor: every inference call's whole request (its item ids and
    input payload ids, as `replay_bundle` gives them) copied into a state's call, nothing else.

    The complete form is the compact one with these lists copied in; copying a list of strings
    into a protobuf message costs a string each, where a peer holding Python lists slices
    references. The lists, and one fresh state with its calls for each copy() (`copies` of
    them), are made beforehand: each copy fills new memory, as a replay's expansion does."""

    def __init__(self, bundle: Path, copies: int) -> None:
        self.requests: list[state_pb2.InferenceCall] = []
        for call in replay_bundle(bundle).inference_calls.values():
            request = state_pb2.InferenceCall()
            request.request_item_ids.extend(call.request_item_ids)
            request.input_payload_ids.extend(call.input_payload_ids)
            self.requests.append(request)
        self._targets = [self._fresh_calls() for _ in range(copies)]
        self.state = state_pb2.RolloutTrace()

    def _fresh_calls(self) -> tuple[state_pb2.RolloutTrace, list[state_pb2.InferenceCall]]:
        state = state_pb2.RolloutTrace()
        return state, [state.inference_calls[str(n)] for n in range(len(self.requests))]

    def copy(self) -> int:
        """Copy every request into the next fresh state (kept as `state`); how many calls."""
        self.state, calls = self._targets.pop()
        for call, request in zip(calls, self.requests, strict=True):
            call.CopyFrom(request)
        return len(calls)


@dataclass(frozen=True)
class P1:
    records: int
    bundle_bytes: int
    jsonl_bytes: int
    jsonl_lines: int
    times: dict[str, Spread]


FLOOR = "read frames + ParseFromString"
TAG_FLOOR = "read frames + look at each tag"
C_TAG_FLOOR = "read + C walk over the frames, each tag looked at"
PYTHON_READER = "replay_bundle, frames read in Python"
VALIDATING = "validating read (CRC, seq)"
REPLAY = "replay_bundle"
COMPACT = "replay_bundle(compact=True)"
PEER = "JSONL + orjson"
LAZY_PEER = "JSONL + orjson, delta lines skipped"
COPY_FLOOR = "the complete form's requests copied"


LARGE = Shape(turns=1000, deltas_per_turn=1000)


def large_bundle(root: Path) -> Path:
    """The >= 1,000,000-record bundle of P1 and P6, written once per run of the bench."""
    home = root / "large"
    existing = sorted(home.glob("*")) if home.is_dir() else []
    return existing[0] if existing else write_conversation(home, LARGE)


def measure_p1(bundle: Path, jsonl: Path, rounds: int) -> P1:
    """Alternate the floors, the validating read, replay_bundle and the JSONL peers on one
    bundle (its JSONL twin written to `jsonl`)."""
    trace_file = bundle / TRACE_FILE_NAME
    lines = write_codex_jsonl(bundle, jsonl)
    requests = CompleteRequests(bundle, copies=rounds)
    contenders: list[tuple[str, Callable[[], object]]] = [
        (FLOOR, lambda: read_and_parse(trace_file)),
        (TAG_FLOOR, lambda: read_split_tag(trace_file)),
        (C_TAG_FLOOR, lambda: read_split_tag_c(trace_file)),
        (VALIDATING, lambda: validating_read(bundle)),
        (REPLAY, lambda: replay_bundle(bundle)),
        (COMPACT, lambda: replay_bundle(bundle, compact=True)),
        (PYTHON_READER, lambda: replay_in_python(bundle)),
        (PEER, lambda: reduce_codex_jsonl(jsonl)),
        (LAZY_PEER, lambda: reduce_codex_jsonl(jsonl, lazy=True)),
        (COPY_FLOOR, requests.copy),
    ]
    eager, lazy = reduce_codex_jsonl(jsonl), reduce_codex_jsonl(jsonl, lazy=True)
    if eager != lazy:
        raise AssertionError("the lazy peer's answer differs from the eager peer's")
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


@dataclass(frozen=True)
class StateGrowth:
    turns: tuple[int, int]
    compact_bytes: tuple[int, int]
    complete_bytes: tuple[int, int]

    def per_turn_growth(self, sizes: tuple[int, int]) -> float:
        small, large = self.turns
        return (sizes[1] / large) / (sizes[0] / small)


def measure_state_growth(root: Path, turns: tuple[int, int] = (100, 1000)) -> StateGrowth:
    """state.json bytes of the same conversation at two lengths, compact and complete."""
    compact: list[int] = []
    complete: list[int] = []
    for count in turns:
        bundle = write_conversation(root / f"growth-{count}", Shape(count, deltas_per_turn=10))
        state = replay_bundle(bundle, compact=True)
        compact.append(len(state_to_json(state).encode()))
        complete.append(sum(len(piece.encode()) for piece in iter_state_json(state, expand=True)))
    return StateGrowth(turns, (compact[0], compact[1]), (complete[0], complete[1]))


@dataclass(frozen=True)
class ReduceCost:
    peak_kib: int
    output_bytes: int


def measure_reduce_command(root: Path, *, compact: bool) -> ReduceCost:
    """`trace-reducer reduce` of the large bundle: its peak RSS and the size of what it wrote."""
    bundle = large_bundle(root)
    out = root / ("compact.json" if compact else "complete.json")
    argv = [TRACE_REDUCER, "reduce", str(bundle), "-o", str(out)]
    peak = peak_rss_of_command([*argv, "--compact"] if compact else argv)
    return ReduceCost(peak, out.stat().st_size)
