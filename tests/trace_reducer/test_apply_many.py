"""Reducer.apply_many (replay's loop, deltas inline) is apply() record by record, in every case."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2, state_pb2
from tests.trace_reducer.bundles import (
    COMPLETED,
    BundleBuilder,
    as_input,
    assistant_output,
    user_item,
)
from trace_reducer import Reducer, ReductionError, read_bundle


def records_of(bundle: Path) -> list[record_pb2.TraceRecord]:
    with read_bundle(bundle) as reader:
        return list(reader)


def one_by_one(records: list[record_pb2.TraceRecord]) -> tuple[state_pb2.RolloutTrace, str]:
    reducer = Reducer()
    error = ""
    try:
        for record in records:
            reducer.apply(record)
    except ReductionError as raised:
        error = str(raised)
    return reducer.state(), error


def all_at_once(records: list[record_pb2.TraceRecord]) -> tuple[state_pb2.RolloutTrace, str]:
    reducer = Reducer()
    error = ""
    try:
        reducer.apply_many(records)
    except ReductionError as raised:
        error = str(raised)
    return reducer.state(), error


def streaming_bundle(root: Path, *, deltas: int) -> Path:
    """Two turns, the first item streamed in many deltas, one delta naming its item, one item
    left unfinished (deltas after it was replaced as the latest)."""
    bundle = BundleBuilder(root)
    question = user_item("count")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    bundle.created(call, "resp-1")
    first = bundle.added(call, "msg-1")
    words = [f"w{index} " for index in range(deltas)]
    for word in words:
        bundle.delta(call, word)
    answer = assistant_output("".join(words), "msg-1")
    unfinished = bundle.added(call, "msg-2")
    bundle.delta(call, "late text for msg-1 ", item=first)
    bundle.delta(call, "partial")
    bundle.done(call, first, answer)
    bundle.delta(call, "still partial", item=unfinished)
    bundle.call_ended(call, COMPLETED, response_id="resp-1")
    bundle.turn_ended(turn, COMPLETED)
    follow_up = user_item("again")
    turn = bundle.turn("turn-2", [follow_up])
    call = bundle.call(turn, "call-2", [as_input(answer), follow_up], prefix=1)
    item = bundle.added(call, "msg-3")
    bundle.delta(call, "the end")
    bundle.done(call, item, assistant_output("the end", "msg-3"))
    bundle.call_ended(call, COMPLETED, response_id="resp-2")
    bundle.turn_ended(turn, COMPLETED)
    bundle.thread_ended()
    return bundle.close()


@pytest.mark.parametrize("deltas", [0, 1, 255, 256, 1000])
def test_the_same_state_as_one_record_at_a_time(tmp_path: Path, deltas: int) -> None:
    records = records_of(streaming_bundle(tmp_path, deltas=deltas))
    expected = one_by_one(records)
    assert all_at_once(records) == expected
    assert expected[1] == ""
    trace = expected[0]
    assert trace.integrity.records_read == len(records)
    discarded = trace.inference_calls["call-1"].discarded_outputs
    assert [output.partial_text for output in discarded] == ["partialstill partial"]


def test_every_prefix_and_a_contradiction_give_the_same_state(tmp_path: Path) -> None:
    records = records_of(streaming_bundle(tmp_path, deltas=300))
    for end in range(0, len(records), 7):
        assert all_at_once(records[:end]) == one_by_one(records[:end])
    # Right after a run of inline deltas, a delta for a call that never started: the same
    # error, and the same state up to it (its end time and record count included).
    second_added = next(
        index
        for index, record in enumerate(records)
        if record.output_item_added.provider_item_id == "msg-2"
    )
    streamed = records[:second_added]
    assert streamed[-1].HasField("output_text_delta")
    stray = record_pb2.TraceRecord(
        seq=second_added + 1, time_us=streamed[-1].time_us + 5,
        output_text_delta=record_pb2.OutputTextDelta(call=9, delta="stray"),
    )  # fmt: skip
    got, expected = all_at_once([*streamed, stray]), one_by_one([*streamed, stray])
    assert expected[1].startswith(f"seq {stray.seq}: ")
    assert got == expected
    assert got[0].ended_at == one_by_one(streamed)[0].ended_at
