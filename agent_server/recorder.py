"""Agent observations -> trace records, through trace_reducer's RecordBuilder and BundleWriter."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypeVar

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import (
    BundleWriter,
    RecordBuilder,
    RecordingError,
    RecordTooLargeError,
    __version__,
)

log = logging.getLogger(__name__)

PRODUCER_NAME = "rollout-trace agent-server"

Status: TypeAlias = common_pb2.ExecutionStatus.ValueType
DeltaKind: TypeAlias = record_pb2.DeltaKind.ValueType
_OUTPUT_TEXT = record_pb2.DELTA_KIND_UNSPECIFIED
_WRITE_ERRORS = (RecordingError, RecordTooLargeError, OSError)
_P = ParamSpec("_P")
_R = TypeVar("_R")


class Recorder:
    """Writes one thread's bundle through trace_reducer's RecordBuilder.

    After start it never raises: a failed write marks the recording FAILED (logged once) and
    later calls do nothing, so the thread keeps serving. The ordinals it returns are what the
    records use; while nothing is recorded they are 0.
    """

    def __init__(
        self, thread_id: str, writer: BundleWriter | None, builder: RecordBuilder | None
    ) -> None:
        self.thread_id = thread_id
        self._writer = writer
        self._builder = builder
        self._thread = 1
        self._error = ""
        self._closing = False
        self._io_lock = asyncio.Lock()

    @classmethod
    def off(cls, thread_id: str) -> Recorder:
        return cls(thread_id, None, None)

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

        def create() -> Recorder:
            writer = BundleWriter.create(
                trace_root, thread_id, producer_name=PRODUCER_NAME, producer_version=__version__
            )
            builder = RecordBuilder(writer)
            try:
                builder.thread_started(
                    thread_id, model=model, instructions=instructions, metadata=metadata
                )
            except (RecordingError, RecordTooLargeError) as error:
                # No thread will exist: neither may a bundle that says it started.
                writer.discard()
                raise RecordingError(str(error)) from error
            return cls(thread_id, writer, builder)

        return await asyncio.to_thread(create)

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

    def _live(self) -> RecordBuilder | None:
        """The builder while records may still be written."""
        if self._error or self._closing:
            return None
        return self._builder

    def _fail(self, error: BaseException) -> None:
        if not self._error:
            self._error = str(error) or type(error).__name__
            log.warning(
                "recording of thread %s failed, the thread keeps running unrecorded: %s",
                self.thread_id,
                self._error,
            )

    def _call(
        self,
        method: Callable[Concatenate[RecordBuilder, _P], _R],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _R | None:
        """Build and write a record unless recording is off or over; a failure ends it."""
        builder = self._live()
        if builder is None:
            return None
        try:
            return method(builder, *args, **kwargs)
        except _WRITE_ERRORS as error:
            self._fail(error)
            return None

    # -- records -------------------------------------------------------------------------------

    def turn_started(self, turn_id: str, input_items: Sequence[Mapping[str, Any]]) -> int:
        return self._call(RecordBuilder.turn_started, self._thread, turn_id, input_items) or 0

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
        ordinal = self._call(
            RecordBuilder.inference_started,
            turn,
            inference_call_id=call_id,
            attempt=attempt,
            model=model,
            provider_base_url=provider_base_url,
            envelope=envelope,
            input_items=input_items,
        )
        return ordinal or 0

    def response_created(self, call: int, response_id: str) -> None:
        self._call(RecordBuilder.response_created, call, response_id)

    def output_item_added(
        self, call: int, *, provider_item_id: str, item_type: str, role: str, output_index: int
    ) -> int:
        ordinal = self._call(
            RecordBuilder.output_item_added,
            call,
            provider_item_id=provider_item_id,
            item_type=item_type,
            role=role,
            output_index=output_index,
        )
        return ordinal or 0

    def output_text_delta(
        self, call: int, item: int, delta: str, *, kind: DeltaKind = _OUTPUT_TEXT
    ) -> None:
        # The hot path, called once per provider read: no generic dispatch.
        builder = self._live()
        if builder is not None:
            try:
                builder.output_text_delta(call, item, delta, kind=kind)
            except _WRITE_ERRORS as error:
                self._fail(error)

    def output_item_done(
        self, call: int, item: int, *, item_id: str, assigned: bool, payload: Mapping[str, Any]
    ) -> None:
        self._call(
            RecordBuilder.output_item_done,
            call,
            item,
            item_id=item_id,
            assigned=assigned,
            payload=payload,
        )

    def provider_event(self, call: int, event_type: str, data: str) -> None:
        self._call(RecordBuilder.provider_event, call, event_type, data)

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
        self._call(
            RecordBuilder.inference_ended,
            call,
            status,
            reason=reason,
            response_id=response_id,
            usage=usage,
            error=error,
        )

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
        ordinal = self._call(
            RecordBuilder.tool_call_started,
            call,
            tool_call_id=tool_call_id,
            call_id=call_id,
            name=name,
            item_id=item_id,
            arguments=arguments,
        )
        return ordinal or 0

    def tool_output_submitted(
        self, tool_call: int, *, output_item: Mapping[str, Any], is_error: bool, submitted_by: str
    ) -> None:
        self._call(
            RecordBuilder.tool_output_submitted,
            tool_call,
            output_item=output_item,
            is_error=is_error,
            submitted_by=submitted_by,
        )

    def tool_call_ended(
        self,
        tool_call: int,
        status: Status,
        *,
        error: common_pb2.TraceError | None = None,
        output_item: Mapping[str, Any] | None = None,
    ) -> None:
        self._call(
            RecordBuilder.tool_call_ended, tool_call, status, error=error, output_item=output_item
        )

    def interrupt_requested(self, turn: int, requested_by: str) -> None:
        self._call(RecordBuilder.interrupt_requested, turn, requested_by)

    def turn_ended(
        self, turn: int, status: Status, error: common_pb2.TraceError | None = None
    ) -> None:
        self._call(RecordBuilder.turn_ended, turn, status, error)

    # -- durability ----------------------------------------------------------------------------

    async def sync(self) -> None:
        """fsync in a worker thread: a slow disk must not stall every other thread's stream."""
        writer = self._writer
        if writer is None or self._live() is None:
            return
        async with self._io_lock:
            try:
                await asyncio.to_thread(writer.sync)
            except _WRITE_ERRORS as error:
                self._fail(error)

    async def finish(self, status: Status, reason: str) -> None:
        """Record thread_ended, then the footer; release the file even after a failure."""
        writer = self._writer
        if writer is None or writer.closed:
            return
        self._call(RecordBuilder.thread_ended, self._thread, status, reason)
        ok = not self._error
        # No append may race the close running in the worker thread.
        self._closing = True
        async with self._io_lock:
            try:
                await asyncio.to_thread(writer.close if ok else writer.abandon)
            except _WRITE_ERRORS as error:
                self._fail(error)
        # It holds the thread's last request input: nothing will be built from it again.
        self._builder = None
