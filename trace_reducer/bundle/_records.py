"""RecordBuilder: the bundle's vocabulary, one typed method per record body, ordinals included."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

from rollout.trace.v1 import common_pb2, record_pb2

from ._payloads import canonical_json, payload_id
from ._tokens import token_drift, token_texts

Status: TypeAlias = common_pb2.ExecutionStatus.ValueType
PayloadKind: TypeAlias = record_pb2.PayloadKind.ValueType
DeltaKind: TypeAlias = record_pb2.DeltaKind.ValueType
StopReason: TypeAlias = common_pb2.StopReason.ValueType

TEXT_MEDIA_TYPE = "text/plain; charset=utf-8"
# Text longer than this goes into several delta records: at most 4 bytes a character keeps
# each far below the record limit.
MAX_DELTA_CHARS = 256 * 1024
# Provider event data longer than this is written as a (chunked) payload the record refers to.
MAX_INLINE_EVENT_CHARS = 256 * 1024


class RecordSink(Protocol):
    """Where built records go: a BundleWriter, or anything that frames them the same way."""

    def append(self, record: record_pb2.TraceRecord) -> int: ...

    def put_payload(
        self, data: bytes, kind: PayloadKind, media_type: str = "application/json"
    ) -> str: ...


class RecordBuilder:
    """Builds each record the way the format expects and hands it to a sink.

    It owns what a record's fields depend on beyond the moment: the ordinals it assigns to
    threads, turns, inference calls and output items; the input each thread's latest call
    sent (a request records only what follows the part it shares with that one); which item
    of a call was added last (a delta for it refers to item 0); and the payloads, written as
    canonical JSON before the first record that refers to them.
    """

    def __init__(self, sink: RecordSink) -> None:
        self._sink = sink
        # A sink that frames a text delta without a message (BundleWriter) is given them so.
        self._append_text_delta: Callable[[int, int, str, int], int] | None = getattr(
            sink, "append_text_delta", None
        )
        self._threads = 0
        self._turns = 0
        self._calls = 0
        self._items = 0
        self._tool_calls = 0
        self._thread_of_turn: dict[int, int] = {}
        # The complete input of each thread's latest inference call.
        self._inputs: dict[int, list[Mapping[str, Any]]] = {}
        # Each live call's most recently added output item.
        self._latest_item: dict[int, int] = {}
        # A fork's shared history: the input prefix of its thread's first request.
        self._fork_prefix: list[Mapping[str, Any]] | None = None
        self._fork_tokens: list[int] | None = None
        # Each thread's held tokens: its latest prompt's ids, then every output id since.
        self._held: dict[int, list[int]] = {}
        # How many of them are its latest prompt's (the rest are output ids).
        self._held_prompt: dict[int, int] = {}
        self._thread_of_call: dict[int, int] = {}
        self._latest_call_id: dict[int, str] = {}

    # -- payloads ------------------------------------------------------------------------------

    def json_payload(self, obj: Any, kind: PayloadKind) -> str:
        """Write obj as a canonical JSON payload (once per bundle); return its id."""
        return self._sink.put_payload(canonical_json(obj), kind)

    # -- contexts ------------------------------------------------------------------------------

    def thread_started(
        self, thread_id: str, *, model: str, instructions: str, metadata: Mapping[str, str]
    ) -> int:
        self._threads += 1
        started = record_pb2.ThreadStarted(
            thread=self._threads, thread_id=thread_id, model=model, metadata=dict(metadata)
        )
        if instructions:
            started.instructions_payload_id = self._sink.put_payload(
                instructions.encode(), record_pb2.PAYLOAD_KIND_INSTRUCTIONS, TEXT_MEDIA_TYPE
            )
        self._sink.append(record_pb2.TraceRecord(thread_started=started))
        if self._fork_prefix is not None:
            self._inputs[self._threads] = self._fork_prefix
            self._fork_prefix = None
        if self._fork_tokens is not None:
            self._held[self._threads] = self._fork_tokens
            self._fork_tokens = None
        return self._threads

    def held_tokens(self, thread: int) -> tuple[str, list[int]]:
        """(the thread's latest inference call id, its held tokens): what a fork continues."""
        return self._latest_call_id.get(thread, ""), list(self._held.get(thread, ()))

    def thread_forked(
        self,
        *,
        parent_thread_id: str,
        parent_bundle: str,
        parent_trace_id: str,
        after_turn_id: str,
        group_id: str,
        repetition_index: int,
        shared_turns: int,
        prefix_items: Sequence[Mapping[str, Any]],
        copy_prefix: bool,
        parent_call_id: str = "",
        parent_tokens: Sequence[int] = (),
        resumed: bool = False,
    ) -> None:
        """The thread about to start continues another's history `prefix_items`: recorded by
        payload id only (the parent's bundle has them) unless copy_prefix; the thread's first
        request then records them as its input prefix. Call it before thread_started.
        resumed: the parent's conversation goes on here (ResumeThread), not as a sample."""
        ids = [
            self.json_payload(item, record_pb2.PAYLOAD_KIND_INPUT_ITEM)
            if copy_prefix
            else payload_id(canonical_json(item))
            for item in prefix_items
        ]
        last_id = prefix_items[-1].get("id") if prefix_items else None
        self._sink.append(
            record_pb2.TraceRecord(
                thread_forked=record_pb2.ThreadForked(
                    parent_thread_id=parent_thread_id,
                    parent_bundle=parent_bundle,
                    parent_trace_id=parent_trace_id,
                    after_turn_id=after_turn_id,
                    last_shared_item_id=last_id if isinstance(last_id, str) else "",
                    group_id=group_id,
                    repetition_index=repetition_index,
                    prefix_payload_ids=ids,
                    prefix_copied=copy_prefix,
                    shared_turns=shared_turns,
                    parent_call_id=parent_call_id if parent_tokens else "",
                    parent_token_count=len(parent_tokens),
                    resumed=resumed,
                )
            )
        )
        self._fork_prefix = list(prefix_items)
        self._fork_tokens = list(parent_tokens)

    def turn_started(
        self,
        thread: int,
        turn_id: str,
        input_items: Sequence[Mapping[str, Any]],
        *,
        traceparent: str = "",
    ) -> int:
        """Record a turn's start; a `traceparent` that is not a valid W3C one is left out."""
        self._turns += 1
        self._thread_of_turn[self._turns] = thread
        ids = [self.json_payload(item, record_pb2.PAYLOAD_KIND_INPUT_ITEM) for item in input_items]
        self._sink.append(
            record_pb2.TraceRecord(
                turn_started=record_pb2.TurnStarted(
                    turn=self._turns,
                    thread=thread,
                    turn_id=turn_id,
                    input_payload_ids=ids,
                    traceparent=traceparent if parse_traceparent(traceparent) else "",
                )
            )
        )
        return self._turns

    def inference_started(
        self,
        turn: int,
        *,
        inference_call_id: str,
        attempt: int,
        model: str,
        provider_base_url: str,
        envelope: Mapping[str, Any],
        input_items: Sequence[Mapping[str, Any]],
        policy_version: str = "",
        provider_api: str = "",
        input_as_string: bool = False,
    ) -> int:
        """An attempt about to send `envelope` with `input` = input_items (the whole history);
        input_as_string: it sends `input` as the string that is the one user message of
        input_items (InferenceStarted.input_as_string).

        Only what follows the part shared with the thread's previous request is recorded, so a
        bundle grows with the conversation, not with its square.
        """
        previous = self._inputs.get(self._thread_of_turn.get(turn, 0), [])
        prefix = _shared_prefix(previous, input_items)
        return self.inference_started_after_prefix(
            turn,
            inference_call_id=inference_call_id,
            attempt=attempt,
            model=model,
            provider_base_url=provider_base_url,
            envelope=envelope,
            prefix_count=prefix,
            new_items=input_items[prefix:],
            policy_version=policy_version,
            provider_api=provider_api,
            input_as_string=input_as_string,
        )

    def inference_started_after_prefix(
        self,
        turn: int,
        *,
        inference_call_id: str,
        attempt: int,
        model: str,
        provider_base_url: str,
        envelope: Mapping[str, Any],
        prefix_count: int,
        new_items: Sequence[Mapping[str, Any]],
        policy_version: str = "",
        provider_api: str = "",
        input_as_string: bool = False,
    ) -> int:
        """The record exactly as given: prefix_count items of the previous input, then new_items."""
        self._calls += 1
        thread = self._thread_of_turn.get(turn, 0)
        self._thread_of_call[self._calls] = thread
        self._latest_call_id[thread] = inference_call_id
        envelope_id = self.json_payload(envelope, record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE)
        ids = [self.json_payload(item, record_pb2.PAYLOAD_KIND_INPUT_ITEM) for item in new_items]
        self._inputs[thread] = [*self._inputs.get(thread, [])[:prefix_count], *new_items]
        self._sink.append(
            record_pb2.TraceRecord(
                inference_started=record_pb2.InferenceStarted(
                    call=self._calls,
                    turn=turn,
                    inference_call_id=inference_call_id,
                    attempt=attempt,
                    model=model,
                    provider_base_url=provider_base_url,
                    request_envelope_payload_id=envelope_id,
                    input_payload_ids=ids,
                    input_prefix_count=prefix_count,
                    policy_version=policy_version,
                    provider_api=provider_api,
                    input_as_string=input_as_string,
                )
            )
        )
        return self._calls

    def prompt_tokens(self, call: int, ids: Sequence[int]) -> None:
        """The engine's token ids of the prompt of `call`: only what follows the part it shares
        with the thread's held tokens is written."""
        thread = self._thread_of_call.get(call, 0)
        held = self._held.get(thread, [])
        shared = 0
        for before, now in zip(held, ids, strict=False):
            if before != now:
                break
            shared += 1
        self._sink.append(
            record_pb2.TraceRecord(
                prompt_tokens=record_pb2.PromptTokens(
                    call=call,
                    ids=ids[shared:],
                    prefix_count=shared,
                    drift=token_drift(shared, len(held), self._held_prompt.get(thread, 0)),
                    held_count=len(held),
                )
            )
        )
        self._held[thread] = list(ids)
        self._held_prompt[thread] = len(ids)

    # -- provider events -----------------------------------------------------------------------

    def response_created(self, call: int, response_id: str) -> None:
        self._sink.append(
            record_pb2.TraceRecord(
                response_created=record_pb2.ResponseCreated(call=call, response_id=response_id)
            )
        )

    def output_item_added(
        self,
        call: int,
        *,
        provider_item_id: str,
        item_type: str,
        role: str,
        output_index: int = 0,
    ) -> int:
        self._items += 1
        self._latest_item[call] = self._items
        self._sink.append(
            record_pb2.TraceRecord(
                output_item_added=record_pb2.OutputItemAdded(
                    call=call,
                    item=self._items,
                    provider_item_id=provider_item_id,
                    item_type=item_type,
                    role=role,
                    output_index=output_index,
                )
            )
        )
        return self._items

    def output_text_delta(
        self,
        call: int,
        item: int,
        delta: str,
        *,
        kind: DeltaKind = record_pb2.DELTA_KIND_UNSPECIFIED,
        tokens: common_pb2.DeltaTokens | None = None,
    ) -> None:
        """Text of `kind` for output item `item` of `call` (0: the call's latest item, or an
        unannounced one). The latest item is referred to as 0: the common case, and the
        cheapest. Text too long for one record is split over several (its tokens, if any,
        go with the last piece, their strings spelled out)."""
        if len(delta) > MAX_DELTA_CHARS:
            pieces = [delta[i : i + MAX_DELTA_CHARS] for i in range(0, len(delta), MAX_DELTA_CHARS)]
            for piece in pieces[:-1]:
                self.output_text_delta(call, item, piece, kind=kind)
            if tokens is not None and tokens.text_lengths:
                spelled = common_pb2.DeltaTokens()
                spelled.CopyFrom(tokens)
                spelled.ClearField("text_lengths")
                spelled.texts.extend(token_texts(tokens, delta))
                tokens = spelled
            self.output_text_delta(call, item, pieces[-1], kind=kind, tokens=tokens)
            return
        if item == self._latest_item.get(call):
            item = 0
        if tokens is None and self._append_text_delta is not None:
            # The record of every provider read: framed by hand, no message built.
            self._append_text_delta(call, item, delta, kind)
            return
        # Filled in place: a body passed to the constructor would be built, then copied.
        record = record_pb2.TraceRecord()
        body = record.output_text_delta
        body.call = call
        body.item = item
        body.delta = delta
        if kind:
            body.kind = kind
        if tokens is not None:
            body.tokens.CopyFrom(tokens)
        self._sink.append(record)
        if tokens is not None and tokens.ids:
            self._held.setdefault(self._thread_of_call.get(call, 0), []).extend(tokens.ids)

    def output_item_done(
        self, call: int, item: int, *, item_id: str, assigned: bool, payload: Mapping[str, Any]
    ) -> None:
        """Accept an output item (`item` 0: one never announced as added) with its JSON."""
        payload_ref = self.json_payload(payload, record_pb2.PAYLOAD_KIND_OUTPUT_ITEM)
        self._sink.append(
            record_pb2.TraceRecord(
                output_item_done=record_pb2.OutputItemDone(
                    call=call,
                    item=item,
                    item_id=item_id,
                    item_id_assigned=assigned,
                    item_payload_id=payload_ref,
                )
            )
        )

    def provider_event(self, call: int, event_type: str, data: str) -> None:
        """Any other event, verbatim: its data in the record, or in a payload when large."""
        event = record_pb2.ProviderEvent(call=call, event_type=event_type)
        if len(data) > MAX_INLINE_EVENT_CHARS:
            event.data_payload_id = self._sink.put_payload(
                data.encode(), record_pb2.PAYLOAD_KIND_PROVIDER_EVENT, TEXT_MEDIA_TYPE
            )
        else:
            event.data = data
        self._sink.append(record_pb2.TraceRecord(provider_event=event))

    # -- tool calls ----------------------------------------------------------------------------

    def tool_call_started(
        self,
        call: int,
        *,
        tool_call_id: str,
        call_id: str,
        name: str,
        item_id: str,
        arguments: str,
    ) -> int:
        """The function call item `item_id` that inference call `call` made, as a tool call."""
        self._tool_calls += 1
        started = record_pb2.ToolCallStarted(
            tool_call=self._tool_calls,
            call=call,
            tool_call_id=tool_call_id,
            call_id=call_id,
            name=name,
            item_id=item_id,
            arguments_payload_id=self._sink.put_payload(
                arguments.encode(), record_pb2.PAYLOAD_KIND_TOOL_ARGUMENTS, TEXT_MEDIA_TYPE
            ),
        )
        self._sink.append(record_pb2.TraceRecord(tool_call_started=started))
        return self._tool_calls

    def tool_output_submitted(
        self,
        tool_call: int,
        *,
        output_item: Mapping[str, Any],
        is_error: bool,
        submitted_by: str,
    ) -> None:
        """A client's output; output_item is the function_call_output item sent back."""
        self._sink.append(
            record_pb2.TraceRecord(
                tool_output_submitted=record_pb2.ToolOutputSubmitted(
                    tool_call=tool_call,
                    output_item_payload_id=self.json_payload(
                        output_item, record_pb2.PAYLOAD_KIND_TOOL_OUTPUT
                    ),
                    is_error=is_error,
                    submitted_by=submitted_by,
                )
            )
        )

    def tool_call_ended(
        self,
        tool_call: int,
        status: Status,
        *,
        error: common_pb2.TraceError | None = None,
        output_item: Mapping[str, Any] | None = None,
    ) -> None:
        """The tool call is over; output_item is what the agent sends back when no client did."""
        ended = record_pb2.ToolCallEnded(tool_call=tool_call, status=status)
        if error is not None:
            ended.error.CopyFrom(error)
        if output_item is not None:
            ended.output_item_payload_id = self.json_payload(
                output_item, record_pb2.PAYLOAD_KIND_TOOL_OUTPUT
            )
        self._sink.append(record_pb2.TraceRecord(tool_call_ended=ended))

    # -- endings -------------------------------------------------------------------------------

    def inference_ended(
        self,
        call: int,
        status: Status,
        *,
        reason: str,
        response_id: str = "",
        usage: common_pb2.TokenUsage | None = None,
        error: common_pb2.TraceError | None = None,
        stop_reason: StopReason = common_pb2.STOP_REASON_UNSPECIFIED,
    ) -> None:
        self._latest_item.pop(call, None)
        ended = record_pb2.InferenceEnded(
            call=call,
            status=status,
            response_id=response_id,
            reason=reason,
            stop_reason=stop_reason,
        )
        if usage is not None:
            ended.usage.CopyFrom(usage)
        if error is not None:
            ended.error.CopyFrom(error)
        self._sink.append(record_pb2.TraceRecord(inference_ended=ended))

    def interrupt_requested(self, turn: int, requested_by: str) -> None:
        self._sink.append(
            record_pb2.TraceRecord(
                interrupt_requested=record_pb2.InterruptRequested(
                    turn=turn, requested_by=requested_by
                )
            )
        )

    def turn_ended(
        self, turn: int, status: Status, error: common_pb2.TraceError | None = None
    ) -> None:
        ended = record_pb2.TurnEnded(turn=turn, status=status)
        if error is not None:
            ended.error.CopyFrom(error)
        self._sink.append(record_pb2.TraceRecord(turn_ended=ended))

    def thread_ended(self, thread: int, status: Status, reason: str) -> None:
        self._sink.append(
            record_pb2.TraceRecord(
                thread_ended=record_pb2.ThreadEnded(thread=thread, status=status, reason=reason)
            )
        )


def same_objects_prefix(previous: Sequence[object], current: Sequence[object]) -> int:
    """How many leading items of current are the very objects at the same places of previous,
    found in one C-level pass (a request re-sends the whole history)."""
    matches = list(map(operator.is_, previous, current))
    try:
        return matches.index(False)
    except ValueError:
        return len(matches)


def _shared_prefix(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> int:
    """How many leading items current shares with previous (usually the very same objects)."""
    # From the first object that is not the very same one on, equal ones count too.
    count = same_objects_prefix(previous, current)
    for before, now in zip(previous[count:], current[count:], strict=False):
        if before is not now and before != now:
            break
        count += 1
    return count


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(text: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C traceparent header, None unless it is valid
    (version ff, an all-zero id, or a version-00 header with more fields are invalid)."""
    match = _TRACEPARENT.fullmatch(text.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace, span = int(trace_id, 16), int(span_id, 16)
    if not trace or not span:
        return None
    return trace, span, int(flags, 16)
