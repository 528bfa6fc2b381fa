"""Mutated and crafted bundles never crash the reader or the reducer, nor are taken for CLEAN.

Mutations damage a real bundle's bytes; crafted bundles have every frame intact (right CRC and
seq) around hostile content. `make test` runs a fast slice; `make fuzz` sets FUZZ_ITERATIONS,
FUZZ_HOSTILE_ITERATIONS and FUZZ_CLI_SAMPLES for the long run.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from tests.commands import run_each
from trace_reducer import (
    REWARDS_FILE_NAME,
    BundleError,
    FrameDecoder,
    RecordOutOfRangeError,
    Reducer,
    ReductionError,
    decode_varint,
    encode_record,
    export_rl,
    replay_bundle,
    state_to_json,
)

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


def _reduce_bytes(data: bytes, rng: random.Random, *, bulk: bool = True) -> state_pb2.RolloutTrace:
    """The state of data fed in random chunks: as replay reads it (delta runs in bulk), or
    frame by frame and one record at a time (the reference)."""
    decoder = FrameDecoder(bulk=bulk)
    reducer = Reducer()
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 4096)
        if bulk:
            reducer.apply_many(decoder.feed_batch(data[pos : pos + step]))
        else:
            for record in decoder.feed(data[pos : pos + step]):
                reducer.apply(record)
        pos += step
    reducer.set_integrity(decoder.finish())
    return reducer.state()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("fuzz")
    # Replies long enough that their deltas are read as runs (trace_reducer.bundle._bulk).
    bundle = write_conversation(root, Shape(turns=3, deltas_per_turn=30))
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
            state = _reduce_bytes(data, rng, bulk=False)
        except ReductionError as error:
            # A contradiction is reported, by design, as a clear failure naming the seq.
            outcomes["contradiction"] = outcomes.get("contradiction", 0) + 1
            message = str(error)
            with pytest.raises(ReductionError, match=re.escape(message)):
                _reduce_bytes(data, rng)
            continue
        # However the bytes arrive, and whether runs of deltas are read in bulk or not, the
        # answer is the same.
        assert _reduce_bytes(data, rng) == state, (mutation.__name__, iteration)
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
    runs: list[tuple[str, list[str]]] = []
    for sample in range(CLI_SAMPLES):
        mutation = MUTATIONS[sample % len(MUTATIONS)]
        bundle = tmp_path / f"bundle-{sample}"
        bundle.mkdir()
        (bundle / "trace.binpb").write_bytes(mutation(rng, pristine, bounds))
        runs += [
            (mutation.__name__, args) for args in (["reduce", str(bundle)], ["dump", str(bundle)])
        ]
    results = run_each([[sys.executable, "-m", "trace_reducer.cli", *args] for _, args in runs])
    for (name, args), done in zip(runs, results, strict=True):
        assert "Traceback" not in done.stderr + done.stdout, (name, args)
        assert done.returncode in {0, 1, 2}, (name, args, done.stderr)


# -- crafted bundles: every frame intact (right CRC, right seq), the content hostile -------------

HOSTILE_ITERATIONS = int(os.environ.get("FUZZ_HOSTILE_ITERATIONS", "300"))

_STRINGS = [
    "",
    "x",
    "thread-1",
    "\ufffd",
    "\U0001f600",
    "a" * 300,
    "\u202e",
    "null",
    "\x00",
]
_JSON_TEXTS = [
    b'"\\udc00"',
    b'"\\ud800\\udc00"',
    b'"\\uDBFF"',
    b"\xed\xb0\x80",
    b"\xff\xfe",
    b"[" * 3000 + b"]" * 3000,
    b"{" * 3000,
    b'{"a":' * 250 + b"1" + b"}" * 250,
    b"1e999999",
    b"-0",
    b'"' + b"x" * 5000 + b'"',
    b"[]",
    b"null",
]


def _hostile_string(rng: random.Random) -> str:
    return rng.choice(_STRINGS) if rng.random() < 0.8 else rng.randbytes(8).hex()


def _hostile_payload(rng: random.Random) -> bytes:
    shape = rng.randrange(4)
    text = rng.choice(_JSON_TEXTS)
    if shape == 0:
        return text
    if shape == 1:
        return b'{"type":"message","role":"user","content":' + text + b"}"
    if shape == 2:
        return (
            b'{"type":"message","role":"assistant","id":' + text + b',"content":[{"type":'
            b'"output_text","text":' + text + b"}]}"
        )
    return rng.randbytes(rng.randrange(64))


def _status(rng: random.Random) -> common_pb2.ExecutionStatus.ValueType:
    return common_pb2.ExecutionStatus.ValueType(rng.randrange(7))


def _small(rng: random.Random) -> int:
    return rng.choice([0, 1, 1, 1, 2, 3, 2**31 - 1, 2**32 - 1])


def _hostile_record(rng: random.Random, pids: list[str]) -> record_pb2.TraceRecord:
    """One record a careless or hostile writer could produce; ids and ordinals may be wild."""
    # The newer bodies (tools, forks, tokens) in a share that still lets some bundles reduce.
    kind = rng.randrange(12) if rng.random() < 0.8 else rng.randrange(12, 19)
    record = record_pb2.TraceRecord(time_us=rng.choice([0, 1, 10**6, 2**40, 2**63, 2**64 - 1]))
    pid = rng.choice(pids) if pids and rng.random() < 0.8 else _hostile_string(rng)
    if kind == 0:
        count = rng.choice([0, 1, 2, 3, 2**28, 2**32 - 1])
        record.payload.CopyFrom(
            record_pb2.Payload(
                payload_id=_hostile_string(rng) if rng.random() < 0.2 else rng.randbytes(4).hex(),
                kind=record_pb2.PayloadKind.ValueType(rng.randrange(6)),
                data=_hostile_payload(rng),
                chunk_index=rng.choice([0, 1, 2, 2**32 - 1]),
                chunk_count=count,
            )
        )
    elif kind == 1:
        record.thread_started.CopyFrom(
            record_pb2.ThreadStarted(
                thread=_small(rng), thread_id=_hostile_string(rng), model=_hostile_string(rng)
            )
        )
    elif kind == 2:
        record.turn_started.CopyFrom(
            record_pb2.TurnStarted(
                turn=_small(rng),
                thread=_small(rng),
                turn_id=_hostile_string(rng),
                input_payload_ids=[pid] * rng.randrange(3),
            )
        )
    elif kind == 3:
        record.inference_started.CopyFrom(
            record_pb2.InferenceStarted(
                call=_small(rng),
                turn=_small(rng),
                inference_call_id=_hostile_string(rng),
                request_envelope_payload_id=pid,
                input_payload_ids=[pid] * rng.randrange(3),
                input_prefix_count=_small(rng),
            )
        )
    elif kind == 4:
        record.output_item_added.CopyFrom(
            record_pb2.OutputItemAdded(
                call=_small(rng), item=_small(rng), provider_item_id=_hostile_string(rng)
            )
        )
    elif kind == 5:
        record.output_text_delta.CopyFrom(
            record_pb2.OutputTextDelta(
                call=_small(rng), item=rng.choice([0, 0, 1, 2]), delta=_hostile_string(rng)
            )
        )
    elif kind == 6:
        record.output_item_done.CopyFrom(
            record_pb2.OutputItemDone(
                call=_small(rng),
                item=rng.choice([0, 1, 2]),
                item_id=_hostile_string(rng),
                item_payload_id=pid if rng.random() < 0.8 else "",
            )
        )
    elif kind == 7:
        record.inference_ended.CopyFrom(
            record_pb2.InferenceEnded(call=_small(rng), status=_status(rng))
        )
    elif kind == 8:
        record.turn_ended.CopyFrom(record_pb2.TurnEnded(turn=_small(rng), status=_status(rng)))
    elif kind == 9:
        record.thread_ended.CopyFrom(
            record_pb2.ThreadEnded(thread=_small(rng), status=_status(rng))
        )
    elif kind == 10:
        record.interrupt_requested.CopyFrom(
            record_pb2.InterruptRequested(turn=_small(rng), requested_by=_hostile_string(rng))
        )
    elif kind == 11:
        record.response_created.CopyFrom(
            record_pb2.ResponseCreated(call=_small(rng), response_id=_hostile_string(rng))
        )
    else:
        _hostile_newer_record(rng, record, kind, pid)
    return record


_FLOATS = [0.0, -0.5, -1e-45, -3.4e38, float("nan"), float("inf"), float("-inf"), 1e30]
_COUNTS = [0, 1, 5, 2**31, 2**63 - 1, 2**63, 2**64 - 1]


def _hostile_tokens(rng: random.Random) -> common_pb2.DeltaTokens:
    count = rng.randrange(4)
    return common_pb2.DeltaTokens(
        ids=[rng.choice([0, 7, 2**32 - 1]) for _ in range(rng.choice([0, count, count + 1]))],
        logprobs=[rng.choice(_FLOATS) for _ in range(rng.choice([0, count, count + 2]))],
        text_lengths=[rng.choice([0, 1, 3, 2**32 - 1]) for _ in range(rng.choice([0, count]))],
        texts=[_hostile_string(rng) for _ in range(rng.choice([0, count]))],
        top_counts=[rng.choice([0, 1, 2**31]) for _ in range(rng.choice([0, count]))],
        top_texts=[_hostile_string(rng) for _ in range(rng.randrange(3))],
        top_logprobs=[rng.choice(_FLOATS) for _ in range(rng.randrange(3))],
        top_ids=[rng.choice([0, 9]) for _ in range(rng.randrange(3))],
    )


def _hostile_newer_record(
    rng: random.Random, record: record_pb2.TraceRecord, kind: int, pid: str
) -> None:
    """The bodies added with tools, forks and tokens, as wild as the older ones."""
    if kind == 12:
        record.tool_call_started.CopyFrom(
            record_pb2.ToolCallStarted(
                tool_call=_small(rng),
                call=_small(rng),
                tool_call_id=_hostile_string(rng),
                call_id=_hostile_string(rng),
                name=_hostile_string(rng),
                item_id=_hostile_string(rng),
                arguments_payload_id=pid if rng.random() < 0.7 else "",
            )
        )
    elif kind == 13:
        record.tool_output_submitted.CopyFrom(
            record_pb2.ToolOutputSubmitted(
                tool_call=_small(rng),
                output_item_payload_id=pid if rng.random() < 0.8 else _hostile_string(rng),
                is_error=rng.random() < 0.5,
                submitted_by=_hostile_string(rng),
            )
        )
    elif kind == 14:
        record.tool_call_ended.CopyFrom(
            record_pb2.ToolCallEnded(
                tool_call=_small(rng),
                status=_status(rng),
                error=common_pb2.TraceError(code=_hostile_string(rng)),
                output_item_payload_id=pid if rng.random() < 0.5 else "",
            )
        )
    elif kind == 15:
        record.thread_forked.CopyFrom(
            record_pb2.ThreadForked(
                parent_thread_id=_hostile_string(rng),
                parent_bundle=rng.choice(["", "..", "/etc", "a/b", _hostile_string(rng)]),
                prefix_payload_ids=[pid] * rng.randrange(3),
                prefix_copied=rng.random() < 0.5,
                shared_turns=_small(rng),
                parent_call_id=_hostile_string(rng),
                parent_token_count=_small(rng),
            )
        )
    elif kind == 16:
        record.prompt_tokens.CopyFrom(
            record_pb2.PromptTokens(
                call=_small(rng),
                ids=[rng.choice([1, 2**32 - 1]) for _ in range(rng.randrange(4))],
                prefix_count=_small(rng),
                drift=common_pb2.TokenDrift.ValueType(rng.randrange(5)),
                held_count=_small(rng),
            )
        )
    elif kind == 17:
        record.output_text_delta.CopyFrom(
            record_pb2.OutputTextDelta(
                call=_small(rng),
                item=rng.choice([0, 1, 2]),
                delta=_hostile_string(rng),
                tokens=_hostile_tokens(rng),
            )
        )
    else:
        record.inference_ended.CopyFrom(
            record_pb2.InferenceEnded(
                call=_small(rng),
                status=_status(rng),
                usage=common_pb2.TokenUsage(
                    input_tokens=rng.choice(_COUNTS),
                    output_tokens=rng.choice(_COUNTS),
                    total_tokens=rng.choice(_COUNTS),
                ),
            )
        )


def hostile_bundle(rng: random.Random) -> bytes:
    """Frames with a right CRC and seq, from a header whose clock may be anywhere."""
    header = record_pb2.Header(format_version=rng.choice([1, 2, 2**32 - 1]), trace_id="t")
    header.created_at.seconds = rng.choice([0, 1_700_000_000, -62_135_596_800, 10**12, -(10**12)])
    header.created_at.nanos = rng.choice([0, 999_999_999, -1, 2**31 - 1])
    records = [record_pb2.TraceRecord(header=header)]
    pids: list[str] = []
    for _ in range(rng.randrange(1, 40)):
        record = _hostile_record(rng, pids)
        if record.HasField("payload"):
            pids.append(record.payload.payload_id)
        records.append(record)
    if rng.random() < 0.5:
        records.append(record_pb2.TraceRecord(footer=record_pb2.Footer()))
    frames = []
    for seq, record in enumerate(records, start=1):
        record.seq = seq
        if record.HasField("footer"):
            record.footer.record_count = seq
        frames.append(encode_record(record))
    return b"".join(frames)


def test_crafted_bundles_reduce_or_fail_cleanly() -> None:
    # A seed whose 300 bundles include some that reduce (most are refused, as they should be).
    rng = random.Random(3)
    outcomes: dict[str, int] = {}
    for _ in range(HOSTILE_ITERATIONS):
        data = hostile_bundle(rng)
        try:
            state = _reduce_bytes(data, rng)
            # What reduces can be written: JSON, every string valid UTF-8.
            state_to_json(state).encode("utf-8")
            assert _reduce_bytes(data, rng) == state
            outcome = state_pb2.IntegrityStatus.Name(state.integrity.status)
        except RecordOutOfRangeError:
            outcome = "out of range"
        except ReductionError:
            outcome = "contradiction"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert {"out of range", "contradiction"} <= set(outcomes), outcomes
    assert sum(count for name, count in outcomes.items() if name.startswith("INTEGRITY")), outcomes


def test_cli_never_prints_a_traceback_for_crafted_bundles(tmp_path: Path) -> None:
    rng = random.Random(11)
    runs: list[list[str]] = []
    for sample in range(CLI_SAMPLES):
        bundle = tmp_path / f"crafted-{sample}"
        bundle.mkdir()
        (bundle / "trace.binpb").write_bytes(hostile_bundle(rng))
        runs += [["reduce", str(bundle)], ["dump", str(bundle)], ["request", str(bundle), "x"]]
    results = run_each([[sys.executable, "-m", "trace_reducer.cli", *args] for args in runs])
    for args, done in zip(runs, results, strict=True):
        assert "Traceback" not in done.stderr + done.stdout, args
        assert "internal error" not in done.stderr, (args, done.stderr)
        assert done.returncode in {0, 1, 2}, (args, done.stderr)


SIDECAR_ITERATIONS = int(os.environ.get("FUZZ_SIDECAR_ITERATIONS", "30"))


def _hostile_reward(rng: random.Random) -> record_pb2.RewardRecorded:
    reward = record_pb2.RewardRecorded(
        thread_id=rng.choice(["thread-1", _hostile_string(rng)]),
        turn_id=_hostile_string(rng),
        item_id=_hostile_string(rng),
        name=_hostile_string(rng),
        value=rng.choice([*_FLOATS, 1.5e308, -1.7e308, 1.0]),
        weight=rng.choice([0.0, 1.0, -1.0, 1e308, float("nan"), float("inf")]),
        source=_hostile_string(rng),
        recorded_by=_hostile_string(rng),
    )
    reward.metadata[_hostile_string(rng)] = _hostile_string(rng)
    return reward


def _not_strict(name: str) -> None:
    pytest.fail(f"{name} in an exported file: not strict JSON")


def _strict_json_lines(directory: Path) -> int:
    lines = 0
    for path in directory.rglob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            json.loads(line, parse_constant=_not_strict)
            lines += 1
    return lines


def test_crafted_rewards_and_tokens_export_as_strict_json(pristine: bytes, tmp_path: Path) -> None:
    """Sidecars of wild rewards (NaN, infinities, means that overflow, hostile strings), framed
    right or mutated, beside a real bundle; and crafted bundles with tokens: each reduces and
    exports as strict JSON, or fails with a clean error."""
    rng = random.Random(13)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "trace.binpb").write_bytes(pristine)
    exported = 0
    for iteration in range(SIDECAR_ITERATIONS):
        header = record_pb2.Header(format_version=1, trace_id="t", thread_id="thread-1")
        records = [record_pb2.TraceRecord(header=header)]
        records += [
            record_pb2.TraceRecord(reward_recorded=_hostile_reward(rng))
            for _ in range(rng.randrange(1, 6))
        ]
        for seq, record in enumerate(records, start=1):
            record.seq = seq
        data = b"".join(encode_record(record) for record in records)
        if rng.random() < 0.3:
            data = rng.choice(MUTATIONS)(rng, data, _frame_bounds(data))
        (bundle / REWARDS_FILE_NAME).write_bytes(data)
        state = replay_bundle(bundle)
        state_to_json(state).encode("utf-8")
        export_rl([bundle], fmt="jsonl", out_dir=tmp_path / f"rl-{iteration}")
        exported += _strict_json_lines(tmp_path / f"rl-{iteration}")
        crafted = tmp_path / f"crafted-{iteration}"
        crafted.mkdir()
        (crafted / "trace.binpb").write_bytes(hostile_bundle(rng))
        try:
            export_rl([crafted], fmt="jsonl", out_dir=tmp_path / f"crafted-rl-{iteration}")
        except (BundleError, ReductionError):
            continue
        _strict_json_lines(tmp_path / f"crafted-rl-{iteration}")
    assert exported == SIDECAR_ITERATIONS
