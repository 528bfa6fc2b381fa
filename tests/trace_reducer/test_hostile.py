"""Hostile bundles (issue 9): what a crafted file claims never decides what the reducer spends."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import (
    BundleWriter,
    FrameDecoder,
    Reducer,
    ReductionError,
    cli,
    read_bundle,
    replay_bundle,
)
from trace_reducer._payloads import UNPARSED_PAYLOAD_BUDGET

from .bundles import BundleBuilder, one_turn_bundle, user_item
from .process import peak_bytes, read_bytes_of_process

MiB = 1024 * 1024
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
        records = sum(len(batch) for batch in reader.batches())
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
