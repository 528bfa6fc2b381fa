"""The inference loop of one turn, run as one background asyncio task."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from agent_server.config import Settings
from agent_server.provider import ProviderClient, ProviderError, ProviderEvent
from agent_server.threads import Thread, Turn
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2

log = logging.getLogger(__name__)

_MAX_BACKOFF = 60.0
INTERRUPTED_REASON = "interrupted"


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


@dataclass
class _Call:
    """The attempt in flight: what its inference_ended record will need."""

    ordinal: int
    response_id: str = ""
    usage: common_pb2.TokenUsage | None = None
    accepted: int = 0
    outputs: list[_Output] = field(default_factory=list)

    def find(self, provider_id: str, output_index: Any = None) -> _Output | None:
        """The open output an event is about: by id, else by output index, else the latest
        open one (without an id of its own when the event names an id nobody announced)."""
        open_outputs = [output for output in self.outputs if not output.done]
        if provider_id:
            for output in open_outputs:
                if provider_id in (output.provider_id, output.client_id):
                    return output
        if isinstance(output_index, int):
            for output in open_outputs:
                if output.output_index == output_index:
                    return output
        if provider_id:
            open_outputs = [output for output in open_outputs if not output.provider_id]
        return open_outputs[-1] if open_outputs else None


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


def _text_of(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    )


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


def _str(mapping: Any, key: str) -> str:
    value = mapping.get(key) if isinstance(mapping, dict) else None
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
            provider_base_url=self._provider.base_url,
            envelope=envelope,
            input_items=input_items,
        )
        call = self._call = _Call(ordinal)
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
        all waiting already, so nothing is delayed, and the bundle stays small."""
        position = 0
        while position < len(batch):
            event = batch[position]
            output = self._delta_target(call, event)
            if output is None:
                if self._on_event(call, event):
                    return True
                position += 1
                continue
            texts = [_str(event.data, "delta")]
            position += 1
            while position < len(batch) and self._delta_target(call, batch[position]) is output:
                texts.append(_str(batch[position].data, "delta"))
                position += 1
            self._text_delta(call, output, "".join(texts))
        return False

    @staticmethod
    def _delta_target(call: _Call, event: ProviderEvent) -> _Output | None:
        """The output a text delta is for; None for any other event (or an unplaceable delta)."""
        if event.type != "response.output_text.delta" or event.data is None:
            return None
        return call.find(_str(event.data, "item_id"), event.data.get("output_index"))

    def _text_delta(self, call: _Call, output: _Output, delta: str) -> None:
        self._recorder.output_text_delta(call.ordinal, output.ordinal, delta)
        self._thread.emit_delta(self._turn.id, output.client_id, delta)

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
            client_id=provider_id or _assign_item_id(item_type),
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
        self._recorder.provider_event(call.ordinal, "response.output_text.delta", raw)
        return False

    def _on_item_done(self, call: _Call, data: dict[str, Any], raw: str) -> bool:
        item = data.get("item")
        if not isinstance(item, dict):
            self._recorder.provider_event(call.ordinal, "response.output_item.done", raw)
            return False
        provider_id = _str(item, "id")
        item_type = _str(item, "type") or "message"
        output = call.find(provider_id, data.get("output_index"))
        if output is not None:
            output.done = True
            item_id = provider_id or output.client_id
            ordinal = output.ordinal
        else:
            item_id = provider_id or _assign_item_id(item_type)
            ordinal = 0
        self._recorder.output_item_done(
            call.ordinal, ordinal, item_id=item_id, assigned=not provider_id, payload=item
        )
        # Accepted: the item is part of the conversation whatever ends the call.
        self._thread.history.append(item)
        call.accepted += 1
        self._thread.emit(
            self._turn.id,
            item_completed=agent_pb2.ItemCompletedEvent(
                item=agent_pb2.Item(
                    id=item_id, type=item_type, role=_str(item, "role"), text=_text_of(item)
                )
            ),
        )
        return False

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
            _str(error, "message") or "the provider reported that the response failed",
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
            _str(source, "message") or "the provider sent an error event",
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
    "response.output_text.delta": TurnRunner._on_unplaced_delta,
    "response.output_item.done": TurnRunner._on_item_done,
    "response.completed": TurnRunner._on_completed,
    "response.failed": TurnRunner._on_failed,
    "response.incomplete": TurnRunner._on_incomplete,
    "error": TurnRunner._on_error,
}
