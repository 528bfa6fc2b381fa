"""Mutated bundles never crash the reader or the reducer, and are never taken for CLEAN.

`make test` runs a fast slice; `make fuzz` sets FUZZ_ITERATIONS for the long run.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import state_pb2
from trace_reducer import FrameDecoder, Reducer, ReductionError, decode_varint

ITERATIONS = int(os.environ.get("FUZZ_ITERATIONS", "4000"))
CLI_SAMPLES = int(os.environ.get("FUZZ_CLI_SAMPLES", "12"))

Mutation = Callable[[random.Random, bytes, list[int]], bytes]


def _frame_bounds(data: bytes) -> list[int]:
    """Start offsets of every frame, plus the end of the file."""
    bounds = [0]
    while bounds[-1] < len(data):
        prefix = decode_varint(data, bounds[-1])
        assert prefix is not None
        size, start = prefix
        bounds.append(start + size)
    return bounds


def _truncate(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    return data[: rng.randrange(len(data))]


def _flip_bits(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    damaged = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
    return bytes(damaged)


def _duplicate_frame(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    index = rng.randrange(len(bounds) - 1)
    frame = data[bounds[index] : bounds[index + 1]]
    at = bounds[rng.randrange(len(bounds))]
    return data[:at] + frame + data[at:]


def _drop_frame(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    index = rng.randrange(len(bounds) - 1)
    return data[: bounds[index]] + data[bounds[index + 1] :]


def _swap_frames(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    a, b = sorted(rng.sample(range(len(bounds) - 1), 2))
    frames = [data[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    frames[a], frames[b] = frames[b], frames[a]
    return b"".join(frames)


def _splice_random_bytes(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    at = rng.randrange(len(data))
    noise = rng.randbytes(rng.randint(1, 64))
    return data[:at] + noise + data[at + rng.randint(0, 64) :]


def _random_bytes(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    return rng.randbytes(rng.randint(0, 512))


def _zero_tail(rng: random.Random, data: bytes, bounds: list[int]) -> bytes:
    return data[: bounds[rng.randrange(1, len(bounds))]] + bytes(rng.randint(1, 4096))


MUTATIONS: list[Mutation] = [
    _truncate,
    _flip_bits,
    _duplicate_frame,
    _drop_frame,
    _swap_frames,
    _splice_random_bytes,
    _random_bytes,
    _zero_tail,
]


def _reduce_bytes(data: bytes, rng: random.Random) -> state_pb2.RolloutTrace:
    decoder = FrameDecoder()
    reducer = Reducer()
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 4096)
        for record in decoder.feed(data[pos : pos + step]):
            reducer.apply(record)
        pos += step
    reducer.set_integrity(decoder.finish())
    return reducer.state()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("fuzz")
    bundle = write_conversation(root, Shape(turns=3, deltas_per_turn=6))
    return (bundle / "trace.binpb").read_bytes()


def test_pristine_bundle_is_clean(pristine: bytes) -> None:
    state = _reduce_bytes(pristine, random.Random(0))
    assert state.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert state.recording_complete


def test_mutations_never_crash_and_are_never_clean(pristine: bytes) -> None:
    rng = random.Random(20261129)
    bounds = _frame_bounds(pristine)
    outcomes: dict[str, int] = {}
    for iteration in range(ITERATIONS):
        mutation = MUTATIONS[iteration % len(MUTATIONS)]
        data = mutation(rng, pristine, bounds)
        if data == pristine:
            continue
        try:
            state = _reduce_bytes(data, rng)
        except ReductionError:
            # A contradiction is reported, by design, as a clear failure naming the seq.
            outcomes["contradiction"] = outcomes.get("contradiction", 0) + 1
            continue
        status = state_pb2.IntegrityStatus.Name(state.integrity.status)
        assert status != "INTEGRITY_STATUS_CLEAN", (mutation.__name__, iteration)
        assert not state.recording_complete
        outcomes[status] = outcomes.get(status, 0) + 1
    assert sum(outcomes.values()) > ITERATIONS * 0.9
    # Each way of ending must have been reached, or the mutations are not doing their job.
    assert {
        "INTEGRITY_STATUS_CORRUPT",
        "INTEGRITY_STATUS_TRUNCATED",
        "INTEGRITY_STATUS_UNCLOSED",
    } <= set(outcomes), outcomes


def test_cli_never_prints_a_traceback(pristine: bytes, tmp_path: Path) -> None:
    rng = random.Random(7)
    bounds = _frame_bounds(pristine)
    for sample in range(CLI_SAMPLES):
        mutation = MUTATIONS[sample % len(MUTATIONS)]
        bundle = tmp_path / f"bundle-{sample}"
        bundle.mkdir()
        (bundle / "trace.binpb").write_bytes(mutation(rng, pristine, bounds))
        for args in (["reduce", str(bundle)], ["dump", str(bundle)]):
            done = subprocess.run(
                [sys.executable, "-m", "trace_reducer.cli", *args],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )
            assert "Traceback" not in done.stderr + done.stdout, (mutation.__name__, args)
            assert done.returncode in {0, 1, 2}, (mutation.__name__, args, done.stderr)
