"""The inference loop of one turn, run as one background asyncio task."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from agent_server import telemetry
from agent_server.config import Settings
from agent_server.events import MAX_DELTA_CHARS
from agent_server.provider import ProviderClient, ProviderError, ProviderEvent
from agent_server.threads import Thread, Turn
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2

log = logging.getLogger(__name__)

_MAX_BACKOFF = 60.0
INTERRUPTED_REASON = "interrupted"
# Provider-supplied ids and words are clipped before the trace or a client sees them (the
# same value to both): a hostile 5 MiB id must not stop the recording or a client's stream.
MAX_ID_CHARS = 1024
MAX_MESSAGE_CHARS = 16 * 1024
_TEXT_DELTA = "response.output_text.delta"
_REFUSAL_DELTA = "response.refusal.delta"
_DELTA_EVENTS = {_TEXT_DELTA: False, _REFUSAL_DELTA: True}


@dataclass
class _Output:
    """An output item of the current call, from output_item.added until output_item.done."""

    ordinal: int
    provider_id: str
    client_id: str
    type: str
    role: str
    output_index: int
    done: bool = False
    # Everything clients were sent as deltas of this item, and how much of it is refusal.
    streamed: list[str] = field(default_factory=list)


@dataclass
class _Call:
    """The attempt in flight: what its inference_ended record will need."""

    ordinal: int
    response_id: str = ""
    usage: common_pb2.TokenUsage | None = None
    accepted: int = 0
    outputs: list[_Output] = field(default_factory=list)

    def find(self, provider_id: str, output_index: Any = None) -> _Output | None:
        """The open output an event is about: by id (by output index among several with that
        id, else the latest of them), else by output index, else the latest open one (without
        an id of its own when the event names an id nobody announced)."""
        open_outputs = [output for output in self.outputs if not output.done]
        if provider_id:
            named = [o for o in open_outputs if provider_id in (o.provider_id, o.client_id)]
            if len(named) > 1 and isinstance(output_index, int):
                named = [o for o in named if o.output_index == output_index] or named
            if named:
                return named[-1]
        if isinstance(output_index, int):
            for output in open_outputs:
                if output.output_index == output_index:
                    return output
        if provider_id:
            open_outputs = [output for output in open_outputs if not output.provider_id]
        return open_outputs[-1] if open_outputs else None

    def client_id_for(self, provider_id: str, item_type: str) -> str:
        """The provider's id, unless an output of this call already has it: two items of a
        response must never share the id clients and the trace know them by."""
        if provider_id and all(o.client_id != provider_id for o in self.outputs):
            return provider_id
        return _assign_item_id(item_type)


@dataclass(frozen=True)
class _Failure:
    error: ProviderError


class _Completed:
    pass


def new_call_id() -> str:
    return f"inf_{uuid.uuid4().hex}"


def _assign_item_id(item_type: str) -> str:
    prefix = "msg" if item_type == "message" else "item"
    return f"{prefix}_{uuid.uuid4().hex}"


def _texts_of(item: dict[str, Any]) -> tuple[str, str]:
    """The item's output text and its refusal text, each concatenated over its parts."""
    content = item.get("content")
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return "", ""
    text: list[str] = []
    refusal: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            text.append(part["text"])
        elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            refusal.append(part["refusal"])
    return "".join(text), "".join(refusal)


def _usage(response: Any) -> common_pb2.TokenUsage | None:
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None

    def count(source: Any, key: str) -> int:
        value = source.get(key) if isinstance(source, dict) else None
        return value if isinstance(value, int) and value >= 0 else 0

    return common_pb2.TokenUsage(
        input_tokens=count(usage, "input_tokens"),
        output_tokens=count(usage, "output_tokens"),
        total_tokens=count(usage, "total_tokens"),
        cached_input_tokens=count(usage.get("input_tokens_details"), "cached_tokens"),
        reasoning_tokens=count(usage.get("output_tokens_details"), "reasoning_tokens"),
    )


