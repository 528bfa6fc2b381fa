"""Agent observations -> trace records, through trace_reducer's RecordBuilder and BundleWriter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypeVar

from agent_server import telemetry
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


class _DiskThreads:
    """The threads recording's blocking calls run on (a bundle's create, its fsyncs, its close):
    a queue and a few threads of its own, each call's result handed back to the loop.

    asyncio.to_thread's trip through the loop's default executor costs about twice the CPU (a
    context copied, an executor future chained to the loop's): 114 against 59 µs a trip on
    uvloop, and a thread makes four or five of them. Nor do fsyncs then queue behind other
    users of the default executor, DNS lookups among them. As with to_thread, a call runs to
    its end even when the task awaiting it is cancelled."""

    def __init__(self, threads: int) -> None:
        self._size = threads
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child has none of its parent's threads (nor a lock one of them held): it
        # starts its own.
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]
        ] = queue.SimpleQueue()
        self._started = 0

    def run(self, call: Callable[[], _R]) -> asyncio.Future[_R]:
        """call() on one of the threads; its result (or exception) in the returned future."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_R] = loop.create_future()
        if self._started < self._size:
            self._start_one()
        self._jobs.put((call, future, loop))
        return future

    def _start_one(self) -> None:
        with self._lock:
            if self._started < self._size:
                self._started += 1
                threading.Thread(target=self._serve, name="recording-disk", daemon=True).start()

    def _serve(self) -> None:
        jobs = self._jobs
        while True:
            call, future, loop = jobs.get()
            try:
                result = call()
            except BaseException as error:  # noqa: BLE001 - the awaiting task's, as to_thread does
                _hand_back(loop, _set_exception, future, error)
            else:
                _hand_back(loop, _set_result, future, result)
            # Nothing of the call is kept while the thread waits for the next.
            del call, future, loop


def _hand_back(
    loop: asyncio.AbstractEventLoop,
    settle: Callable[[asyncio.Future[Any], Any], None],
    future: asyncio.Future[Any],
    value: Any,
) -> None:
    # A loop closed meanwhile raises RuntimeError: nobody awaits the result.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle, future, value)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


# As many as the default executor would have on this machine, so as many fsyncs overlap.
_disk = _DiskThreads(min(32, (os.cpu_count() or 1) + 4))


@dataclass(frozen=True)
class ForkSeed:
    """What a forked thread's bundle starts with: where its shared history comes from."""

    parent_thread_id: str
    parent_bundle: str
    parent_trace_id: str
    after_turn_id: str
    group_id: str
    repetition_index: int
    shared_turns: int
    prefix_items: Sequence[Mapping[str, Any]]
    # Payloads the parent's bundle holds; empty when the parent's recording is not usable,
    # and then the prefix is copied into the fork's bundle.
    parent_payloads: frozenset[str]
    # The parent's latest inference call and its held tokens (see RecordBuilder.held_tokens).
    parent_call_id: str = ""
    parent_tokens: Sequence[int] = ()
    # ResumeThread: the conversation continued rather than sampled.
    resumed: bool = False


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
        # A turn ended since the last sync: once durable, its spans may go out (live export).
        self._turn_done = False

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
        fork: ForkSeed | None = None,
    ) -> Recorder:
        """Create the bundle and record thread_started (after thread_forked for a fork);
        raise RecordingError when it cannot."""

        def create() -> Recorder:
            writer = BundleWriter.create(
                trace_root,
                thread_id,
                trace_id=fork.parent_trace_id if fork is not None else None,
                producer_name=PRODUCER_NAME,
                producer_version=__version__,
            )
            builder = RecordBuilder(writer)
            try:
                if fork is not None:
                    copy = not fork.parent_payloads
                    writer.inherit_payloads(fork.parent_payloads)
                    builder.thread_forked(
                        parent_thread_id=fork.parent_thread_id,
                        parent_bundle=fork.parent_bundle,
                        parent_trace_id=fork.parent_trace_id,
                        after_turn_id=fork.after_turn_id,
                        group_id=fork.group_id,
                        repetition_index=fork.repetition_index,
                        shared_turns=fork.shared_turns,
                        prefix_items=fork.prefix_items,
                        copy_prefix=copy,
                        parent_call_id=fork.parent_call_id,
                        # Without the parent's bundle, its tokens cannot be referred to.
                        parent_tokens=() if copy else fork.parent_tokens,
                        resumed=fork.resumed,
                    )
                builder.thread_started(
                    thread_id, model=model, instructions=instructions, metadata=metadata
                )
            except (RecordingError, RecordTooLargeError) as error:
                # No thread will exist: neither may a bundle that says it started.
                writer.discard()
                raise RecordingError(str(error)) from error
            return cls(thread_id, writer, builder)

        return await _disk.run(create)

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
    def trace_id(self) -> str:
        return self._writer.trace_id if self._writer is not None else ""

    def held_tokens(self) -> tuple[str, list[int]]:
        """The latest inference call's id and the thread's held tokens ('' and [] when off)."""
        if self._builder is None or self.status != agent_pb2.RECORDING_STATUS_ACTIVE:
            return "", []
        return self._builder.held_tokens(self._thread)

    @property
    def payload_ids(self) -> frozenset[str]:
        """What a fork may refer to in this bundle: empty unless it is being written fine."""
        if self._writer is None or self.status != agent_pb2.RECORDING_STATUS_ACTIVE:
            return frozenset()
        return self._writer.payload_ids

    def _live(self) -> RecordBuilder | None:
        """The builder while records may still be written."""
        if self._error or self._closing:
            return None
        return self._builder

    def _fail(self, error: BaseException) -> None:
        if not self._error:
            self._error = str(error) or type(error).__name__
            telemetry.recording_failed()
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

    def turn_started(
        self, turn_id: str, input_items: Sequence[Mapping[str, Any]], traceparent: str = ""
    ) -> int:
        return (
            self._call(
                RecordBuilder.turn_started,
                self._thread,
                turn_id,
                input_items,
                traceparent=traceparent,
            )
            or 0
        )

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
        policy_version: str = "",
        provider_api: str = "",
        input_as_string: bool = False,
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
            policy_version=policy_version,
            provider_api=provider_api,
            input_as_string=input_as_string,
        )
        return ordinal or 0

    def prompt_tokens(self, call: int, ids: Sequence[int]) -> None:
        self._call(RecordBuilder.prompt_tokens, call, ids)

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
        self,
        call: int,
        item: int,
        delta: str,
        *,
        kind: DeltaKind = _OUTPUT_TEXT,
        tokens: common_pb2.DeltaTokens | None = None,
    ) -> None:
        # The hot path, called once per provider read: no generic dispatch, _live inline.
        builder = None if self._error or self._closing else self._builder
        if builder is not None:
            try:
                builder.output_text_delta(call, item, delta, kind=kind, tokens=tokens)
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
        stop_reason: common_pb2.StopReason.ValueType = common_pb2.STOP_REASON_UNSPECIFIED,
    ) -> None:
        self._call(
            RecordBuilder.inference_ended,
            call,
            status,
            reason=reason,
            response_id=response_id,
            usage=usage,
            error=error,
            stop_reason=stop_reason,
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
        self._turn_done = True

    # -- durability ----------------------------------------------------------------------------

    async def sync(self) -> None:
        """fsync in a worker thread: a slow disk must not stall every other thread's stream."""
        writer = self._writer
        if writer is None or self._live() is None:
            return
        async with self._io_lock:
            try:
                await _disk.run(writer.sync)
            except _WRITE_ERRORS as error:
                self._fail(error)
        telemetry.recorded(self.thread_id, writer.bytes_written)
        if self._turn_done:
            self._turn_done = False
            telemetry.bundle_advanced(self.bundle_path)

    async def discard(self) -> None:
        """Close and remove the bundle unfinished: a branched thread's replay of the turns its
        fork now shares with the recorded thread."""
        writer = self._writer
        if writer is None or writer.closed:
            return
        self._closing = True
        async with self._io_lock:
            await _disk.run(writer.discard)
        self._builder = None

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
                await _disk.run(writer.close if ok else writer.abandon)
            except _WRITE_ERRORS as error:
                self._fail(error)
        telemetry.recorded(self.thread_id, writer.bytes_written, finished=True)
        telemetry.bundle_advanced(self.bundle_path, ended=True)
        # It holds the thread's last request input: nothing will be built from it again.
        self._builder = None
