"""The incremental reducer: trace records in, the RolloutTrace state graph out."""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable
from typing import Any, ClassVar, NoReturn

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor

from rollout.trace.v1 import common_pb2, record_pb2, state_pb2

from ..bundle._bulk import DeltaRun
from ..bundle._errors import PayloadError, RecordOutOfRangeError, ReductionError
from ..bundle._framing import encode_varint
from ..bundle._payloads import PayloadStore, payload_json
from ..bundle._tokens import TokenAccumulator, classify_stop, sampling_settings
from ._compact import expand_request_items
from ._items import ItemInfo, ThreadItems, item_wire, parse_item
from ._parents import ForkResolver, ParentBundle, fork_chain

_RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
_JOIN_EVERY = 256
_RUN_BYTES = 1 << 18
_CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN

_Record = record_pb2.TraceRecord


def _length_delimited_tag(field: FieldDescriptor) -> bytes:
    return encode_varint(field.number << 3 | 2)


_PRODUCERS = state_pb2.ProducerRef.DESCRIPTOR.fields_by_name
# Each producer kind's tag in ProducerRef, and the tag of the one id its message holds.
_PRODUCER_TAGS = {
    name: (_length_delimited_tag(_PRODUCERS[name]), _length_delimited_tag(only))
    for name, only in (
        ("inference", state_pb2.InferenceProducer.DESCRIPTOR.fields_by_name["inference_call_id"]),
        ("user_input", state_pb2.UserInputProducer.DESCRIPTOR.fields_by_name["turn_id"]),
        ("tool", state_pb2.ToolProducer.DESCRIPTOR.fields_by_name["tool_call_id"]),
    )
}


def _producer_ref(kind: str, producer_id: str) -> bytes:
    """The ProducerRef whose `kind` producer has producer_id, encoded as SerializeToString
    encodes it: made once a turn, a call and a tool call of every replay, and the message made
    and serialized costs three times the bytes joined."""
    outer, inner = _PRODUCER_TAGS[kind]
    data = producer_id.encode()
    body = inner + encode_varint(len(data)) + data if data else b""
    return outer + encode_varint(len(body)) + body


class _Thread:
    __slots__ = ("ended", "inputs", "items", "last_call", "msg", "thread_id")

    def __init__(self, msg: state_pb2.Thread) -> None:
        self.msg = msg
        # Its id at hand: each item and call of the thread names it, and a message's field
        # costs a call into the message library each time it is read.
        self.thread_id = msg.thread_id
        self.items = ThreadItems()
        self.ended = False
        # The complete input payload ids of the thread's latest inference call (changed in
        # place by each call from where it departs), and that call's id.
        self.inputs: list[str] = []
        self.last_call = ""


class _Turn:
    __slots__ = ("calls", "ended", "msg", "thread", "tool_calls", "turn_id")

    def __init__(self, msg: state_pb2.Turn, thread: _Thread) -> None:
        self.msg = msg
        self.turn_id = msg.turn_id
        self.thread = thread
        self.calls: list[_Call] = []
        self.tool_calls: list[_ToolCall] = []
        self.ended = False


class _ToolCall:
    __slots__ = ("ended", "msg", "turn")

    def __init__(self, msg: state_pb2.ToolCall, turn: _Turn) -> None:
        self.msg = msg
        self.turn = turn
        self.ended = False


class _Output:
    """An output item between output_item.added and output_item.done."""

    __slots__ = (
        "announced",
        "call",
        "chunks",
        "item_type",
        "parts",
        "provider_item_id",
        "role",
        "run_bytes",
    )

    def __init__(
        self, call: _Call, provider_item_id: str, item_type: str, role: str, *, announced: bool
    ) -> None:
        self.announced = announced
        self.call = call
        self.provider_item_id = provider_item_id
        self.item_type = item_type
        self.role = role
        # The latest deltas until the item is done; None from then on. Runs of deltas stay
        # undecoded: an item that completes brings its whole text, so theirs is rarely needed.
        self.parts: list[str | DeltaRun] | None = []
        self.run_bytes = 0
        # Earlier deltas, joined _JOIN_EVERY at a time: an item streamed in a million tiny
        # deltas must not cost a million string objects.
        self.chunks: list[str] = []

    def add(self, delta: str) -> None:
        parts = self.parts
        if parts is not None:
            parts.append(delta)
            if len(parts) >= _JOIN_EVERY:
                self.join()

    def add_run(self, run: DeltaRun) -> None:
        parts = self.parts
        assert parts is not None
        parts.append(run)
        self.run_bytes += run.size
        # Undecoded runs cost more than their text; past a bound they are decoded, so what a
        # streaming item holds stays in proportion to its text.
        if self.run_bytes > _RUN_BYTES or len(parts) >= _JOIN_EVERY:
            self.join()

    def join(self) -> None:
        assert self.parts is not None
        self.chunks.append(_joined(self.parts))
        self.parts.clear()
        self.run_bytes = 0

    def text(self) -> str:
        return "".join(self.chunks) + _joined(self.parts or ())

    def discarded(self) -> state_pb2.DiscardedOutput:
        return state_pb2.DiscardedOutput(
            provider_item_id=self.provider_item_id,
            item_type=self.item_type,
            partial_text=self.text(),
        )


def _joined(parts: Iterable[str | DeltaRun]) -> str:
    return "".join(part if isinstance(part, str) else part.text() for part in parts)


