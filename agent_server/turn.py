"""The inference loop of one turn, run as one background asyncio task: requests, tool rounds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent_server import telemetry
from agent_server.chat_completions import CHAT, stream_ended_message
from agent_server.config import Settings
from agent_server.errors import (
    DuplicateToolOutputError,
    EmptyToolOutputsError,
    ToolOutputTooLargeError,
    TurnNotAwaitingToolOutputsError,
    UnknownCallIdError,
)
from agent_server.provider import EventBatches, ProviderClient, ProviderError
from agent_server.response import Response
from agent_server.threads import Thread, Turn
from agent_server.tools import (
    MAX_TOOL_OUTPUT_BYTES,
    TRACE_STATUS,
    SubmittedOutput,
    ToolCall,
    output_item,
)
from agent_server.training import OPTIONAL_FIELDS, Sampling, TokenCapture, request_fields
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import classify_stop

log = logging.getLogger(__name__)

_MAX_BACKOFF = 60.0
INTERRUPTED_REASON = "interrupted"
# After an event that fails the attempt (an `error`, a duplicate call id), the provider may
# still send events (the real API follows `error` with `response.failed`): they are read and
# recorded up to its end of stream, within these bounds, before the attempt ends.
DRAIN_SECONDS = 5.0
DRAIN_BYTES = 4 * 1024 * 1024


class TurnFailedError(Exception):
    """A turn failed for a reason that is not the provider's: its tools looped past the
    limit, a tool output never came, or the server failed (no HTTP status: no call made it)."""

    http_status = 0

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class _Failure:
    error: ProviderError | TurnFailedError


class _Completed:
    pass


def new_call_id() -> str:
    return f"inf_{uuid.uuid4().hex}"


class TurnRunner:
    """Runs one turn: requests with retries, tool rounds, recording before notifying, endings.

    Every trace record of the turn is written from its own task (submitted tool outputs aside,
    which are recorded by the RPC that brings them, before it answers), so an interrupt is a
    plain task cancellation: the task records the cancelled call and turn on its way out.
    """

    def __init__(
        self, thread: Thread, turn: Turn, provider: ProviderClient, settings: Settings
    ) -> None:
        self._thread = thread
        self._turn = turn
        self._provider = provider
        self._settings = settings
        self._recorder = thread.recorder
        self._response: Response | None = None
        self._task: asyncio.Task[None] | None = None
        # Who asked to interrupt the turn; set once, before its task is cancelled.
        self._interrupted_by: str | None = None
        # The tool calls of the current round, those still unanswered by call id, and what
        # wakes the task once all are answered: each output costs O(1), not O(round).
        self._round: list[ToolCall] = []
        self._round_call_ids: set[str] = set()
        self._pending: dict[str, ToolCall] = {}
        self._answered = asyncio.Event()
        # Tool rounds the turn has had: a tool_choice that forces a call holds for its first
        # request only, or the model could never answer with the tools' outputs.
        self._tool_rounds = 0

    @property
    def turn(self) -> Turn:
        return self._turn

    def start(self) -> None:
        """Become the thread's running turn and run it in a task of its own."""
        self._thread.begin_turn(self)
        self._task = asyncio.create_task(self._run(), name=f"turn {self._turn.id}")

    async def interrupt(self, requested_by: str) -> None:
        """Stop the turn and return once it has ended INTERRUPTED (or had already ended)."""
        turn = self._turn
        task = self._task
        assert task is not None, "interrupt before start"
        if turn.running and self._interrupted_by is None:
            self._interrupted_by = requested_by
            # Recorded when asked, so the trace shows the request before the call it cancels.
            self._recorder.interrupt_requested(turn.ordinal, requested_by)
            task.cancel()
        # wait() neither raises the task's error nor cancels the task when we are cancelled.
        await asyncio.wait([task])
        if turn.running:
            # Cancelled before its first step, the task never ran its own clean-up.
            await self._end_interrupted()

    # -- tool outputs --------------------------------------------------------------------------

    def submit_tool_outputs(self, outputs: Sequence[SubmittedOutput], submitted_by: str) -> None:
        """Answer pending tool calls of the current round: all of `outputs` or none.

        Each is recorded, then announced; the last one of the round wakes the turn."""
        if not outputs:
            raise EmptyToolOutputsError("outputs must hold at least one tool output")
        pending = self._pending
        if not self._turn.running or not pending:
            raise TurnNotAwaitingToolOutputsError(
                f"turn {self._turn.id!r} is not waiting for tool outputs",
                turn_id=self._turn.id,
            )
        seen: set[str] = set()
        for position, submitted in enumerate(outputs):
            size = len(submitted.output.encode())
            if size > MAX_TOOL_OUTPUT_BYTES:
                raise ToolOutputTooLargeError(
                    f"outputs[{position}] holds {size} bytes; the limit is {MAX_TOOL_OUTPUT_BYTES}",
                    call_id=submitted.call_id,
                    limit=str(MAX_TOOL_OUTPUT_BYTES),
                )
            if submitted.call_id in seen or (
                submitted.call_id not in pending and submitted.call_id in self._round_call_ids
            ):
                raise DuplicateToolOutputError(
                    f"outputs[{position}]: call {submitted.call_id!r} already has an output",
                    call_id=submitted.call_id,
                )
            if submitted.call_id not in pending:
                raise UnknownCallIdError(
                    f"outputs[{position}]: turn {self._turn.id!r} has no pending call "
                    f"{submitted.call_id!r}",
                    call_id=submitted.call_id,
                )
            seen.add(submitted.call_id)
        for submitted in outputs:
            call = pending.pop(submitted.call_id)
            call.output = output_item(call.call_id, submitted.output)
            call.is_error = submitted.is_error
            call.status = (
                agent_pb2.TOOL_CALL_STATUS_FAILED
                if submitted.is_error
                else agent_pb2.TOOL_CALL_STATUS_COMPLETED
            )
            self._recorder.tool_output_submitted(
                call.ordinal,
                output_item=call.output,
                is_error=submitted.is_error,
                submitted_by=submitted_by,
            )
            self._recorder.tool_call_ended(call.ordinal, TRACE_STATUS[call.status])
            self._thread.emit(
                self._turn.id,
                tool_call_completed=agent_pb2.ToolCallCompletedEvent(
                    call_id=call.call_id, output=submitted.output, is_error=submitted.is_error
                ),
            )
        if not pending:
            # The round is complete: the turn is in progress again from this moment, and the
            # answer to this very request says so.
            self._turn.status = agent_pb2.TURN_STATUS_IN_PROGRESS
            self._answered.set()

    # -- the task ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            try:
                outcome = await self._rounds()
            except asyncio.CancelledError:
                await self._end_interrupted()
                return
            except Exception as error:
                log.exception("turn %s failed unexpectedly", self._turn.id)
                internal = TurnFailedError("internal", f"internal error: {type(error).__name__}")
                self._end_call(
                    common_pb2.EXECUTION_STATUS_FAILED, "internal", self._trace_error(internal)
                )
                outcome = _Failure(internal)
            await self._end(outcome)
        finally:
            if not self._turn.running:
                self._thread.end_turn(self)

    async def _rounds(self) -> _Completed | _Failure:
        """Requests until a response calls no tool; between them, the tools' outputs."""
        rounds = 0
        while True:
            outcome = await self._infer()
            if isinstance(outcome, _Failure) or not self._round:
                return outcome
            rounds += 1
            if rounds > self._settings.max_tool_rounds:
                return _Failure(
                    TurnFailedError(
                        "max_tool_rounds",
                        f"the model asked for tools in more than {self._settings.max_tool_rounds} "
                        "rounds of this turn",
                    )
                )
            if self._pending:
                timeout = self._settings.tool_output_timeout
                self._turn.status = agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS
                self._thread.emit(
                    self._turn.id,
                    turn_awaiting_tool_outputs=agent_pb2.TurnAwaitingToolOutputsEvent(
                        turn=self._turn.to_proto()
                    ),
                )
                # asyncio.timeout, never wait_for: on Python 3.11 wait_for swallows a
                # cancellation (an Interrupt) that arrives as the last output wakes the wait.
                try:
                    async with asyncio.timeout(timeout):
                        await self._answered.wait()
                except TimeoutError:
                    # The last output may have been taken (its RPC answered OK) after the timer
                    # fired and before this task resumed: then the round is answered.
                    if self._pending:
                        return _Failure(
                            TurnFailedError(
                                "tool_output_timeout",
                                f"no output for every tool call came within {timeout:g} s",
                            )
                        )
            self._close_round()
            self._tool_rounds += 1

    def _on_tool_call(self, call: ToolCall) -> None:
        """An accepted function call joins the round; one whose call id another call of the
        round has fails the attempt (an output could never say which of them it answers), and
        is ended with the round."""
        self._round.append(call)
        self._turn.add_tool_call(call)
        if call.call_id in self._round_call_ids:
            raise ProviderError(
                "duplicate_call_id",
                f"the provider sent two function calls with call_id {call.call_id!r} in one "
                "round of tool calls",
            )
        self._round_call_ids.add(call.call_id)
        self._pending[call.call_id] = call
        self._answered.clear()

    def _close_round(self) -> None:
        """The round's outputs join the history, in the order of the calls."""
        for call in self._round:
            assert call.output is not None
            self._thread.history.append(call.output)
        self._round = []
        self._round_call_ids = set()
        self._pending = {}

    def _end_round(
        self, status: agent_pb2.ToolCallStatus.ValueType, code: str, message: str
    ) -> None:
        """End the round's unanswered calls with status; each gets an output saying why, which
        the next request sends back (the provider wants an output for every call)."""
        for call in self._round:
            if not call.pending:
                continue
            call.status = status
            call.output = output_item(call.call_id, message)
            self._recorder.tool_call_ended(
                call.ordinal,
                TRACE_STATUS[status],
                error=common_pb2.TraceError(code=code, message=message),
                output_item=call.output,
            )
        self._close_round()

    async def _infer(self) -> _Completed | _Failure:
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._attempt(attempt)
                return _Completed()
            except ProviderError as error:
                response = self._response
                accepted = response.accepted if response is not None else 0
                refused = self._refused(error, accepted)
                if refused and self._thread.capture.required:
                    error = ProviderError(
                        "optional_field_refused",
                        f"the provider refused {', '.join(refused)}, which this thread requires: "
                        f"{error.message}",
                        http_status=error.http_status,
                        reason=error.reason,
                    )
                    refused = []
                will_retry = bool(refused) or (
                    error.retryable and accepted == 0 and attempt <= self._settings.max_retries
                )
                self._end_call(
                    common_pb2.EXECUTION_STATUS_FAILED, error.reason, self._trace_error(error)
                )
                self._thread.emit(
                    self._turn.id,
                    error=agent_pb2.ErrorEvent(
                        message=error.message, will_retry=will_retry, code=error.code
                    ),
                )
                if not will_retry:
                    return _Failure(error)
                if refused:
                    # Best effort: the same request at once without what the provider refused.
                    self._thread.refused_fields |= frozenset(refused)
                    continue
                await asyncio.sleep(self._backoff(attempt, error.retry_after))

    def _sampling(self) -> Sampling:
        """The turn's settings for its next request: after a tool round, a tool_choice that
        forces a call (`required`, a named function) becomes `auto`."""
        sampling = self._turn.sampling
        forcing = sampling.tool_choice == "required" or isinstance(sampling.tool_choice, dict)
        if self._tool_rounds and forcing:
            return dataclasses.replace(sampling, tool_choice="auto")
        return sampling

    def _capture(self) -> TokenCapture:
        """The thread's token capture without what the provider refused or, best effort,
        is known not to offer."""
        thread = self._thread
        capture = thread.capture
        left_out = thread.refused_fields
        if not capture.required:
            left_out |= self._provider.unsupported
        return capture.without(left_out)

    def _refused(self, error: ProviderError, accepted: int) -> list[str]:
        """The optional fields a provider's refusal of the request is about: the ones its
        answer names, else every one the request carried ([] for any other failure)."""
        if accepted or error.http_status not in (400, 422):
            return []
        sent = request_fields(self._sampling(), self._capture())
        wire = self._provider.dialect.envelope(sent)
        carried = [name for name in OPTIONAL_FIELDS if name in sent or name in wire]
        if not carried:
            return []
        named = [name for name in carried if name in error.message]
        return named or carried

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return retry_after
        ceiling = min(_MAX_BACKOFF, self._settings.retry_base_delay * 2.0 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _envelope(self) -> dict[str, Any]:
        """The request body without its `input`: the same for every request of the thread."""
        thread = self._thread
        envelope: dict[str, Any] = {"model": thread.model, "store": False, "stream": True}
        if thread.instructions:
            envelope["instructions"] = thread.instructions
        if thread.tools:
            envelope["tools"] = [tool.request_entry() for tool in thread.tools]
        envelope.update(request_fields(self._sampling(), self._capture()))
        return self._provider.dialect.envelope(envelope)

    async def _attempt(self, attempt: int) -> None:
        thread = self._thread
        dialect = self._provider.dialect
        envelope = self._envelope()
        input_items = list(thread.history)
        call_id = new_call_id()
        thread.last_call_id = call_id
        ordinal = self._recorder.inference_started(
            self._turn.ordinal,
            call_id=call_id,
            attempt=attempt,
            model=thread.model,
            provider_base_url=self._provider.display_url,
            envelope=envelope,
            input_items=input_items,
            policy_version=self._turn.sampling.policy_version,
            # The Responses API is the trace's default spelling: recorded as ''.
            provider_api="" if dialect.name == "responses" else dialect.name,
        )
        response = self._response = Response(
            ordinal, thread, self._turn.id, self._on_tool_call, self._provider.redactor
        )
        telemetry.call_started(self._turn.id)
        body = dialect.request(envelope, thread.instructions, input_items, thread.encoded_history)
        async with self._provider.batches(call_id, body) as reader:
            while batch := await reader.next():
                try:
                    if response.on_batch(batch):
                        break
                except ProviderError:
                    await self._drain(reader, response)
                    raise
            else:
                raise ProviderError(
                    "stream_ended",
                    # A Chat stream says it was cut before a choice finished, as the gateway
                    # does (was: the same words as a Responses stream's, which has no choices).
                    stream_ended_message("provider", chat=dialect.name == CHAT.name),
                    retryable=True,
                    reason="stream_ended",
                )
        self._end_call(
            common_pb2.EXECUTION_STATUS_COMPLETED,
            response.incomplete_reason or "response.completed",
        )

    @staticmethod
    async def _drain(reader: EventBatches, response: Response) -> None:
        """Record what the provider still sends after an event failed the attempt, up to its
        end of stream, for DRAIN_SECONDS and DRAIN_BYTES at most; the first failure stands."""
        budget = DRAIN_BYTES
        # Only the drain's own deadline is caught: an interrupt still cancels the turn.
        with contextlib.suppress(TimeoutError, ProviderError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while budget > 0 and (batch := await reader.next()):
                    budget -= sum(len(event.raw) for event in batch)
                    with contextlib.suppress(ProviderError):
                        if response.on_batch(batch):
                            return

    def _end_call(
        self,
        status: common_pb2.ExecutionStatus.ValueType,
        reason: str,
        error: common_pb2.TraceError | None = None,
    ) -> None:
        response, self._response = self._response, None
        if response is None:
            return
        telemetry.call_ended(self._turn.id, status, error)
        stop = classify_stop(
            status,
            reason=response.incomplete_reason or reason,
            error_code=error.code if error is not None else "",
            http_status=error.http_status if error is not None else 0,
        )
        self._recorder.inference_ended(
            response.ordinal,
            status,
            reason=reason,
            response_id=response.response_id,
            usage=response.usage,
            error=error,
            stop_reason=stop,
        )

    # -- endings -------------------------------------------------------------------------------

    @staticmethod
    def _trace_error(error: ProviderError | TurnFailedError) -> common_pb2.TraceError:
        return common_pb2.TraceError(
            code=error.code, message=error.message, http_status=error.http_status
        )

    async def _end(self, outcome: _Completed | _Failure) -> None:
        turn = self._turn
        if isinstance(outcome, _Failure):
            error = outcome.error
            timed_out = error.code == "tool_output_timeout"
            self._end_round(
                agent_pb2.TOOL_CALL_STATUS_FAILED
                if timed_out
                else agent_pb2.TOOL_CALL_STATUS_CANCELLED,
                error.code,
                f"no output was submitted: {error.message}"
                if timed_out
                else f"the tool call was cancelled: the turn failed ({error.code})",
            )
            trace_error = self._trace_error(error)
            self._recorder.turn_ended(turn.ordinal, common_pb2.EXECUTION_STATUS_FAILED, trace_error)
            turn.end(
                agent_pb2.TURN_STATUS_FAILED,
                agent_pb2.TurnError(
                    message=trace_error.message,
                    code=trace_error.code,
                    http_status=trace_error.http_status,
                ),
            )
        else:
            self._recorder.turn_ended(turn.ordinal, common_pb2.EXECUTION_STATUS_COMPLETED)
            turn.end(agent_pb2.TURN_STATUS_COMPLETED)
        await self._recorder.sync()
        self._emit_completed()

    async def _end_interrupted(self) -> None:
        turn = self._turn
        if not turn.running:
            return
        self._end_call(common_pb2.EXECUTION_STATUS_CANCELLED, INTERRUPTED_REASON)
        self._end_round(
            agent_pb2.TOOL_CALL_STATUS_CANCELLED,
            INTERRUPTED_REASON,
            "the tool call was cancelled: the turn was interrupted",
        )
        if self._interrupted_by is None:
            self._recorder.interrupt_requested(turn.ordinal, "unknown")
        self._recorder.turn_ended(turn.ordinal, common_pb2.EXECUTION_STATUS_CANCELLED)
        turn.end(agent_pb2.TURN_STATUS_INTERRUPTED)
        await self._recorder.sync()
        self._emit_completed()

    def _emit_completed(self) -> None:
        self._thread.emit(
            self._turn.id, turn_completed=agent_pb2.TurnCompletedEvent(turn=self._turn.to_proto())
        )
        self._thread.end_turn(self)
