"""Hostile bundles (issue 9): what a crafted file claims never decides what the reducer spends."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2
from trace_reducer import BundleWriter, Reducer, ReductionError, read_bundle, replay_bundle
from trace_reducer._payloads import UNPARSED_PAYLOAD_BUDGET

from .bundles import BundleBuilder, user_item

MiB = 1024 * 1024
INPUT_ITEM = record_pb2.PAYLOAD_KIND_INPUT_ITEM


def peak_bytes(work: Callable[[], object]) -> int:
    """The peak of Python allocations while work runs."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


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