class _Call:
    __slots__ = ("ended", "latest", "msg", "open", "ordinal", "producer", "tokens", "turn")

    def __init__(self, ordinal: int, msg: state_pb2.InferenceCall, turn: _Turn) -> None:
        self.ordinal = ordinal
        self.msg = msg
        self.turn = turn
        # Items added but not done yet, in the order they were added (a dict as ordered set).
        self.open: dict[_Output, None] = {}
        self.latest: _Output | None = None
        self.ended = False
        self.tokens: TokenAccumulator | None = None
        # The ProducerRef of the call's accepted items, encoded once for all of them.
        self.producer = b""


def _unresolved(payload_id: str) -> ItemInfo:
    """Stands for an item whose payload is in a fork's parent bundle, which was not found."""
    return ItemInfo(
        key=f"unresolved:{payload_id}",
        responses_item_id="",
        role=state_pb2.CONVERSATION_ROLE_UNSPECIFIED,
        kind=state_pb2.ITEM_KIND_OTHER,
        content=(),
        call_id="",
    )


# What a Timestamp may hold (0001-01-01 to 9999-12-31), and so what proto3 JSON can show.
_MIN_MICROS = -62_135_596_800 * 1_000_000
_MAX_MICROS = 253_402_300_800 * 1_000_000 - 1


def _timestamp(micros: int) -> timestamp_pb2.Timestamp:
    seconds, rest = divmod(micros, 1_000_000)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=rest * 1000)


def _set_time(target: timestamp_pb2.Timestamp, micros: int) -> None:
    seconds, rest = divmod(micros, 1_000_000)
    # Setting a field of a sub-message marks it present, zero or not.
    target.seconds = seconds
    target.nanos = rest * 1000


def _fail(record: _Record, message: str) -> NoReturn:
    raise ReductionError(f"seq {record.seq}: {message}")


def _check_time(seq: int, micros: int, what: str) -> None:
    if not _MIN_MICROS <= micros <= _MAX_MICROS:
        raise RecordOutOfRangeError(
            f"seq {seq}: {what} is {micros // 1_000_000} s from 1970, outside the years "
            "1-9999 a timestamp can hold"
        )


def _check_new(
    record: _Record,
    what: str,
    ordinal: int,
    ordinals: Container[int],
    context_id: str,
    context_ids: Container[str],
) -> None:
    """A record that opens a context must bring an ordinal and an id not seen before."""
    # The body's name is asked for only to say what failed: every context's start passes here.
    if not ordinal:
        _fail(record, f"{record.WhichOneof('body')} without a {what} ordinal")
    if ordinal in ordinals:
        _fail(record, f"duplicate {what} ordinal {ordinal}")
    if not context_id:
        _fail(record, f"{record.WhichOneof('body')} without a {what} id")
    if context_id in context_ids:
        _fail(record, f"duplicate {what} id {context_id}")


_Handlers = dict[str | None, Callable[["Reducer", _Record], None]]


