"""Hostile bundles (issue 9): what a crafted file claims never decides what the reducer spends."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import (
    BundleWriter,
    FrameDecoder,
    RecordOutOfRangeError,
    Reducer,
    ReductionError,
    cli,
    encode_record,
    read_bundle,
    replay_bundle,
    state_to_json,
)
from trace_reducer.bundle._payloads import UNPARSED_PAYLOAD_BUDGET

from .bundles import BundleBuilder, one_turn_bundle, user_item
from .process import peak_bytes, read_bytes_of_process

MiB = 1024 * 1024


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trace_reducer.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


INPUT_ITEM = record_pb2.PAYLOAD_KIND_INPUT_ITEM


@pytest.mark.parametrize("claimed", [2**28, 2**32 - 1])
def test_a_claimed_chunk_count_allocates_nothing(tmp_path: Path, claimed: int) -> None:
    # The smallest bundle that says it: a header, then one chunk of a payload of `claimed`.
    writer = BundleWriter.create(tmp_path, "thread-1")
    writer.append(
        record_pb2.TraceRecord(
            payload=record_pb2.Payload(
                payload_id="p" * 32, kind=INPUT_ITEM, data=b"{}", chunk_count=claimed
            )
        )
    )
    writer.abandon()
    assert writer.file_path.stat().st_size < 256
    peak = peak_bytes(lambda: replay_bundle(writer.bundle_dir))
    assert peak < 4 * MiB


def test_chunks_that_do_not_fit_together_are_refused(tmp_path: Path) -> None:
    def chunk(index: int, count: int) -> record_pb2.Payload:
        return record_pb2.Payload(
            payload_id="c" * 32, kind=INPUT_ITEM, data=b"{", chunk_index=index, chunk_count=count
        )

    cases = {
        "index past the count": [chunk(5, 2)],
        "counts that differ": [chunk(0, 3), chunk(1, 2)],
        "a repeated chunk": [chunk(0, 3), chunk(0, 3)],
    }
    for name, chunks in cases.items():
        builder = BundleBuilder(tmp_path / name.replace(" ", "-"))
        seqs = [builder.append(payload=payload) for payload in chunks]
        bundle = builder.close()
        with pytest.raises(ReductionError) as raised:
            replay_bundle(bundle)
        assert str(raised.value).startswith(f"seq {seqs[-1]}: "), name


def test_a_chunked_payload_is_usable_once_complete_in_any_order(tmp_path: Path) -> None:
    builder = BundleBuilder(tmp_path)
    data = b'{"content":"in three pieces","role":"user","type":"message"}'
    pieces = [data[:10], data[10:30], data[30:]]
    pid = "d" * 32
    for index in (2, 0, 1):
        builder.append(
            payload=record_pb2.Payload(
                payload_id=pid,
                kind=INPUT_ITEM,
                data=pieces[index],
                chunk_index=index,
                chunk_count=3,
            )
        )
    builder.append(
        turn_started=record_pb2.TurnStarted(
            turn=1, thread=builder.thread, turn_id="turn-1", input_payload_ids=[pid]
        )
    )
    trace = replay_bundle(builder.close())
    [item] = trace.conversation_items.values()
    assert item.content[0].text == "in three pieces"


def test_unreferenced_payloads_are_not_kept(tmp_path: Path) -> None:
    # 96 MiB of payloads nothing refers to, then a conversation.
    builder = BundleBuilder(tmp_path)
    for index in range(24):
        builder.writer.put_payload(bytes([index]) * (4 * MiB - 8192), INPUT_ITEM)
    builder.turn("turn-1", [user_item("still reduced")])
    bundle = builder.close()

    def reduce() -> None:
        reducer = Reducer()
        with read_bundle(bundle) as reader:
            for batch in reader.batches():
                reducer.apply_many(batch)
        assert reducer.state().conversation_items

    # What is kept unparsed has a fixed budget; the file's size does not matter.
    assert peak_bytes(reduce) < UNPARSED_PAYLOAD_BUDGET + 24 * MiB


def test_a_large_frame_fed_in_small_chunks_costs_its_size_not_its_square(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "thread-1")
    writer.put_payload(b"x" * (4 * MiB - 8192), INPUT_ITEM)
    writer.abandon()
    data = writer.file_path.read_bytes()
    decoder = FrameDecoder()
    records = 0
    # What each feed allocates at its peak, summed: re-copying the partial frame on every
    # feed makes this grow with the square of the frame's size (32 GiB here).
    traffic = 0
    tracemalloc.start()
    try:
        for start in range(0, len(data), 256):
            piece = data[start : start + 256]
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            records += len(decoder.feed(piece))
            traffic += tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert records == 2
    assert decoder.finish().status == state_pb2.INTEGRITY_STATUS_UNCLOSED
    assert traffic < 16 * len(data)


def test_reading_stops_at_the_first_bad_frame(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    trace_file = bundle / "trace.binpb"
    data = bytearray(trace_file.read_bytes())
    data[40] ^= 0x01
    trace_file.write_bytes(data)
    with trace_file.open("ab") as grown:
        grown.truncate(len(data) + 2 * 1024 * MiB)  # sparse: 2 GiB of zeros after the damage
    before = read_bytes_of_process()
    with read_bundle(bundle) as reader:
        records = sum(1 for _ in reader)
        integrity = reader.integrity
    assert read_bytes_of_process() - before < 8 * MiB
    assert integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT
    assert records == integrity.records_read


def sparse_non_bundle(directory: Path) -> Path:
    """A directory whose trace.binpb is 2 GiB of (sparse) zeros, as a botched copy leaves it."""
    directory.mkdir()
    with (directory / "trace.binpb").open("wb") as zeros:
        zeros.truncate(2 * 1024 * MiB)
    return directory


def test_cli_refuses_a_2_gib_non_bundle_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = sparse_non_bundle(tmp_path / "zeros")
    for command in ("reduce", "dump"):
        before = read_bytes_of_process()
        assert cli.main([command, str(bundle)]) == cli.EXIT_USAGE
        assert read_bytes_of_process() - before < 8 * MiB, command
        err = capsys.readouterr().err
        assert err.startswith(f"trace-reducer: not a trace bundle (no header record): {bundle}")
        assert len(err.splitlines()) == 1


def bundle_with_input(root: Path, payload: bytes) -> Path:
    """One turn whose only input item is `payload`, as bytes, whatever they hold."""
    builder = BundleBuilder(root)
    pid = builder.writer.put_payload(payload, INPUT_ITEM)
    builder.append(
        turn_started=record_pb2.TurnStarted(
            turn=1, thread=builder.thread, turn_id="turn-1", input_payload_ids=[pid]
        )
    )
    return builder.close()


def deeply_nested(depth: int) -> bytes:
    nested = b"[" * depth + b"]" * depth
    return b'{"content":' + nested + b',"role":"user","type":"message"}'


@pytest.mark.parametrize("depth", [300, 5_000, 100_000])
def test_a_deeply_nested_item_reduces_as_an_opaque_item(tmp_path: Path, depth: int) -> None:
    bundle = bundle_with_input(tmp_path, deeply_nested(depth))
    trace = replay_bundle(bundle)
    [item] = trace.conversation_items.values()
    assert item.kind == state_pb2.ITEM_KIND_OTHER
    assert list(item.content) == []
    assert item.payload_id
    assert state_to_json(trace)


def test_a_nested_item_within_the_limit_is_read(tmp_path: Path) -> None:
    content = "[" * 50 + '{"type": "input_text", "text": "deep"}' + "]" * 50
    payload = f'{{"content": [{content}], "role": "user", "type": "message"}}'.encode()
    [item] = replay_bundle(bundle_with_input(tmp_path, payload)).conversation_items.values()
    assert item.kind == state_pb2.ITEM_KIND_MESSAGE


@pytest.mark.parametrize(
    "text",
    [
        b"lone \\udc00 low",
        b"lone \\uD800 high",
        b"high at the end \\ud83d",
        b"encoded \xed\xb0\x80 surrogate",
        b"pair \\ud83d\\ude00 stays",
    ],
)
def test_lone_surrogates_become_replacement_characters(tmp_path: Path, text: bytes) -> None:
    payload = (
        b'{"content":[{"text":"' + text + b'","type":"input_text"}],"id":"in-\\udc01",'
        b'"role":"user","type":"message"}'
    )
    trace = replay_bundle(bundle_with_input(tmp_path, payload))
    [item] = trace.conversation_items.values()
    got = item.content[0].text
    if b"pair" in text:
        assert got == "pair \U0001f600 stays"
    else:
        assert "\ufffd" in got
        assert not any("\ud800" <= char <= "\udfff" for char in got)
    assert item.responses_item_id == "in-\ufffd"
    state_to_json(trace).encode("utf-8")  # strict: would raise on a surrogate


def bundle_created_at(root: Path, seconds: int, *, time_us: int = 0) -> Path:
    """A bundle whose header says it was created `seconds` after the epoch."""
    writer = BundleWriter.create(root, "thread-1")
    writer.abandon()
    header = record_pb2.Header(format_version=1, trace_id="t", thread_id="thread-1")
    header.created_at.seconds = seconds
    records = [record_pb2.TraceRecord(seq=1, header=header)]
    if time_us:
        started = record_pb2.ThreadStarted(thread=1, thread_id="thread-1", model="m")
        records.append(record_pb2.TraceRecord(seq=2, time_us=time_us, thread_started=started))
    writer.file_path.write_bytes(b"".join(encode_record(record) for record in records))
    return writer.bundle_dir


YEAR_33658 = 1_000_000_000_000


@pytest.mark.parametrize(
    ("seconds", "time_us", "seq"),
    [(YEAR_33658, 0, 1), (-(10**12), 0, 1), (1_700_000_000, 2**63, 2)],
)
def test_times_past_what_a_timestamp_holds_fail_the_reduction(
    tmp_path: Path, seconds: int, time_us: int, seq: int
) -> None:
    with pytest.raises(RecordOutOfRangeError) as raised:
        replay_bundle(bundle_created_at(tmp_path, seconds, time_us=time_us))
    assert str(raised.value).startswith(f"seq {seq}: ")
    assert "9999" in str(raised.value)


def crafted_bundles(root: Path) -> dict[str, Path]:
    """The crafted bundles of issue 9 item 11, by what is wrong with them."""
    surrogate = b'{"content":"a \\udc00 b","role":"user","type":"message"}'
    return {
        "deep": bundle_with_input(root / "deep", deeply_nested(5_000)),
        "surrogate": bundle_with_input(root / "surrogate", surrogate),
        "year-33658": bundle_created_at(root / "year", YEAR_33658),
    }


def test_crafted_bundles_through_the_cli(tmp_path: Path) -> None:
    bundles = crafted_bundles(tmp_path)
    for name in ("deep", "surrogate"):
        done = run_cli("reduce", bundles[name], "--stdout")
        assert done.returncode == 0, (name, done.stderr)
        assert done.stderr == ""
        assert json.loads(done.stdout)["recording_complete"]
        assert run_cli("dump", bundles[name]).returncode == 0
    done = run_cli("reduce", bundles["year-33658"])
    assert done.returncode == 1
    assert done.stderr.startswith("trace-reducer: record out of range: seq 1: ")
    assert len(done.stderr.splitlines()) == 1
    assert not (bundles["year-33658"] / "state.json").exists()


def test_a_request_with_a_lone_surrogate_prints_as_json(tmp_path: Path) -> None:
    builder = BundleBuilder(tmp_path)
    turn = builder.turn("turn-1", [user_item("plain")])
    pid = builder.writer.put_payload(
        b'{"content":"a \\udc00 b","role":"user","type":"message"}', INPUT_ITEM
    )
    envelope = builder.writer.put_payload(
        b'{"model":"m"}', record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE
    )
    builder.append(
        inference_started=record_pb2.InferenceStarted(
            call=1,
            turn=turn,
            inference_call_id="call-1",
            request_envelope_payload_id=envelope,
            input_payload_ids=[pid],
        )
    )
    bundle = builder.close()
    for flags in ([], ["--pretty"]):
        done = run_cli("request", bundle, "call-1", *flags)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["input"][0]["content"] == "a \udc00 b"


def test_a_call_whose_request_nests_past_what_json_reads_is_shown_everywhere(
    tmp_path: Path,
) -> None:
    # Was: `internal error: RecursionError` from `reduce`, `list`, `view`, `view ROOT -o` and
    # `export-otlp` (the reducer read the envelope's sampling settings, the page and the spans
    # its body, with json, which recurses).
    builder = BundleBuilder(tmp_path / "root")
    turn = builder.turn("turn-1", [user_item("hi")])
    nested = b"[" * 100_000 + b"]" * 100_000
    envelope = builder.writer.put_payload(
        b'{"model":"m","tools":' + nested + b"}", record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE
    )
    item = builder.writer.put_payload(deeply_nested(100_000), INPUT_ITEM)
    builder.append(
        inference_started=record_pb2.InferenceStarted(
            turn=turn,
            call=5,
            inference_call_id="call-1",
            attempt=1,
            model="m",
            request_envelope_payload_id=envelope,
            input_payload_ids=[item],
        )
    )
    bundle = builder.close()
    assert replay_bundle(bundle).inference_calls["call-1"].model == "m"
    runs: list[list[str | Path]] = [
        ["reduce", bundle, "--stdout"],
        ["list", tmp_path / "root"],
        ["view", bundle, "-o", tmp_path / "page.html"],
        ["view", tmp_path / "root", "-o", tmp_path / "site"],
        ["export-rl", bundle, "--format", "jsonl", "--out", tmp_path / "rl"],
    ]
    for args in runs:
        done = run_cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert "internal error" not in done.stderr, args
    # The spans are made; only the receiver is missing.
    done = run_cli("export-otlp", bundle, "--include-content", "--endpoint", "http://127.0.0.1:9")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("trace-reducer: could not export spans"), done.stderr
