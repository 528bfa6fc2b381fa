"""The reducer: reduction rules of SPEC §4 on bundles written by the real BundleWriter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from trace_reducer import (
    BundleNotFoundError,
    NotABundleError,
    RecordOutOfRangeError,
    Reducer,
    ReductionError,
    RequestNotFoundError,
    expand_request_items,
    read_bundle,
    replay_bundle,
    request_body,
    state_to_json,
)
from trace_reducer.reduce._reducer import _producer_ref

from .bundles import (
    CANCELLED,
    COMPLETED,
    FAILED,
    RUNNING,
    BundleBuilder,
    as_input,
    assistant_output,
    one_turn_bundle,
    user_item,
)

CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN
UNCLOSED = state_pb2.INTEGRITY_STATUS_UNCLOSED


def only_call(trace: state_pb2.RolloutTrace) -> state_pb2.InferenceCall:
    assert len(trace.inference_calls) == 1
    return next(iter(trace.inference_calls.values()))


def inference(call_id: str) -> list[state_pb2.ProducerRef]:
    return [state_pb2.ProducerRef(inference=state_pb2.InferenceProducer(inference_call_id=call_id))]


def user_input(turn_id: str) -> list[state_pb2.ProducerRef]:
    return [state_pb2.ProducerRef(user_input=state_pb2.UserInputProducer(turn_id=turn_id))]


@pytest.mark.parametrize(
    ("status", "provider_item_id", "expected_item_id"),
    [
        (COMPLETED, "msg-original", "msg-original"),
        (COMPLETED, None, "msg-assigned-1"),
        (FAILED, "msg-original", "msg-original"),
        (FAILED, None, "msg-assigned-1"),
    ],
)
def test_accepted_output_survives_success_and_failure(
    tmp_path: Path,
    status: common_pb2.ExecutionStatus.ValueType,
    provider_item_id: str | None,
    expected_item_id: str,
) -> None:
    bundle = one_turn_bundle(tmp_path, status, provider_item_id=provider_item_id)
    trace = replay_bundle(bundle)

    assert trace.recording_complete
    assert trace.integrity.status == CLEAN
    assert trace.root_thread_id == "thread-1"
    call = only_call(trace)
    assert len(call.response_item_ids) == 1
    output_id = call.response_item_ids[0]
    output = trace.conversation_items[output_id]
    thread = trace.threads["thread-1"]
    assert list(thread.conversation_item_ids) == [*call.request_item_ids, output_id]
    assert trace.turns["turn-1"].execution.status == status
    assert call.execution.status == status
    assert thread.execution.status == COMPLETED
    assert list(output.produced_by) == inference(call.inference_call_id)
    assert output.responses_item_id == expected_item_id
    assert output.role == state_pb2.CONVERSATION_ROLE_ASSISTANT
    assert output.kind == state_pb2.ITEM_KIND_MESSAGE
    assert [(p.type, p.text) for p in output.content] == [("output_text", "accepted answer")]
    assert call.response_id == "resp-1"
    assert call.usage.total_tokens == 7
    assert list(call.output_payload_ids) == [output.payload_id]
    if status == FAILED:
        assert call.error.code == "server_error"
        assert trace.turns["turn-1"].error.message == "stream failed"
        assert call.end_reason == "response.failed"
    else:
        assert not call.HasField("error")
        assert call.end_reason == "response.completed"


def test_user_input_items_and_call_fields(tmp_path: Path) -> None:
    trace = replay_bundle(one_turn_bundle(tmp_path))
    call = only_call(trace)
    turn = trace.turns["turn-1"]
    assert list(turn.input_item_ids) == list(call.request_item_ids)
    assert list(turn.inference_call_ids) == ["call-1"]
    user = trace.conversation_items[turn.input_item_ids[0]]
    assert list(user.produced_by) == user_input("turn-1")
    assert user.role == state_pb2.CONVERSATION_ROLE_USER
    assert [(p.type, p.text) for p in user.content] == [("input_text", "answer once")]
    assert user.turn_id == "turn-1"
    assert user.thread_id == "thread-1"
    assert (call.model, call.attempt, call.turn_id) == ("test-model", 1, "turn-1")
    assert call.provider_base_url == "http://127.0.0.1:9/v1"
    assert call.request_envelope_payload_id
    assert list(call.input_payload_ids) == [user.payload_id]
    assert trace.threads["thread-1"].metadata["purpose"] == "test"


def test_times_and_sequence_numbers(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    with read_bundle(bundle) as reader:
        records = list(reader)
    header = records[0].header
    trace = replay_bundle(bundle)
    assert trace.started_at == header.created_at
    last_us = records[-1].time_us
    base_us = header.created_at.seconds * 1_000_000 + header.created_at.nanos // 1000
    assert trace.ended_at.ToMicroseconds() == base_us + last_us
    seq_of = {record.WhichOneof("body"): record.seq for record in records}
    call = only_call(trace)
    assert call.execution.started_seq == seq_of["inference_started"]
    assert call.execution.ended_seq == seq_of["inference_ended"]
    assert trace.turns["turn-1"].execution.started_seq == seq_of["turn_started"]
    assert trace.threads["thread-1"].execution.ended_seq == seq_of["thread_ended"]
    by_seq = {record.seq: record for record in records}
    started = by_seq[call.execution.started_seq]
    assert call.execution.started_at.ToMicroseconds() == base_us + started.time_us


def interrupted_bundle(root: Path, *, record_call_end: bool) -> Path:
    """Reference test 3: one message done, a second only streamed, then the client interrupts."""
    bundle = BundleBuilder(root)
    question = user_item("answer once")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    bundle.created(call, "resp-1")
    kept = bundle.added(call, "accepted")
    bundle.delta(call, "Keep this answer.")
    bundle.done(call, kept, assistant_output("Keep this answer.", "accepted"))
    bundle.added(call, "unfinished")
    bundle.delta(call, "Discard this ")
    bundle.delta(call, "unfinished text")
    bundle.interrupt(turn)
    if record_call_end:
        bundle.call_ended(call, CANCELLED, reason="interrupted")
    bundle.turn_ended(turn, CANCELLED)
    bundle.thread_ended(CANCELLED, "shutdown")
    return bundle.close()


@pytest.mark.parametrize("record_call_end", [True, False])
def test_interrupted_turn_keeps_accepted_and_discards_unfinished(
    tmp_path: Path, record_call_end: bool
) -> None:
    trace = replay_bundle(interrupted_bundle(tmp_path, record_call_end=record_call_end))
    assert trace.recording_complete
    call = only_call(trace)
    turn = trace.turns["turn-1"]
    # Without an inference_ended the call takes its turn's ending status.
    assert call.execution.status == CANCELLED
    assert turn.execution.status == CANCELLED
    assert call.execution.ended_seq > call.execution.started_seq
    assert len(call.response_item_ids) == 1
    output = trace.conversation_items[call.response_item_ids[0]]
    assert output.responses_item_id == "accepted"
    assert list(output.produced_by) == inference("call-1")
    assert list(call.discarded_outputs) == [
        state_pb2.DiscardedOutput(
            provider_item_id="unfinished",
            item_type="message",
            partial_text="Discard this unfinished text",
        )
    ]
    assistants = [
        item_id
        for item_id in trace.threads["thread-1"].conversation_item_ids
        if trace.conversation_items[item_id].role == state_pb2.CONVERSATION_ROLE_ASSISTANT
    ]
    assert assistants == [output.item_id]
    assert turn.interrupt.requested_by == "ipv4:127.0.0.1:5555"
    assert turn.interrupt.seq > 0
    assert turn.interrupt.requested_at.ToMicroseconds() > 0


def test_two_turns_reuse_history_items(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    first_q = user_item("hello")
    turn1 = bundle.turn("turn-1", [first_q])
    call1 = bundle.call(turn1, "call-1", [first_q])
    item = bundle.added(call1, "msg-1")
    answer = assistant_output("hi there", "msg-1")
    bundle.done(call1, item, answer)
    bundle.call_ended(call1, COMPLETED)
    bundle.turn_ended(turn1, COMPLETED)
    # The same text again: a new item at a new position, not the first turn's.
    second_q = user_item("hello")
    turn2 = bundle.turn("turn-2", [second_q])
    call2 = bundle.call(turn2, "call-2", [first_q, as_input(answer, "msg-1"), second_q])
    item = bundle.added(call2, "msg-2")
    answer2 = assistant_output("hello again", "msg-2")
    bundle.done(call2, item, answer2)
    bundle.call_ended(call2, COMPLETED)
    bundle.turn_ended(turn2, COMPLETED)
    # A third request where the earlier answer comes back without its id: found by content.
    third_q = user_item("bye")
    turn3 = bundle.turn("turn-3", [third_q])
    history = [first_q, as_input(answer), second_q, as_input(answer2), third_q]
    call3 = bundle.call(turn3, "call-3", history)
    bundle.call_ended(call3, COMPLETED)
    bundle.turn_ended(turn3, COMPLETED)
    trace = replay_bundle(bundle.close())

    c1, c2, c3 = (trace.inference_calls[f"call-{n}"] for n in (1, 2, 3))
    t2, t3 = trace.turns["turn-2"], trace.turns["turn-3"]
    assert list(c2.request_item_ids) == [
        c1.request_item_ids[0],
        c1.response_item_ids[0],
        t2.input_item_ids[0],
    ]
    assert t2.input_item_ids[0] != c1.request_item_ids[0]
    assert list(c3.request_item_ids) == [
        *c2.request_item_ids,
        c2.response_item_ids[0],
        t3.input_item_ids[0],
    ]
    thread = trace.threads["thread-1"]
    assert list(thread.conversation_item_ids) == list(c3.request_item_ids)
    assert len(trace.conversation_items) == 5
    assert list(thread.turn_ids) == ["turn-1", "turn-2", "turn-3"]


def test_input_prefix_refers_to_the_previous_calls_input(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("hello")
    turn1 = bundle.turn("turn-1", [question])
    call1 = bundle.call(turn1, "call-1", [question])
    answer = assistant_output("hi there", "msg-1")
    bundle.done(call1, bundle.added(call1, "msg-1"), answer)
    bundle.call_ended(call1, COMPLETED)
    bundle.turn_ended(turn1, COMPLETED)
    follow_up = user_item("and then?")
    turn2 = bundle.turn("turn-2", [follow_up])
    bundle.call(turn2, "call-2", [as_input(answer), follow_up], prefix=1)
    bundle.call(turn2, "call-3", [], prefix=3, attempt=2)
    path = bundle.close()
    trace = replay_bundle(path)

    c1, c2, c3 = (trace.inference_calls[f"call-{n}"] for n in (1, 2, 3))
    assert len(c2.input_payload_ids) == 3
    assert c2.input_payload_ids[0] == c1.input_payload_ids[0]
    assert list(c2.request_item_ids) == [
        c1.request_item_ids[0],
        c1.response_item_ids[0],
        trace.turns["turn-2"].input_item_ids[0],
    ]
    assert list(c3.input_payload_ids) == list(c2.input_payload_ids)
    assert list(c3.request_item_ids) == list(c2.request_item_ids)
    body = json.loads(request_body(path, "call-2"))
    assert body["input"] == [question, as_input(answer), follow_up]
    assert body["model"] == "test-model"
    with pytest.raises(RequestNotFoundError):
        request_body(path, "call-9")


def test_input_prefix_longer_than_the_previous_input_contradicts(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("hello")
    turn = bundle.turn("turn-1", [question])
    bundle.call(turn, "call-1", [question])
    bundle.call(turn, "call-2", [], prefix=2)
    seq = bundle.writer.record_count
    with pytest.raises(ReductionError, match=rf"seq {seq}: input_prefix_count 2 exceeds"):
        replay_bundle(bundle.close())


def test_identical_content_within_one_request_is_two_items(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    again = user_item("again")
    turn = bundle.turn("turn-1", [again, again])
    call = bundle.call(turn, "call-1", [again, again])
    bundle.call_ended(call, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    trace = replay_bundle(bundle.close())
    ids = list(trace.inference_calls["call-1"].request_item_ids)
    assert len(set(ids)) == 2
    assert ids == list(trace.turns["turn-1"].input_item_ids)


def test_retry_sees_the_same_items_and_unknown_inputs_become_items(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("q")
    seeded = {"role": "developer", "content": "be nice"}  # short input form, string content
    turn = bundle.turn("turn-1", [question])
    call1 = bundle.call(turn, "call-1", [seeded, question])
    bundle.call_ended(call1, FAILED, reason="http_500")
    call2 = bundle.call(turn, "call-2", [seeded, question], attempt=2)
    bundle.call_ended(call2, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    trace = replay_bundle(bundle.close())
    first, second = trace.inference_calls["call-1"], trace.inference_calls["call-2"]
    assert list(first.request_item_ids) == list(second.request_item_ids)
    assert second.attempt == 2
    developer = trace.conversation_items[first.request_item_ids[0]]
    assert list(developer.produced_by) == []
    assert developer.role == state_pb2.CONVERSATION_ROLE_DEVELOPER
    assert [(p.type, p.text) for p in developer.content] == [("input_text", "be nice")]
    assert first.execution.status == FAILED
    assert list(trace.turns["turn-1"].inference_call_ids) == ["call-1", "call-2"]


def test_unclosed_bundle_reduces_with_running_objects(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("answer once")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    item = bundle.added(call, "msg-1")
    bundle.delta(call, "half ", item)
    bundle.delta(call, "an answer")
    bundle.writer.abandon()
    trace = replay_bundle(bundle.bundle_dir)
    assert not trace.recording_complete
    assert trace.integrity.status == UNCLOSED
    assert trace.threads["thread-1"].execution.status == RUNNING
    assert trace.turns["turn-1"].execution.status == RUNNING
    call_state = only_call(trace)
    assert call_state.execution.status == RUNNING
    assert not call_state.execution.HasField("ended_at")
    assert list(call_state.response_item_ids) == []
    assert [d.partial_text for d in call_state.discarded_outputs] == ["half an answer"]
    json_text = state_to_json(trace)
    assert '"recording_complete": false' in json_text


def test_chunked_payload_is_reassembled(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    big = user_item("x" * (5 * 1024 * 1024))
    turn = bundle.turn("turn-1", [big])
    bundle.turn_ended(turn, COMPLETED)
    directory = bundle.close()
    with read_bundle(directory) as reader:
        chunks = [r.payload.chunk_count for r in reader if r.HasField("payload")]
    assert max(chunks) > 1
    trace = replay_bundle(directory)
    item = trace.conversation_items[trace.turns["turn-1"].input_item_ids[0]]
    assert item.content[0].text == big["content"][0]["text"]


def test_unannounced_output_and_done_without_added(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("q")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    bundle.delta(call, "orphan text")  # no output_item.added before it
    bundle.done(call, 0, assistant_output("orphan text", None), assigned_id="assigned-1")
    bundle.call_ended(call, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    trace = replay_bundle(bundle.close())
    call_state = only_call(trace)
    assert list(call_state.discarded_outputs) == []
    output = trace.conversation_items[call_state.response_item_ids[0]]
    assert output.responses_item_id == "assigned-1"
    assert output.content[0].text == "orphan text"


def test_unknown_record_body_is_skipped_and_counted(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    # Field 99 (length-delimited) is not in this reducer's TraceRecord: a newer writer's body.
    future = record_pb2.TraceRecord.FromString(bytes([0x9A, 0x06, 0x03]) + b"new")
    seq = bundle.writer.append(future)
    question = user_item("q")
    turn = bundle.turn("turn-1", [question])
    bundle.turn_ended(turn, COMPLETED)
    trace = replay_bundle(bundle.close())
    assert trace.recording_complete
    assert trace.integrity.unknown_records == 1
    assert f"seq {seq}" in trace.integrity.detail
    assert "unknown body" in trace.integrity.detail
    assert trace.turns["turn-1"].execution.status == COMPLETED


def test_contradicting_bundle_fails_naming_the_seq(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    seq = bundle.append(turn_started=record_pb2.TurnStarted(turn=1, thread=9, turn_id="turn-1"))
    with pytest.raises(ReductionError, match=rf"^seq {seq}: unknown thread ordinal 9"):
        replay_bundle(bundle.close())


def header_record() -> record_pb2.TraceRecord:
    header = record_pb2.Header(format_version=1, trace_id="t", thread_id="th")
    header.created_at.FromMicroseconds(1_700_000_000_000_000)
    return record_pb2.TraceRecord(seq=1, header=header)


def prologue() -> list[record_pb2.TraceRecord]:
    """Header, thread, one turn, one call with one announced output item."""
    return [
        header_record(),
        record_pb2.TraceRecord(
            seq=2, thread_started=record_pb2.ThreadStarted(thread=1, thread_id="th")
        ),
        record_pb2.TraceRecord(
            seq=3, turn_started=record_pb2.TurnStarted(turn=1, thread=1, turn_id="tu")
        ),
        record_pb2.TraceRecord(
            seq=4,
            inference_started=record_pb2.InferenceStarted(call=1, turn=1, inference_call_id="c"),
        ),
        record_pb2.TraceRecord(seq=5, output_item_added=record_pb2.OutputItemAdded(call=1, item=1)),
    ]


def after_prologue() -> Reducer:
    reducer = Reducer()
    for earlier in prologue():
        reducer.apply(earlier)
    return reducer


CONTRADICTIONS: dict[str, tuple[record_pb2.TraceRecord, str]] = {
    "second header": (header_record(), "a second header"),
    "duplicate thread ordinal": (
        record_pb2.TraceRecord(thread_started=record_pb2.ThreadStarted(thread=1, thread_id="x")),
        "duplicate thread ordinal 1",
    ),
    "duplicate thread id": (
        record_pb2.TraceRecord(thread_started=record_pb2.ThreadStarted(thread=2, thread_id="th")),
        "duplicate thread id th",
    ),
    "duplicate turn id": (
        record_pb2.TraceRecord(turn_started=record_pb2.TurnStarted(turn=2, thread=1, turn_id="tu")),
        "duplicate turn id tu",
    ),
    "unknown turn": (
        record_pb2.TraceRecord(
            inference_started=record_pb2.InferenceStarted(call=2, turn=7, inference_call_id="d")
        ),
        "unknown turn ordinal 7",
    ),
    "duplicate call ordinal": (
        record_pb2.TraceRecord(
            inference_started=record_pb2.InferenceStarted(call=1, turn=1, inference_call_id="d")
        ),
        "duplicate inference call ordinal 1",
    ),
    "unknown call": (
        record_pb2.TraceRecord(output_text_delta=record_pb2.OutputTextDelta(call=3, delta="x")),
        "unknown inference call ordinal 3",
    ),
    "unknown item": (
        record_pb2.TraceRecord(
            output_text_delta=record_pb2.OutputTextDelta(call=1, delta="x", item=5)
        ),
        "unknown output item ordinal 5",
    ),
    "duplicate item ordinal": (
        record_pb2.TraceRecord(output_item_added=record_pb2.OutputItemAdded(call=1, item=1)),
        "duplicate output item ordinal 1",
    ),
    "unknown payload": (
        record_pb2.TraceRecord(
            output_item_done=record_pb2.OutputItemDone(
                call=1, item=1, item_id="m", item_payload_id="feed"
            )
        ),
        "unknown payload feed",
    ),
    "unknown turn for turn_ended": (
        record_pb2.TraceRecord(turn_ended=record_pb2.TurnEnded(turn=4, status=COMPLETED)),
        "unknown turn ordinal 4",
    ),
    "unknown thread for thread_ended": (
        record_pb2.TraceRecord(thread_ended=record_pb2.ThreadEnded(thread=2, status=COMPLETED)),
        "unknown thread ordinal 2",
    ),
}


@pytest.mark.parametrize("name", sorted(CONTRADICTIONS))
def test_contradictions_fail_naming_the_seq(name: str) -> None:
    record, message = CONTRADICTIONS[name]
    reducer = after_prologue()
    record.seq = 6
    with pytest.raises(ReductionError, match=rf"^seq 6: {message}"):
        reducer.apply(record)


@pytest.mark.parametrize("name", sorted(CONTRADICTIONS))
def test_a_contradiction_leaves_the_state_as_the_records_before_made_it(name: str) -> None:
    record, _ = CONTRADICTIONS[name]
    reducer = after_prologue()
    before = reducer.state()
    record = record_pb2.TraceRecord.FromString(record.SerializeToString())
    record.seq = 6
    with pytest.raises(ReductionError):
        reducer.apply(record)
    assert reducer.state() == before


# Each record that opens a context, at a time no Timestamp holds (the year 10000 and on).
_OPENERS = {
    "thread": record_pb2.TraceRecord(
        thread_started=record_pb2.ThreadStarted(thread=2, thread_id="th-2")
    ),
    "turn": record_pb2.TraceRecord(
        turn_started=record_pb2.TurnStarted(turn=2, thread=1, turn_id="tu-2")
    ),
    "call": record_pb2.TraceRecord(
        inference_started=record_pb2.InferenceStarted(call=2, turn=1, inference_call_id="c-2")
    ),
    "item": record_pb2.TraceRecord(output_item_done=record_pb2.OutputItemDone(call=1, item=1)),
    "tool call": record_pb2.TraceRecord(
        tool_call_started=record_pb2.ToolCallStarted(
            tool_call=1, call=1, tool_call_id="tc", call_id="x", name="f"
        )
    ),
}


@pytest.mark.parametrize("name", sorted(_OPENERS))
def test_a_context_opened_at_an_impossible_time_leaves_nothing_behind(name: str) -> None:
    reducer = after_prologue()
    before = reducer.state()
    record = record_pb2.TraceRecord.FromString(_OPENERS[name].SerializeToString())
    record.seq = 6
    record.time_us = 300_000_000_000 * 1_000_000
    with pytest.raises(RecordOutOfRangeError, match=r"^seq 6: its time is "):
        reducer.apply(record)
    assert reducer.state() == before
    # At a possible time the same record opens its context: the refusal was the time's.
    record.time_us = 10
    reducer.apply(record)
    assert reducer.state() != before


def test_the_final_state_is_the_reducers_own_and_ends_it(tmp_path: Path) -> None:
    bundle = interrupted_bundle(tmp_path, record_call_end=False)
    reducer = Reducer()
    with read_bundle(bundle) as reader:
        records = list(reader)
        for record in records:
            reducer.apply(record)
        reducer.set_integrity(reader.integrity)
    copy = reducer.state()
    final = reducer.final_state()
    assert final == copy
    assert final == replay_bundle(bundle)
    with pytest.raises(RuntimeError, match="final state was taken"):
        reducer.apply(records[-1])
    with pytest.raises(RuntimeError, match="final state was taken"):
        reducer.apply_many(records[-1:])
    with pytest.raises(RuntimeError, match="final state was taken"):
        reducer.state()


def test_events_after_the_call_ended_contradict() -> None:
    reducer = after_prologue()
    reducer.apply(
        record_pb2.TraceRecord(
            seq=6, inference_ended=record_pb2.InferenceEnded(call=1, status=COMPLETED)
        )
    )
    for late in (
        record_pb2.OutputTextDelta(call=1, delta="late"),
        record_pb2.OutputTextDelta(call=1, delta="late", item=1),
    ):
        with pytest.raises(ReductionError, match=r"^seq 7: inference call c has already ended"):
            reducer.apply(record_pb2.TraceRecord(seq=7, output_text_delta=late))
    with pytest.raises(ReductionError, match=r"^seq 7: inference call c has already ended"):
        reducer.apply(
            record_pb2.TraceRecord(
                seq=7, inference_ended=record_pb2.InferenceEnded(call=1, status=FAILED)
            )
        )


def test_records_before_the_header_contradict() -> None:
    record = record_pb2.TraceRecord(
        seq=1, thread_started=record_pb2.ThreadStarted(thread=1, thread_id="th")
    )
    with pytest.raises(ReductionError, match=r"^seq 1: thread_started before the header"):
        Reducer().apply(record)


def test_state_is_a_snapshot_and_reduction_is_deterministic(tmp_path: Path) -> None:
    bundle = interrupted_bundle(tmp_path, record_call_end=False)
    reducer = Reducer()
    snapshots = []
    with read_bundle(bundle) as reader:
        for record in reader:
            reducer.apply(record)
            snapshots.append(state_to_json(reducer.state()))
        reducer.set_integrity(reader.integrity)
    final = state_to_json(reducer.state())
    assert final == state_to_json(reducer.state())
    assert final == state_to_json(replay_bundle(bundle))
    assert state_to_json(replay_bundle(bundle)) == state_to_json(replay_bundle(bundle))
    # Mid-stream the still-open item shows as discarded, and later records change nothing of it.
    streaming = [s for s in snapshots if "Discard this " in s]
    assert streaming
    assert json.loads(snapshots[-1])["recording_complete"] is False
    assert json.loads(final)["recording_complete"] is True


def test_missing_and_non_bundle_paths_raise_bundle_errors(tmp_path: Path) -> None:
    with pytest.raises(BundleNotFoundError):
        replay_bundle(tmp_path / "nope")
    with pytest.raises(NotABundleError):
        replay_bundle(tmp_path)


def test_every_truncation_reduces_and_is_never_clean(tmp_path: Path) -> None:
    bundle = interrupted_bundle(tmp_path, record_call_end=True)
    data = (bundle / "trace.binpb").read_bytes()
    damaged = tmp_path / "damaged.binpb"
    for size in range(len(data)):
        damaged.write_bytes(data[:size])
        trace = replay_bundle(damaged)
        assert trace.integrity.status != CLEAN
        assert not trace.recording_complete


# Thousands of replays, CPU-bound: a hang guard for a busy machine, not a speed check.
@pytest.mark.timeout(300)
def test_every_bit_flip_is_never_clean(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    data = (bundle / "trace.binpb").read_bytes()
    damaged = tmp_path / "damaged.binpb"
    for index in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            damaged.write_bytes(flipped)
            assert replay_bundle(damaged).integrity.status != CLEAN


def test_compact_form_holds_each_request_as_a_prefix_and_expands_back(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("hello")
    turn1 = bundle.turn("turn-1", [question])
    call1 = bundle.call(turn1, "call-1", [question])
    answer = assistant_output("hi there", "msg-1")
    bundle.done(call1, bundle.added(call1, "msg-1"), answer)
    bundle.call_ended(call1, COMPLETED)
    bundle.turn_ended(turn1, COMPLETED)
    follow_up = user_item("and then?")
    turn2 = bundle.turn("turn-2", [follow_up])
    bundle.call(turn2, "call-2", [as_input(answer), follow_up], prefix=1)
    # A retry that departs from the previous request after its first item.
    bundle.call(turn2, "call-3", [user_item("instead")], prefix=1, attempt=2)
    bundle.call(turn2, "call-4", [], prefix=2, attempt=3)
    path = bundle.close()

    complete = replay_bundle(path)
    compact = replay_bundle(path, compact=True)
    c1, c2, c3, c4 = (compact.inference_calls[f"call-{n}"] for n in (1, 2, 3, 4))
    assert (c1.request_prefix_call_id, c1.request_prefix_count) == ("", 0)
    assert (c2.request_prefix_call_id, c2.request_prefix_count) == ("call-1", 1)
    assert (c3.request_prefix_call_id, c3.request_prefix_count) == ("call-2", 1)
    assert (c4.request_prefix_call_id, c4.request_prefix_count) == ("call-3", 2)
    assert len(c2.request_item_ids) == len(c2.input_payload_ids) == 2
    assert list(c4.request_item_ids) == []
    whole = complete.inference_calls
    assert list(whole["call-3"].request_item_ids) == [
        whole["call-1"].request_item_ids[0],
        *c3.request_item_ids,
    ]
    assert list(whole["call-4"].request_item_ids) == list(whole["call-3"].request_item_ids)
    assert not any(call.request_prefix_call_id for call in whole.values())

    expand_request_items(compact)
    assert compact == complete
    expand_request_items(compact)  # a complete state stays as it is
    assert compact == complete


def test_compact_state_grows_with_the_conversation_not_its_square(tmp_path: Path) -> None:
    def sizes(turns: int) -> tuple[int, int]:
        bundle = write_conversation(tmp_path / str(turns), Shape(turns=turns, deltas_per_turn=2))
        compact = replay_bundle(bundle, compact=True)
        complete = replay_bundle(bundle)
        count = sum(len(c.request_item_ids) for c in compact.inference_calls.values())
        whole = sum(len(c.request_item_ids) for c in complete.inference_calls.values())
        return count, whole

    assert sizes(40) == (2 * 40 - 1, 40 * 40)
    assert sizes(80) == (2 * 80 - 1, 80 * 80)


def test_expanding_interleaved_threads_and_states_written_by_hand() -> None:
    # Two threads' calls interleaved: a prefix is then not the call just before.
    trace = state_pb2.RolloutTrace()

    def call(call_id: str, seq: int, items: list[str], prefix: str = "", count: int = 0) -> None:
        target = trace.inference_calls[call_id]
        target.inference_call_id = call_id
        target.execution.started_seq = seq
        target.request_item_ids.extend(items)
        target.input_payload_ids.extend(f"p-{item}" for item in items)
        target.request_prefix_call_id = prefix
        target.request_prefix_count = count

    call("a1", 1, ["x", "y"])
    call("b1", 2, ["u"])
    call("a2", 3, ["z"], "a1", 2)
    call("b2", 4, ["v"], "b1", 1)
    call("a3", 5, ["w"], "a2", 1)  # departs after the first item
    call("b3", 6, [], "b2", 2)
    expand_request_items(trace)
    whole = {name: list(c.request_item_ids) for name, c in trace.inference_calls.items()}
    assert whole == {
        "a1": ["x", "y"],
        "b1": ["u"],
        "a2": ["x", "y", "z"],
        "b2": ["u", "v"],
        "a3": ["x", "w"],
        "b3": ["u", "v"],
    }
    assert list(trace.inference_calls["a3"].input_payload_ids) == ["p-x", "p-w"]
    assert not any(c.request_prefix_call_id for c in trace.inference_calls.values())


@pytest.mark.parametrize("kind", ["inference", "user_input", "tool"])
@pytest.mark.parametrize(
    "producer_id",
    ["", "a", "turn_d69504e649154efdaf331204491835cf", "x" * 125, "x" * 126, "ü" * 90, "é" * 2000],
)
def test_a_producer_ref_is_encoded_as_its_message_serializes(kind: str, producer_id: str) -> None:
    # Lengths across the one- to two-byte varint edge of the inner and the outer message.
    producers = {
        "inference": lambda: state_pb2.ProducerRef(
            inference=state_pb2.InferenceProducer(inference_call_id=producer_id)
        ),
        "user_input": lambda: state_pb2.ProducerRef(
            user_input=state_pb2.UserInputProducer(turn_id=producer_id)
        ),
        "tool": lambda: state_pb2.ProducerRef(
            tool=state_pb2.ToolProducer(tool_call_id=producer_id)
        ),
    }
    expected = producers[kind]()
    encoded = _producer_ref(kind, producer_id)
    assert encoded == expected.SerializeToString()
    assert state_pb2.ProducerRef.FromString(encoded) == expected