class Reducer:
    """Applies records one at a time; state() is the reduced graph of what was applied so far.

    Memory follows the state: records are never kept, and a streaming output item keeps only
    its text until it is done.
    """

    def __init__(self, *, forks: ForkResolver | None = None) -> None:
        # Finds a fork's parent bundle; without it a fork's shared prefix stays unresolved.
        self._forks = forks
        self._fork: state_pb2.Fork | None = None
        self._fork_prefix: list[str] | None = None
        self._fork_seq = 0
        self.parent: ParentBundle | None = None
        self._unresolved_payloads = 0
        self._sampling: dict[str, common_pb2.SamplingSettings] = {}
        # Each thread's held tokens (its latest prompt, then every output id since), None
        # while unknown (a fork whose parent's tokens could not be read).
        self._held: dict[str, list[int] | None] = {}
        self._fork_tokens: list[int] | None = None
        self._header: record_pb2.Header | None = None
        self._base_us = 0
        self._last_time_us = 0
        self._records = 0
        self._unknown = 0
        self._first_unknown_seq = 0
        self._integrity: state_pb2.Integrity | None = None
        self._threads: dict[int, _Thread] = {}
        self._turns: dict[int, _Turn] = {}
        self._calls: dict[int, _Call] = {}
        self._outputs: dict[int, _Output] = {}
        # Call ordinal -> its latest item while both are live (see _set_latest).
        self._streaming: dict[int, _Output] = {}
        self._thread_ids: set[str] = set()
        self._turn_ids: set[str] = set()
        self._call_ids: set[str] = set()
        self._tool_calls: dict[int, _ToolCall] = {}
        self._tool_call_ids: set[str] = set()
        # The state itself: each context's message is made in its map and changed there, so
        # state() copies the whole in one call and final_state() hands it over as it is.
        self._trace = state_pb2.RolloutTrace()
        self._taken = False
        self._items: dict[str, state_pb2.ConversationItem] = {}
        self._payloads = PayloadStore()
        # Items are parsed once, however many later requests repeat them; their bytes go.
        self._item_infos: dict[str, ItemInfo] = {}
        # Until the header arrives every body takes the slow path, which rejects it.
        self._handlers = Reducer._BEFORE_HEADER

    # -- public surface -------------------------------------------------------------------

    def apply(self, record: record_pb2.TraceRecord) -> None:
        """Fold one record into the state.

        Raises ReductionError when it contradicts the records before it; the state is then
        left as those records made it.
        """
        if self._taken:
            self._check_not_taken()
        kind = record.WhichOneof("body")
        handler = self._handlers.get(kind)
        if handler is None:
            self._unhandled(record, kind)
        else:
            handler(self, record)
        self._last_time_us = record.time_us
        self._records += 1

    def apply_many(self, records: Iterable[record_pb2.TraceRecord | DeltaRun]) -> None:
        """apply() each record in order; the loop replay runs, with text deltas for a call's
        latest item (most of any bundle) handled inline, and runs of them (what
        FrameDecoder.feed_batch makes) whole."""
        self._check_not_taken()
        streaming = self._streaming
        last: _Record | None = None
        inline = 0
        try:
            for record in records:
                if type(record) is DeltaRun:
                    if last is not None:
                        self._records += inline
                        self._last_time_us = last.time_us
                        inline = 0
                        last = None
                    self._apply_run(record)
                    continue
                assert isinstance(record, _Record)
                kind = record.WhichOneof("body")
                if kind == "output_text_delta":
                    body = record.output_text_delta
                    latest = None if body.item else streaming.get(body.call)
                    if latest is not None and not body.HasField("tokens"):
                        parts = latest.parts
                        assert parts is not None
                        parts.append(body.delta)
                        if len(parts) >= _JOIN_EVERY:
                            latest.join()
                        last = record
                        inline += 1
                        continue
                # What apply() does, inline: this loop runs once per record of every replay.
                handler = self._handlers.get(kind)
                if handler is None:
                    self._unhandled(record, kind)
                else:
                    handler(self, record)
                last = record
                inline += 1
        finally:
            if last is not None:
                self._records += inline
                self._last_time_us = last.time_us

    def _apply_run(self, run: DeltaRun) -> None:
        latest = self._streaming.get(run.call)
        if latest is None:
            # Not the common case the run is for: every record means what it says alone.
            for record in run.records():
                self.apply(record)
            return
        latest.add_run(run)
        self._records += run.count
        self._last_time_us = run.last_time_us

    def set_integrity(self, integrity: state_pb2.Integrity) -> None:
        """Record how the bundle ended, as the reader classified it."""
        self._integrity = integrity

    def state(self, *, compact: bool = False) -> state_pb2.RolloutTrace:
        """The reduced state of every record applied so far (a fresh message on each call).

        compact: each inference call's request as "a prefix of the previous call's, then these
        items" (InferenceCall.request_prefix_call_id, request_prefix_count); by default every
        request_item_ids and input_payload_ids is whole.
        """
        self._check_not_taken()
        trace = state_pb2.RolloutTrace()
        trace.CopyFrom(self._trace)
        return self._finished(trace, compact=compact)

    def final_state(self, *, compact: bool = False) -> state_pb2.RolloutTrace:
        """state(), without the copy: the reducer's own message, for a reduction that is over.
        Nothing can be applied, nor a state asked for, after it."""
        self._check_not_taken()
        self._taken = True
        trace = self._finished(self._trace, compact=compact)
        # What never ended still links turn, call and output both ways: unlinked, all of it
        # goes with the reducer rather than when the cycle collector next runs.
        for turn in self._turns.values():
            turn.calls.clear()
            turn.tool_calls.clear()
        for call in self._calls.values():
            call.latest = None
        return trace

    def _check_not_taken(self) -> None:
        if self._taken:
            raise RuntimeError("the reducer's final state was taken: it takes no more records")

    def _finished(self, trace: state_pb2.RolloutTrace, *, compact: bool) -> state_pb2.RolloutTrace:
        """trace (a copy of the state, or the state itself) with what the records so far
        imply once they end: the header's fields, the integrity, what is still streaming as
        discarded, the tokens gathered, the fork, and (unless compact) every request whole."""
        header = self._header
        if header is not None:
            trace.trace_id = header.trace_id
            trace.root_thread_id = header.thread_id
            trace.producer_name = header.producer_name
            trace.producer_version = header.producer_version
            trace.started_at.CopyFrom(_timestamp(self._base_us))
            ended = self._base_us + self._last_time_us
            # Records are counted as applied, so the last one's seq is the count.
            _check_time(self._records, ended, "its time")
            trace.ended_at.CopyFrom(_timestamp(ended))
        trace.integrity.CopyFrom(self._integrity_proto())
        trace.recording_complete = trace.integrity.status == _CLEAN
        calls = trace.inference_calls
        for call in self._calls.values():
            if call.open or call.tokens is not None:
                target = calls[call.msg.inference_call_id]
                # The records end here: whatever is still streaming would be discarded.
                for output in call.open:
                    target.discarded_outputs.append(output.discarded())
                if call.tokens is not None:
                    target.output_tokens.CopyFrom(call.tokens.to_proto())
        if self._fork is not None:
            trace.fork.CopyFrom(self._fork)
        if not compact:
            expand_request_items(trace)
        return trace

    # -- dispatch -------------------------------------------------------------------------

    def _unhandled(self, record: _Record, kind: str | None) -> None:
        if kind is None:
            # A body from a newer writer: skipped, but the state says so.
            self._unknown += 1
            if not self._first_unknown_seq:
                self._first_unknown_seq = record.seq
        elif self._header is None:
            _fail(record, f"{kind} before the header")
        else:
            _fail(record, f"a second {kind}")

    def _integrity_proto(self) -> state_pb2.Integrity:
        if self._integrity is not None:
            proto = state_pb2.Integrity()
            proto.CopyFrom(self._integrity)
        else:
            proto = state_pb2.Integrity(records_read=self._records)
        if self._unknown:
            note = (
                f"skipped {self._unknown} record(s) with an unknown body "
                f"(first at seq {self._first_unknown_seq})"
            )
            proto.detail = f"{proto.detail}; {note}" if proto.detail else note
            proto.unknown_records = self._unknown
        fork = self._fork
        if fork is not None and fork.resolved and self._unresolved_payloads:
            note = (
                f"fork of thread {fork.parent_thread_id}: its parent {fork.resolved_from} "
                f"could not supply {self._unresolved_payloads} payload(s) (it is incomplete, "
                "or its own parent is missing); what they hold is unresolved"
            )
            proto.detail = f"{proto.detail}; {note}" if proto.detail else note
            proto.fork_unresolved = True
        if fork is not None and not fork.resolved:
            where = f"bundle {fork.parent_bundle}" if fork.parent_bundle else "bundle (unrecorded)"
            note = (
                f"fork of thread {fork.parent_thread_id}: its parent {where} was not found, "
                f"{fork.shared_items} shared item(s) and {self._unresolved_payloads} payload(s) "
                "are unresolved (give the parent bundle to resolve them)"
            )
            proto.detail = f"{proto.detail}; {note}" if proto.detail else note
            proto.fork_unresolved = True
        return proto

    def _micros(self, record: _Record) -> int:
        """The record's time in microseconds from 1970, checked to fit a Timestamp. A record
        that starts a context asks for it before it changes anything: the context's message
        is made in the state, where a failure must not leave half of it."""
        micros = self._base_us + record.time_us
        if not _MIN_MICROS <= micros <= _MAX_MICROS:
            _check_time(record.seq, micros, "its time")  # raises
        return micros

    def _stamp(self, target: timestamp_pb2.Timestamp, record: _Record) -> None:
        """Set target to the record's time (set in place: a Timestamp made and copied in costs
        twice, and every context's start and end has one)."""
        _set_time(target, self._micros(record))

    def _start(self, execution: state_pb2.Execution, micros: int, record: _Record) -> None:
        execution.status = _RUNNING
        _set_time(execution.started_at, micros)
        execution.started_seq = record.seq

    def _end(
        self,
        execution: state_pb2.Execution,
        status: common_pb2.ExecutionStatus.ValueType,
        record: _Record,
    ) -> None:
        execution.status = status
        self._stamp(execution.ended_at, record)
        execution.ended_seq = record.seq

    # -- lookups --------------------------------------------------------------------------

    def _thread(self, ordinal: int, record: _Record) -> _Thread:
        thread = self._threads.get(ordinal)
        if thread is None:
            _fail(record, f"unknown thread ordinal {ordinal}")
        return thread

    def _turn(self, ordinal: int, record: _Record) -> _Turn:
        turn = self._turns.get(ordinal)
        if turn is None:
            _fail(record, f"unknown turn ordinal {ordinal}")
        return turn

    def _live_call(self, ordinal: int, record: _Record) -> _Call:
        call = self._calls.get(ordinal)
        if call is None:
            _fail(record, f"unknown inference call ordinal {ordinal}")
        if call.ended:
            _fail(record, f"inference call {call.msg.inference_call_id} has already ended")
        return call

    def _item_info(self, payload_id: str, record: _Record) -> ItemInfo:
        info = self._item_infos.get(payload_id)
        if info is None:
            info = self._inherited_item(payload_id)
            if info is None:
                data = self._payload(payload_id, record)
                info = _unresolved(payload_id) if data is None else parse_item(data)
            self._item_infos[payload_id] = info
            self._payloads.discard(payload_id)
        return info

    def _inherited_item(self, payload_id: str) -> ItemInfo | None:
        """The item a fork's ancestor parsed from a payload this bundle does not hold."""
        if self.parent is None or self._payloads.holds(payload_id):
            return None
        return self.parent.item_info(payload_id)

    def held_payloads(self) -> tuple[PayloadStore, dict[str, ItemInfo]]:
        """What this reducer keeps of its payloads: the bytes it has not parsed (within its
        budget) and the items it parsed; a fork's reducer asks its parent's for them."""
        return self._payloads, self._item_infos

    def _payload(self, payload_id: str, record: _Record) -> bytes | None:
        """A payload's bytes: this bundle's, else a fork's ancestors'; None when they cannot
        supply it (the parent is missing, torn, or itself lacks it): the state marks it
        unresolved and the fork still reduces. Anything else missing is a contradiction."""
        try:
            return self._payloads.get(payload_id)
        except PayloadError as error:
            if self._fork is None:
                _fail(record, str(error))
            data = self.parent.payload(payload_id) if self.parent is not None else None
            if data is None:
                self._unresolved_payloads += 1
            return data

    def _new_item(
        self,
        thread: _Thread,
        turn_id: str,
        info: ItemInfo,
        payload_id: str,
        record: _Record,
        micros: int,
        *,
        responses_item_id: str,
        producer: bytes,
    ) -> str:
        """A new conversation item of thread, first seen at record (whose time, micros, its
        handler has checked); producer is its ProducerRef encoded, b"" for none."""
        item_id = f"item-{len(self._items) + 1}"
        item = self._trace.conversation_items[item_id]
        seconds, rest = divmod(micros, 1_000_000)
        wire = (
            item_wire(
                info,
                item_id,
                thread.thread_id,
                turn_id,
                responses_item_id,
                record.seq,
                payload_id,
                seconds,
                rest * 1000,
                producer,
            )
            if item_wire is not None
            else None
        )
        if wire is not None:
            # Every field in one parse (_describe.c), where each set below is a call into the
            # message library of its own; the same message either way (tested).
            item.MergeFromString(wire)
        else:
            item.item_id = item_id
            item.thread_id = thread.thread_id
            if turn_id:
                item.turn_id = turn_id
            if responses_item_id:
                item.responses_item_id = responses_item_id
            item.first_seen_seq = record.seq
            if payload_id:
                item.payload_id = payload_id
            info.fill(item)
            _set_time(item.first_seen_at, micros)
            if producer:
                item.produced_by.add().MergeFromString(producer)
        self._items[item_id] = item
        thread.msg.conversation_item_ids.append(item_id)
        thread.items.register(item_id, info.key, responses_item_id)
        return item_id

    # -- handlers -------------------------------------------------------------------------

    def _on_header(self, record: _Record) -> None:
        header = record_pb2.Header()
        header.CopyFrom(record.header)
        self._header = header
        created = header.created_at
        self._base_us = created.seconds * 1_000_000 + created.nanos // 1000
        _check_time(record.seq, self._base_us, "the header's created_at")
        self._handlers = Reducer._AFTER_HEADER

    def _on_footer(self, record: _Record) -> None:
        # The reader checks the count; the footer adds nothing to the state.
        pass

    def _on_payload(self, record: _Record) -> None:
        # Every kind is kept: the writer dedups by content, not kind, so an item may refer to
        # bytes first written as another kind.
        try:
            self._payloads.add(record.payload)
        except PayloadError as error:
            _fail(record, str(error))

    def _on_thread_started(self, record: _Record) -> None:
        body = record.thread_started
        _check_new(record, "thread", body.thread, self._threads, body.thread_id, self._thread_ids)
        micros = self._micros(record)
        msg = self._trace.threads[body.thread_id]
        msg.thread_id = body.thread_id
        msg.model = body.model
        msg.instructions_payload_id = body.instructions_payload_id
        msg.metadata.update(body.metadata)
        self._start(msg.execution, micros, record)
        thread = _Thread(msg)
        self._threads[body.thread] = thread
        self._thread_ids.add(body.thread_id)
        if self._fork_prefix is not None:
            self._seed_fork(thread, self._fork_prefix, record, micros)
            self._fork_prefix = None
            self._held[body.thread_id] = self._fork_tokens

    # -- forks --------------------------------------------------------------------------------

    def _on_thread_forked(self, record: _Record) -> None:
        body = record.thread_forked
        if self._fork is not None or self._threads:
            _fail(record, "thread_forked must come once, before thread_started")
        parent = self._forks.resolve(body) if self._forks is not None else None
        self.parent = parent
        self._fork = state_pb2.Fork(
            parent_thread_id=body.parent_thread_id,
            parent_bundle=body.parent_bundle,
            parent_trace_id=body.parent_trace_id,
            after_turn_id=body.after_turn_id,
            last_shared_item_id=body.last_shared_item_id,
            group_id=body.group_id,
            repetition_index=body.repetition_index,
            shared_items=len(body.prefix_payload_ids),
            # A copied prefix needs no parent.
            resolved=parent is not None or body.prefix_copied,
            resolved_from=str(parent.path) if parent is not None else "",
            resumed=body.resumed,
        )
        self._fork.ancestors.extend(fork_chain(body, parent))
        self._fork_prefix = list(body.prefix_payload_ids)
        self._fork_seq = record.seq
        self._fork_tokens = []
        if body.parent_token_count:
            parent_call = (
                parent.trace.inference_calls.get(body.parent_call_id)
                if parent is not None
                else None
            )
            seed = (
                [*parent_call.prompt_token_ids, *parent_call.output_tokens.ids]
                if parent_call is not None
                else []
            )
            self._fork_tokens = seed if len(seed) == body.parent_token_count else None

    def _seed_fork(self, thread: _Thread, prefix: list[str], record: _Record, micros: int) -> None:
        """The shared history becomes the thread's first items and its 'previous request', so
        the first request's input prefix matches it (read from the parent, or placeholders)."""
        infos = [self._item_info(pid, record) for pid in prefix]
        parents = self.parent.prefix_items(prefix) if self.parent is not None else []
        parent_thread = self._fork.parent_thread_id if self._fork is not None else ""

        def new_item(index: int) -> str:
            parent_item = parents[index] if index < len(parents) else None
            item_id = self._new_item(
                thread,
                parent_item.turn_id if parent_item is not None else "",
                infos[index],
                prefix[index],
                record,
                micros,
                responses_item_id=infos[index].responses_item_id
                or (parent_item.responses_item_id if parent_item is not None else ""),
                producer=b"",
            )
            item = self._items[item_id]
            item.inherited.parent_thread_id = parent_thread
            if parent_item is not None:
                item.inherited.parent_item_id = parent_item.item_id
                item.produced_by.extend(parent_item.produced_by)
            return item_id

        thread.items.match_request(infos, new_item)
        thread.inputs = list(prefix)

    def _on_prompt_tokens(self, record: _Record) -> None:
        body = record.prompt_tokens
        call = self._live_call(body.call, record)
        thread_id = call.turn.thread.thread_id
        held = self._held.get(thread_id, [])
        shared = body.prefix_count
        if held is None or shared > len(held):
            if held is not None and self._fork is None:
                _fail(record, f"prefix_count {shared} exceeds the {len(held)} held tokens")
            # A fork whose parent's tokens are missing: this prompt is unknown, and so is
            # every later one that builds on it.
            self._held[thread_id] = None if shared else list(body.ids)
            if not shared:
                call.msg.prompt_token_ids.extend(body.ids)
            return
        prompt = [*held[:shared], *body.ids]
        call.msg.prompt_token_ids.extend(prompt)
        call.msg.token_drift = body.drift
        call.msg.held_token_count = body.held_count
        if body.drift in (common_pb2.TOKEN_DRIFT_REALIGN, common_pb2.TOKEN_DRIFT_FORK):
            call.msg.drift_position = shared
        self._held[thread_id] = prompt

    def _on_reward_recorded(self, record: _Record) -> None:
        _fail(record, "reward_recorded belongs in rewards.binpb, not in the trace")

    def _sampling_of(self, envelope_id: str, record: _Record) -> common_pb2.SamplingSettings:
        settings = self._sampling.get(envelope_id)
        if settings is None:
            settings = common_pb2.SamplingSettings()
            data = self._payload(envelope_id, record) if envelope_id else None
            if data is not None:
                try:
                    envelope: Any = payload_json(data)
                except ValueError:
                    envelope = None
                if isinstance(envelope, dict):
                    settings = sampling_settings(envelope)
            self._sampling[envelope_id] = settings
        return settings

    def _on_turn_started(self, record: _Record) -> None:
        body = record.turn_started
        turn_id = body.turn_id
        _check_new(record, "turn", body.turn, self._turns, turn_id, self._turn_ids)
        thread = self._thread(body.thread, record)
        if thread.ended:
            _fail(record, f"turn started on thread {thread.msg.thread_id}, which has ended")
        # Looked up before anything changes, so a missing payload leaves the state as it was.
        inputs = [(pid, self._item_info(pid, record)) for pid in body.input_payload_ids]
        micros = self._micros(record)
        msg = self._trace.turns[turn_id]
        msg.turn_id = turn_id
        msg.thread_id = thread.thread_id
        if body.traceparent:
            msg.traceparent = body.traceparent
        self._start(msg.execution, micros, record)
        producer = _producer_ref("user_input", turn_id)
        for pid, info in inputs:
            msg.input_item_ids.append(
                self._new_item(
                    thread,
                    turn_id,
                    info,
                    pid,
                    record,
                    micros,
                    responses_item_id=info.responses_item_id,
                    producer=producer,
                )
            )
        thread.msg.turn_ids.append(turn_id)
        self._turns[body.turn] = _Turn(msg, thread)
        self._turn_ids.add(turn_id)

    def _on_inference_started(self, record: _Record) -> None:
        body = record.inference_started
        call_id = body.inference_call_id
        _check_new(record, "inference call", body.call, self._calls, call_id, self._call_ids)
        turn = self._turn(body.turn, record)
        if turn.ended:
            _fail(record, f"inference started in turn {turn.msg.turn_id}, which has ended")
        thread = turn.thread
        turn_id = turn.turn_id
        envelope_id = body.request_envelope_payload_id
        sampling = self._sampling_of(envelope_id, record)
        known = body.input_prefix_count
        if known > len(thread.inputs):
            _fail(
                record,
                f"input_prefix_count {known} exceeds the {len(thread.inputs)} inputs of the "
                "previous call",
            )
        new_pids = list(body.input_payload_ids)
        micros = self._micros(record)
        # Looked up before anything changes, so a missing payload leaves the state as it was.
        infos = [self._item_info(pid, record) for pid in new_pids]
        msg = self._trace.inference_calls[call_id]
        msg.inference_call_id = call_id
        msg.thread_id = thread.thread_id
        msg.turn_id = turn_id
        msg.attempt = body.attempt
        msg.model = body.model
        msg.provider_base_url = body.provider_base_url
        msg.request_envelope_payload_id = envelope_id
        if body.policy_version:
            msg.policy_version = body.policy_version
        msg.sampling.CopyFrom(sampling)
        self._start(msg.execution, micros, record)

        def new_item(index: int) -> str:
            info = infos[index]
            return self._new_item(
                thread,
                turn_id,
                info,
                new_pids[index],
                record,
                micros,
                responses_item_id=info.responses_item_id,
                producer=b"",
            )

        # Held as the compact form: the previous call's first `known` inputs, then these. A
        # conversation re-sends its history every time; holding it whole would make the state
        # grow with the square of its length. A fork's first call starts with the history it
        # shares with its parent, which no call of this bundle sent: that one is held whole.
        seeded = bool(known) and not thread.last_call
        if seeded:
            msg.request_item_ids.extend(thread.items.previous_ids(known))
            msg.input_payload_ids.extend(thread.inputs[:known])
        msg.request_item_ids.extend(thread.items.match_request(infos, new_item, known=known))
        msg.input_payload_ids.extend(new_pids)
        if known and not seeded:
            msg.request_prefix_call_id = thread.last_call
            msg.request_prefix_count = known
        del thread.inputs[known:]
        thread.inputs.extend(new_pids)
        thread.last_call = call_id
        call = _Call(body.call, msg, turn)
        turn.msg.inference_call_ids.append(call_id)
        turn.calls.append(call)
        self._calls[body.call] = call
        self._call_ids.add(call_id)

    def _on_response_created(self, record: _Record) -> None:
        body = record.response_created
        self._live_call(body.call, record).msg.response_id = body.response_id

    def _on_output_item_added(self, record: _Record) -> None:
        body = record.output_item_added
        call = self._live_call(body.call, record)
        if not body.item:
            _fail(record, "output_item_added without an item ordinal")
        if body.item in self._outputs:
            _fail(record, f"duplicate output item ordinal {body.item}")
        output = _Output(call, body.provider_item_id, body.item_type, body.role, announced=True)
        self._outputs[body.item] = output
        call.open[output] = None
        self._set_latest(call, output)

    def _set_latest(self, call: _Call, output: _Output | None) -> None:
        call.latest = output
        if output is None or output.parts is None or call.ended:
            self._streaming.pop(call.ordinal, None)
        else:
            self._streaming[call.ordinal] = output

    def _on_output_text_delta(self, record: _Record) -> None:
        # The hot path: most records of a bundle are deltas, nearly all for their call's latest
        # item, whose text list is kept at hand for them.
        body = record.output_text_delta
        if body.HasField("tokens"):
            self._on_token_delta(record)
            return
        ordinal = body.item
        if not ordinal:
            latest = self._streaming.get(body.call)
            if latest is not None:
                parts = latest.parts
                assert parts is not None
                parts.append(body.delta)
                if len(parts) >= _JOIN_EVERY:
                    latest.join()
                return
        if ordinal:
            output = self._outputs.get(ordinal)
            if output is None or output.call.ordinal != body.call:
                _fail(record, f"unknown output item ordinal {ordinal} for call {body.call}")
            if output.call.ended:
                self._live_call(body.call, record)  # raises: the call has ended
        else:
            call = self._live_call(body.call, record)
            output = call.latest
            if output is None:
                output = self._unannounced(call)
        output.add(body.delta)

    def _on_token_delta(self, record: _Record) -> None:
        """A delta with its tokens: the text as any delta's, the tokens to its call, tagged
        with the output they belong to."""
        body = record.output_text_delta
        if body.item:
            output = self._outputs.get(body.item)
            if output is None or output.call.ordinal != body.call:
                _fail(record, f"unknown output item ordinal {body.item} for call {body.call}")
            call = self._live_call(body.call, record)
        else:
            call = self._live_call(body.call, record)
            output = call.latest if call.latest is not None else self._unannounced(call)
        if body.delta:
            output.add(body.delta)
        if call.tokens is None:
            call.tokens = TokenAccumulator()
        call.tokens.add(output, body.tokens, body.delta)
        if body.tokens.ids:
            held = self._held.setdefault(call.turn.thread.thread_id, [])
            if held is not None:
                held.extend(body.tokens.ids)

    def _unannounced(self, call: _Call) -> _Output:
        # Text that arrived before any item was announced still belongs somewhere visible.
        output = _Output(call, "", "", "", announced=False)
        call.open[output] = None
        self._set_latest(call, output)
        return output

    def _on_output_item_done(self, record: _Record) -> None:
        body = record.output_item_done
        call = self._live_call(body.call, record)
        output: _Output | None = None
        if body.item:
            output = self._outputs.get(body.item)
            if output is None or output.call is not call:
                _fail(record, f"unknown output item ordinal {body.item} for call {body.call}")
            if output.parts is None:
                _fail(record, f"output item ordinal {body.item} is already done")
        elif (
            (latest := call.latest) is not None
            and not latest.announced
            and latest.parts is not None
        ):
            # Item 0 is the item never announced: the one its unannounced deltas went to.
            output = latest
        pid = body.item_payload_id
        info = self._item_info(pid, record) if pid else self._synthesised(output)
        micros = self._micros(record)
        item_id = body.item_id or (output.provider_item_id if output else "")
        item_id = item_id or info.responses_item_id
        turn = call.turn
        producer = call.producer
        if not producer:
            # One for all of the call's items: each is copied into the item that names it.
            producer = call.producer = _producer_ref("inference", call.msg.inference_call_id)
        accepted = self._new_item(
            turn.thread,
            turn.turn_id,
            info,
            pid,
            record,
            micros,
            responses_item_id=item_id,
            producer=producer,
        )
        call.msg.response_item_ids.append(accepted)
        if output is not None and call.tokens is not None:
            call.tokens.name(output, accepted)
        if pid:
            call.msg.output_payload_ids.append(pid)
        if output is not None:
            output.parts = None
            output.chunks.clear()
            del call.open[output]
            if output is call.latest:
                self._streaming.pop(call.ordinal, None)

    @staticmethod
    def _synthesised(output: _Output | None) -> ItemInfo:
        # A done record without its payload: describe the item from what was streamed.
        item: dict[str, object] = {"type": output.item_type if output else "message"}
        if output is not None:
            if output.role:
                item["role"] = output.role
            if output.provider_item_id:
                item["id"] = output.provider_item_id
            item["content"] = [{"type": "output_text", "text": output.text()}]
        return parse_item(json.dumps(item).encode())

    def _on_provider_event(self, record: _Record) -> None:
        self._live_call(record.provider_event.call, record)

    def _end_call(
        self, call: _Call, status: common_pb2.ExecutionStatus.ValueType, record: _Record
    ) -> None:
        self._end(call.msg.execution, status, record)
        msg = call.msg
        if not msg.stop_reason:
            msg.stop_reason = classify_stop(
                status,
                reason=msg.end_reason,
                error_code=msg.error.code,
                http_status=msg.error.http_status,
            )
        discarded = call.msg.discarded_outputs
        for output in call.open:
            discarded.append(output.discarded())
            output.parts = None
            output.chunks.clear()
        call.open.clear()
        # The output points back at its call: kept, the pair would wait for the cycle collector.
        call.latest = None
        call.ended = True
        self._streaming.pop(call.ordinal, None)

    def _on_inference_ended(self, record: _Record) -> None:
        body = record.inference_ended
        call = self._live_call(body.call, record)
        msg = call.msg
        if body.response_id:
            msg.response_id = body.response_id
        if body.HasField("usage"):
            msg.usage.CopyFrom(body.usage)
        if body.HasField("error"):
            msg.error.CopyFrom(body.error)
        msg.end_reason = body.reason
        msg.stop_reason = body.stop_reason
        self._end_call(call, body.status, record)

    def _on_interrupt_requested(self, record: _Record) -> None:
        body = record.interrupt_requested
        turn = self._turn(body.turn, record)
        msg = turn.msg
        # Several may ask (a client, then the shutdown); the first one is what stopped it.
        if not msg.HasField("interrupt"):
            msg.interrupt.requested_by = body.requested_by
            self._stamp(msg.interrupt.requested_at, record)
            msg.interrupt.seq = record.seq

    def _on_turn_ended(self, record: _Record) -> None:
        body = record.turn_ended
        turn = self._turn(body.turn, record)
        if turn.ended:
            _fail(record, f"turn {turn.msg.turn_id} has already ended")
        if body.HasField("error"):
            turn.msg.error.CopyFrom(body.error)
        self._end(turn.msg.execution, body.status, record)
        turn.ended = True
        for call in turn.calls:
            if not call.ended:
                self._end_call(call, body.status, record)
        for tool_call in turn.tool_calls:
            if not tool_call.ended:
                self._end(tool_call.msg.execution, body.status, record)
                tool_call.ended = True
        # Only ending them needs the lists, and their calls point back at the turn.
        turn.calls.clear()
        turn.tool_calls.clear()

    # -- tool calls -------------------------------------------------------------------------

    def _on_tool_call_started(self, record: _Record) -> None:
        body = record.tool_call_started
        _check_new(
            record,
            "tool call",
            body.tool_call,
            self._tool_calls,
            body.tool_call_id,
            self._tool_call_ids,
        )
        call = self._live_call(body.call, record)
        turn = call.turn
        micros = self._micros(record)
        msg = self._trace.tool_calls[body.tool_call_id]
        msg.tool_call_id = body.tool_call_id
        msg.call_id = body.call_id
        msg.name = body.name
        msg.thread_id = turn.thread.thread_id
        msg.turn_id = turn.turn_id
        msg.requested_by_inference_call_id = call.msg.inference_call_id
        msg.arguments_payload_id = body.arguments_payload_id
        # The function_call item the same call accepted just before.
        for item_id in reversed(call.msg.response_item_ids):
            if self._items[item_id].responses_item_id == body.item_id:
                msg.call_item_id = item_id
                break
        self._start(msg.execution, micros, record)
        tool_call = _ToolCall(msg, turn)
        self._tool_calls[body.tool_call] = tool_call
        self._tool_call_ids.add(body.tool_call_id)
        turn.tool_calls.append(tool_call)
        turn.msg.tool_call_ids.append(body.tool_call_id)

    def _live_tool_call(self, ordinal: int, record: _Record) -> _ToolCall:
        tool_call = self._tool_calls.get(ordinal)
        if tool_call is None:
            _fail(record, f"unknown tool call ordinal {ordinal}")
        if tool_call.ended:
            _fail(record, f"tool call {tool_call.msg.tool_call_id} has already ended")
        return tool_call

    def _tool_output(self, tool_call: _ToolCall, payload_id: str, record: _Record) -> None:
        """The function_call_output item that answers the call, produced by the tool call."""
        info = self._item_info(payload_id, record)
        micros = self._micros(record)
        turn = tool_call.turn
        producer = _producer_ref("tool", tool_call.msg.tool_call_id)
        tool_call.msg.output_item_id = self._new_item(
            turn.thread,
            turn.turn_id,
            info,
            payload_id,
            record,
            micros,
            responses_item_id=info.responses_item_id,
            producer=producer,
        )
        tool_call.msg.output_payload_id = payload_id

    def _on_tool_output_submitted(self, record: _Record) -> None:
        body = record.tool_output_submitted
        tool_call = self._live_tool_call(body.tool_call, record)
        if tool_call.msg.output_item_id:
            _fail(record, f"tool call {tool_call.msg.tool_call_id} already has an output")
        self._tool_output(tool_call, body.output_item_payload_id, record)
        tool_call.msg.is_error = body.is_error
        tool_call.msg.submitted_by = body.submitted_by

    def _on_tool_call_ended(self, record: _Record) -> None:
        body = record.tool_call_ended
        tool_call = self._live_tool_call(body.tool_call, record)
        if body.output_item_payload_id and not tool_call.msg.output_item_id:
            self._tool_output(tool_call, body.output_item_payload_id, record)
        if body.HasField("error"):
            tool_call.msg.error.CopyFrom(body.error)
        self._end(tool_call.msg.execution, body.status, record)
        tool_call.ended = True

    def _on_thread_ended(self, record: _Record) -> None:
        body = record.thread_ended
        thread = self._thread(body.thread, record)
        if thread.ended:
            _fail(record, f"thread {thread.msg.thread_id} has already ended")
        self._end(thread.msg.execution, body.status, record)
        thread.ended = True

    # The handlers by record body, as plain functions: bound methods kept on the instance
    # would make a cycle, and every reduction's whole working set would then wait for the
    # cycle collector instead of going when the reducer does.
    _BEFORE_HEADER: ClassVar[_Handlers] = {"header": _on_header}
    _AFTER_HEADER: ClassVar[_Handlers] = {
        "footer": _on_footer,
        "payload": _on_payload,
        "thread_started": _on_thread_started,
        "turn_started": _on_turn_started,
        "inference_started": _on_inference_started,
        "response_created": _on_response_created,
        "output_item_added": _on_output_item_added,
        "output_text_delta": _on_output_text_delta,
        "output_item_done": _on_output_item_done,
        "provider_event": _on_provider_event,
        "inference_ended": _on_inference_ended,
        "interrupt_requested": _on_interrupt_requested,
        "turn_ended": _on_turn_ended,
        "thread_ended": _on_thread_ended,
        "tool_call_started": _on_tool_call_started,
        "tool_output_submitted": _on_tool_output_submitted,
        "tool_call_ended": _on_tool_call_ended,
        "thread_forked": _on_thread_forked,
        "prompt_tokens": _on_prompt_tokens,
        "reward_recorded": _on_reward_recorded,
    }
