"""Agent observations -> trace records, through the one BundleWriter of trace_reducer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import (
    BundleWriter,
    RecordingError,
    RecordTooLargeError,
    __version__,
    canonical_json,
    payload_id,
)

log = logging.getLogger(__name__)

PRODUCER_NAME = "rollout-trace agent-server"
_THREAD = 1
# A provider event this large is almost all duplicated output text; keeping its head keeps
# the recording going instead of failing it.
_PROVIDER_EVENT_KEEP = 1024 * 1024
_INSTRUCTIONS_MEDIA_TYPE = "text/plain; charset=utf-8"

Status: TypeAlias = common_pb2.ExecutionStatus.ValueType


class Recorder:
    """Writes one thread's bundle. After start it never raises: a failed write marks the
    recording FAILED (logged once) and later calls do nothing, so the thread keeps serving."""

    def __init__(self, thread_id: str, writer: BundleWriter | None) -> None:
        self.thread_id = thread_id
        self._writer = writer
        self._error = ""
        self._closing = False
        self._io_lock = asyncio.Lock()
        self._turns = 0
        self._calls = 0
        self._items = 0
        self._last_input: list[Mapping[str, Any]] = []

    @classmethod
    def off(cls, thread_id: str) -> Recorder:
        return cls(thread_id, None)

    @classmethod
    async def start(
        cls,
        trace_root: Path,
        thread_id: str,
        *,
        model: str,
        instructions: str,
        metadata: Mapping[str, str],
    ) -> Recorder:
        """Create the bundle and record thread_started; raise RecordingError when it cannot."""

        def create() -> BundleWriter:
            writer = BundleWriter.create(
                trace_root, thread_id, producer_name=PRODUCER_NAME, producer_version=__version__
            )
            try:
                started = record_pb2.ThreadStarted(
                    thread=_THREAD, thread_id=thread_id, model=model, metadata=dict(metadata)
                )
                if instructions:
                    started.instructions_payload_id = writer.put_payload(
                        instructions.encode(),
                        record_pb2.PAYLOAD_KIND_INSTRUCTIONS,
                        _INSTRUCTIONS_MEDIA_TYPE,
                    )
                writer.append(record_pb2.TraceRecord(thread_started=started))
            except (RecordingError, RecordTooLargeError) as error:
                writer.abandon()
                raise RecordingError(str(error)) from error
            return writer

        return cls(thread_id, await asyncio.to_thread(create))

    # -- state ---------------------------------------------------------------------------------

    @property
    def bundle_path(self) -> str:
        return str(self._writer.bundle_dir) if self._writer is not None else ""

    @property
    def status(self) -> agent_pb2.RecordingStatus.ValueType:
        if self._writer is None:
            return agent_pb2.RECORDING_STATUS_OFF
        if self._error:
            return agent_pb2.RECORDING_STATUS_FAILED
        if self._writer.closed:
            return agent_pb2.RECORDING_STATUS_CLOSED
        return agent_pb2.RECORDING_STATUS_ACTIVE

    @property
    def error(self) -> str:
        return self._error

    @property
    def _active(self) -> bool:
        return self._writer is not None and not self._error and not self._closing

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except (RecordingError, RecordTooLargeError, OSError) as error:
            self._fail(str(error) or type(error).__name__)

    def _fail(self, error: str) -> None:
        if not self._error:
            self._error = error
            log.warning(
                "recording of thread %s failed, the thread keeps running unrecorded: %s",
                self.thread_id,
                error,
            )

    def _append(self, record: record_pb2.TraceRecord) -> None:
        if self._active:
            assert self._writer is not None
            with self._guard():
                self._writer.append(record)

    def _payload(self, obj: Any, kind: record_pb2.PayloadKind.ValueType) -> str:
        data = canonical_json(obj)
        if not self._active:
            return payload_id(data)
        assert self._writer is not None
        with self._guard():
            return self._writer.put_payload(data, kind)
        return payload_id(data)

    # -- records -------------------------------------------------------------------------------

    def turn_started(self, turn_id: str, input_items: Sequence[Mapping[str, Any]]) -> int:
        self._turns += 1
        ids = [self._payload(item, record_pb2.PAYLOAD_KIND_INPUT_ITEM) for item in input_items]
        self._append(
            record_pb2.TraceRecord(
                turn_started=record_pb2.TurnStarted(
                    turn=self._turns, thread=_THREAD, turn_id=turn_id, input_payload_ids=ids
                )
            )
        )
        return self._turns

    def inference_started(
        self,
        turn: int,
        *,
        call_id: str,
        attempt: int,
        model: str,
        provider_base_url: str,
        envelope: Mapping[str, Any],
        input_items: Sequence[Mapping[str, Any]],
    ) -> int:
        self._calls += 1
        envelope_id = self._payload(envelope, record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE)
        # A request re-sends the history: record only what follows the previous request's
        # input, so the bundle grows with the conversation, not with its square.
        prefix = _shared_prefix(self._last_input, input_items)
        ids = [
            self._payload(item, record_pb2.PAYLOAD_KIND_INPUT_ITEM) for item in input_items[prefix:]
        ]
        self._last_input = list(input_items)
        self._append(
            record_pb2.TraceRecord(
                inference_started=record_pb2.InferenceStarted(
                    call=self._calls,
                    turn=turn,
                    inference_call_id=call_id,
                    attempt=attempt,
                    model=model,
                    provider_base_url=provider_base_url,
                    request_envelope_payload_id=envelope_id,
                    input_payload_ids=ids,
                    input_prefix_count=prefix,
                )
            )
        )
        return self._calls

    def response_created(self, call: int, response_id: str) -> None:
        self._append(
            record_pb2.TraceRecord(
                response_created=record_pb2.ResponseCreated(call=call, response_id=response_id)
            )
        )

    def output_item_added(
        self, call: int, *, provider_item_id: str, item_type: str, role: str, output_index: int
    ) -> int:
        self._items += 1
        self._append(
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

    def output_text_delta(self, call: int, item: int, delta: str) -> None:
        """item 0 = the call's most recently added item (the common case, and the cheapest)."""
        # Filled in place: a body passed to the constructor would be built, then copied.
        record = record_pb2.TraceRecord()
        body = record.output_text_delta
        body.call = call
        body.item = item
        body.delta = delta
        self._append(record)

    def output_item_done(
        self, call: int, item: int, *, item_id: str, assigned: bool, payload: Mapping[str, Any]
    ) -> None:
        payload_ref = self._payload(payload, record_pb2.PAYLOAD_KIND_OUTPUT_ITEM)
        self._append(
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
        if not self._active:
            return
        assert self._writer is not None
        event = record_pb2.ProviderEvent(call=call, event_type=event_type, data=data)
        with self._guard():
            try:
                self._writer.append(record_pb2.TraceRecord(provider_event=event))
            except RecordTooLargeError:
                event.data = data[:_PROVIDER_EVENT_KEEP] + f"...[truncated from {len(data)} chars]"
                self._writer.append(record_pb2.TraceRecord(provider_event=event))

    def inference_ended(
        self,
        call: int,
        status: Status,
        *,
        reason: str,
        response_id: str = "",
        usage: common_pb2.TokenUsage | None = None,
        error: common_pb2.TraceError | None = None,
    ) -> None:
        ended = record_pb2.InferenceEnded(
            call=call, status=status, response_id=response_id, reason=reason
        )
        if usage is not None:
            ended.usage.CopyFrom(usage)
        if error is not None:
            ended.error.CopyFrom(error)
        self._append(record_pb2.TraceRecord(inference_ended=ended))

    def interrupt_requested(self, turn: int, requested_by: str) -> None:
        self._append(
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
        self._append(record_pb2.TraceRecord(turn_ended=ended))

    # -- durability ----------------------------------------------------------------------------

    async def sync(self) -> None:
        """fsync in a worker thread: a slow disk must not stall every other thread's stream."""
        if not self._active:
            return
        writer = self._writer
        assert writer is not None
        async with self._io_lock:
            with self._guard():
                await asyncio.to_thread(writer.sync)

    async def finish(self, status: Status, reason: str) -> None:
        """Record thread_ended, then the footer; release the file even after a failure."""
        writer = self._writer
        if writer is None or writer.closed:
            return
        self._append(
            record_pb2.TraceRecord(
                thread_ended=record_pb2.ThreadEnded(thread=_THREAD, status=status, reason=reason)
            )
        )
        ok = not self._error
        # No append may race the close running in the worker thread.
        self._closing = True
        async with self._io_lock:
            with self._guard():
                await asyncio.to_thread(writer.close if ok else writer.abandon)


def _shared_prefix(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> int:
    """How many leading items current shares with previous (the history is the same objects)."""
    count = 0
    for before, now in zip(previous, current, strict=False):
        if before is not now and before != now:
            break
        count += 1
    return count