def _str(mapping: Any, key: str, limit: int = MAX_ID_CHARS) -> str:
    """A provider string field ('' when absent or not a string), clipped to limit."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if not isinstance(value, str):
        return ""
    if len(value) <= limit:
        return value
    return f"{value[: limit - 40]}...[clipped from {len(value)} chars]"


def _delta(mapping: dict[str, Any]) -> str:
    """The text of a delta event, never clipped (it is split instead where it must be)."""
    value = mapping.get("delta")
    return value if isinstance(value, str) else ""


class TurnRunner:
    """Runs one turn: attempts with retries, recording before notifying, then its ending.

    Every trace record of the turn is written from its own task, so an interrupt is a plain
    task cancellation: the task records the cancelled call and turn on its way out.
    """

    def __init__(
        self, thread: Thread, turn: Turn, provider: ProviderClient, settings: Settings
    ) -> None:
        self._thread = thread
        self._turn = turn
        self._provider = provider
        self._settings = settings
        self._recorder = thread.recorder
        self._call: _Call | None = None
        self._task: asyncio.Task[None] | None = None
        # Who asked to interrupt the turn; set once, before its task is cancelled.
        self._interrupted_by: str | None = None

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
        if turn.in_progress and self._interrupted_by is None:
            self._interrupted_by = requested_by
            task.cancel()
        # wait() neither raises the task's error nor cancels the task when we are cancelled.
        await asyncio.wait([task])
        if turn.in_progress:
            # Cancelled before its first step, the task never ran its own clean-up.
            await self._end_interrupted()

    # -- the task ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            try:
                outcome = await self._infer()
            except asyncio.CancelledError:
                await self._end_interrupted()
                return
            except Exception as error:
                log.exception("turn %s failed unexpectedly", self._turn.id)
                internal = ProviderError("internal", f"internal error: {type(error).__name__}")
                self._end_call(
                    common_pb2.EXECUTION_STATUS_FAILED, "internal", self._trace_error(internal)
                )
                outcome = _Failure(internal)
            await self._end(outcome)
        finally:
            if not self._turn.in_progress:
                self._thread.end_turn(self)

    async def _infer(self) -> _Completed | _Failure:
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._attempt(attempt)
                return _Completed()
            except ProviderError as error:
                call = self._call
                accepted = call.accepted if call is not None else 0
                will_retry = (
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
                await asyncio.sleep(self._backoff(attempt, error.retry_after))

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return retry_after
        ceiling = min(_MAX_BACKOFF, self._settings.retry_base_delay * 2.0 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    async def _attempt(self, attempt: int) -> None:
        thread = self._thread
        envelope: dict[str, Any] = {"model": thread.model, "store": False, "stream": True}
        if thread.instructions:
            envelope["instructions"] = thread.instructions
        input_items = list(thread.history)
        call_id = new_call_id()
        ordinal = self._recorder.inference_started(
            self._turn.ordinal,
            call_id=call_id,
            attempt=attempt,
            model=thread.model,
            provider_base_url=self._provider.display_url,
            envelope=envelope,
            input_items=input_items,
        )
        call = self._call = _Call(ordinal)
        telemetry.call_started(self._turn.id)
        async with self._provider.batches(call_id, {**envelope, "input": input_items}) as reader:
            while batch := await reader.next():
                if self._on_batch(call, batch):
                    break
            else:
                raise ProviderError(
                    "stream_ended",
                    "the provider stream ended without a terminal event",
                    retryable=True,
                    reason="stream_ended",
                )
        self._end_call(common_pb2.EXECUTION_STATUS_COMPLETED, "response.completed")

    def _end_call(
        self,
        status: common_pb2.ExecutionStatus.ValueType,
        reason: str,
        error: common_pb2.TraceError | None = None,
    ) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        telemetry.call_ended(self._turn.id, status, error)
        self._recorder.inference_ended(
            call.ordinal,
            status,
            reason=reason,
            response_id=call.response_id,
            usage=call.usage,
            error=error,
        )

    # -- provider events: record first, then tell the clients --------------------------------

    def _on_batch(self, call: _Call, batch: list[ProviderEvent]) -> bool:
        """Handle events that arrived together; True once the response completed.

        A run of text deltas for one item becomes one record and one client event: they were
        all waiting already, so nothing is delayed, and the bundle stays small. When an event
        fails the attempt, the rest of the batch is still recorded (and what it completes is
        accepted) before the first failure ends the attempt."""
        failure: ProviderError | None = None
        position = 0
        while position < len(batch):
            event = batch[position]
            output = self._delta_target(call, event)
            if output is None:
                try:
                    if self._on_event(call, event) and failure is None:
                        return True
                except ProviderError as error:
                    failure = failure or error
                position += 1
                continue
            refusal = _DELTA_EVENTS[event.type]
            texts = [_delta(event.data or {})]
            position += 1
            while position < len(batch):
                following = batch[position]
                if (
                    following.type != event.type
                    or self._delta_target(call, following) is not output
                ):
                    break
                texts.append(_delta(following.data or {}))
                position += 1
            self._text_delta(call, output, "".join(texts), refusal=refusal)
        if failure is not None:
            raise failure
        return False

    @staticmethod
    def _delta_target(call: _Call, event: ProviderEvent) -> _Output | None:
        """The output a text or refusal delta is for; None for any other event (or a delta
        nobody announced an item for)."""
        if event.type not in _DELTA_EVENTS or event.data is None:
            return None
        return call.find(_str(event.data, "item_id"), event.data.get("output_index"))

    def _text_delta(self, call: _Call, output: _Output, delta: str, *, refusal: bool) -> None:
        self._recorder.output_text_delta(call.ordinal, output.ordinal, delta, refusal=refusal)
        output.streamed.append(delta)
        self._thread.emit_delta(self._turn.id, output.client_id, delta, refusal=refusal)

    def _on_event(self, call: _Call, event: ProviderEvent) -> bool:
        """Handle one event; True once the response completed. Raises ProviderError on failure."""
        data = event.data
        if data is None:
            self._recorder.provider_event(call.ordinal, event.type, event.raw)
            raise ProviderError(
                "malformed_event",
                f"the provider sent an event that is not a JSON object ({event.type})",
            )
        handler = _HANDLERS.get(event.type)
        if handler is None:
            self._recorder.provider_event(call.ordinal, event.type, event.raw)
            return False
        return handler(self, call, data, event.raw)

    def _on_created(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        call.response_id = _str(data.get("response"), "id") or call.response_id
        self._recorder.response_created(call.ordinal, call.response_id)
        return False

    def _on_item_added(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        item = data.get("item")
        if not isinstance(item, dict):
            self._recorder.provider_event(call.ordinal, "response.output_item.added", raw)
            return False
        provider_id = _str(item, "id")
        item_type = _str(item, "type") or "message"
        role = _str(item, "role")
        client_id = call.client_id_for(provider_id, item_type)
        index = data.get("output_index")
        output_index = index if isinstance(index, int) and index >= 0 else len(call.outputs)
        ordinal = self._recorder.output_item_added(
            call.ordinal,
            provider_item_id=provider_id,
            item_type=item_type,
            role=role,
            output_index=output_index,
        )
        output = _Output(
            ordinal=ordinal,
            provider_id=provider_id,
            client_id=client_id,
            type=item_type,
            role=role,
            output_index=output_index,
        )
        call.outputs.append(output)
        self._thread.emit(
            self._turn.id,
            item_started=agent_pb2.ItemStartedEvent(
                item=agent_pb2.Item(id=output.client_id, type=item_type, role=role)
            ),
        )
        return False

    def _on_unplaced_delta(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        # Text for an item that was never announced: kept verbatim, nobody to show it to.
        self._recorder.provider_event(call.ordinal, _str(data, "type"), raw)
        return False

    def _on_item_done(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        item = data.get("item")
        if not isinstance(item, dict):
            self._recorder.provider_event(call.ordinal, "response.output_item.done", raw)
            return False
        provider_id = _str(item, "id")
        item_type = _str(item, "type") or "message"
        output = call.find(provider_id, data.get("output_index"))
        if output is None:
            # Never announced: it still takes an id no other item of the call has.
            output = _Output(
                ordinal=0,
                provider_id=provider_id,
                client_id=call.client_id_for(provider_id, item_type),
                type=item_type,
                role=_str(item, "role"),
                output_index=-1,
            )
            call.outputs.append(output)
        output.done = True
        item_id = output.client_id
        self._recorder.output_item_done(
            call.ordinal,
            output.ordinal,
            item_id=item_id,
            assigned=item_id != provider_id,
            payload=item,
        )
        # Accepted: the item is part of the conversation whatever ends the call.
        self._thread.history.append(item)
        call.accepted += 1
        completed = agent_pb2.Item(id=item_id, type=item_type, role=_str(item, "role"))
        text, refusal = _texts_of(item)
        if len(text) + len(refusal) <= MAX_DELTA_CHARS:
            completed.text = text
            completed.refusal = refusal
        else:
            self._complete_in_deltas(output, text, refusal)
            completed.text_in_deltas = True
        output.streamed.clear()
        self._thread.emit(
            self._turn.id, item_completed=agent_pb2.ItemCompletedEvent(item=completed)
        )
        return False

    def _complete_in_deltas(self, output: _Output, text: str, refusal: str) -> None:
        """Stream what the deltas have not carried yet of an item too large for one event, so
        that its deltas hold all of it (they were recorded whole, in the item's payload)."""
        streamed = "".join(output.streamed)
        final = text + refusal
        if not final.startswith(streamed):
            self._thread.emit(
                self._turn.id,
                error=agent_pb2.ErrorEvent(
                    code="item_text_mismatch",
                    message=f"item {output.client_id}: the provider's final text does not "
                    "extend what it streamed and is too large for one event; the trace has both",
                ),
            )
            return
        rest = final[len(streamed) :]
        text_left = max(0, len(text) - len(streamed))
        rest_text, rest_refusal = rest[:text_left], rest[text_left:]
        if rest_text:
            self._thread.emit_delta(self._turn.id, output.client_id, rest_text)
        if rest_refusal:
            self._thread.emit_delta(self._turn.id, output.client_id, rest_refusal, refusal=True)

    def _on_completed(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        self._recorder.provider_event(call.ordinal, "response.completed", raw)
        self._take_response(call, data)
        return True

    def _on_failed(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        self._recorder.provider_event(call.ordinal, "response.failed", raw)
        response = self._take_response(call, data)
        error = response.get("error") if isinstance(response, dict) else None
        raise ProviderError(
            _str(error, "code") or "response_failed",
            _str(error, "message", MAX_MESSAGE_CHARS)
            or "the provider reported that the response failed",
            reason="response.failed",
        )

    def _on_incomplete(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        self._recorder.provider_event(call.ordinal, "response.incomplete", raw)
        response = self._take_response(call, data)
        details = response.get("incomplete_details") if isinstance(response, dict) else None
        why = _str(details, "reason") or "unknown reason"
        raise ProviderError(
            "response_incomplete",
            f"the provider ended the response incomplete: {why}",
            reason="response.incomplete",
        )

    def _on_error(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        self._recorder.provider_event(call.ordinal, "error", raw)
        nested = data.get("error")
        source = nested if isinstance(nested, dict) else data
        raise ProviderError(
            _str(source, "code") or _str(source, "type") or "provider_error",
            _str(source, "message", MAX_MESSAGE_CHARS) or "the provider sent an error event",
            reason="error",
        )

    def _take_response(self, call: _Call, data: dict[str, Any]) -> Any:
        response = data.get("response")
        call.response_id = _str(response, "id") or call.response_id
        usage = _usage(response)
        if usage is not None:
            call.usage = usage
            self._thread.emit(
                self._turn.id,
                token_usage=agent_pb2.TokenUsageEvent(
                    input_tokens=usage.input_tokens,
                    output_tokens=usage.output_tokens,
                    total_tokens=usage.total_tokens,
                ),
            )
        return response

    # -- endings -------------------------------------------------------------------------------

    @staticmethod
    def _trace_error(error: ProviderError) -> common_pb2.TraceError:
        return common_pb2.TraceError(
            code=error.code, message=error.message, http_status=error.http_status
        )

    async def _end(self, outcome: _Completed | _Failure) -> None:
        turn = self._turn
        if isinstance(outcome, _Failure):
            trace_error = self._trace_error(outcome.error)
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
        if not turn.in_progress:
            return
        self._end_call(common_pb2.EXECUTION_STATUS_CANCELLED, INTERRUPTED_REASON)
        self._recorder.interrupt_requested(turn.ordinal, self._interrupted_by or "unknown")
        self._recorder.turn_ended(turn.ordinal, common_pb2.EXECUTION_STATUS_CANCELLED)
        turn.end(agent_pb2.TURN_STATUS_INTERRUPTED)
        await self._recorder.sync()
        self._emit_completed()

    def _emit_completed(self) -> None:
        self._thread.emit(
            self._turn.id, turn_completed=agent_pb2.TurnCompletedEvent(turn=self._turn.to_proto())
        )
        self._thread.end_turn(self)


_HANDLERS = {
    "response.created": TurnRunner._on_created,
    "response.output_item.added": TurnRunner._on_item_added,
    _TEXT_DELTA: TurnRunner._on_unplaced_delta,
    _REFUSAL_DELTA: TurnRunner._on_unplaced_delta,
    "response.output_item.done": TurnRunner._on_item_done,
    "response.completed": TurnRunner._on_completed,
    "response.failed": TurnRunner._on_failed,
    "response.incomplete": TurnRunner._on_incomplete,
    "error": TurnRunner._on_error,
}
