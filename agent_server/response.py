"""One inference call's response: each provider event recorded, then told to the clients."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from agent_server.events import MAX_DELTA_CHARS
from agent_server.provider import ProviderError, ProviderEvent
from agent_server.recorder import Recorder
from agent_server.threads import Thread
from agent_server.tools import ToolCall, new_tool_call_id
from grpc_common import Redactor
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import LENGTH_REASONS, delta_tokens

# Provider-supplied ids and words are clipped before the trace or a client sees them (the
# same value to both): a hostile 5 MiB id must not stop the recording or a client's stream.
MAX_ID_CHARS = 1024
MAX_MESSAGE_CHARS = 16 * 1024
# A provider's counts and indexes are kept when they fit the signed 64-bit integers that every
# reader of the trace (JSON, Parquet, Arrow) holds them in, and uint32 output indexes; anything
# else is left out (the raw event keeps it verbatim) rather than costing the turn.
MAX_COUNT = 2**63 - 1
MAX_OUTPUT_INDEX = 2**32 - 1

DeltaKind: TypeAlias = record_pb2.DeltaKind.ValueType
_TEXT = record_pb2.DELTA_KIND_UNSPECIFIED
_REFUSAL = record_pb2.DELTA_KIND_REFUSAL
_REASONING = record_pb2.DELTA_KIND_REASONING_SUMMARY
_ARGUMENTS = record_pb2.DELTA_KIND_FUNCTION_ARGUMENTS
_ITEM_TYPE_OF: dict[DeltaKind, str] = {_REASONING: "reasoning", _ARGUMENTS: "function_call"}
DELTA_EVENTS: dict[str, DeltaKind] = {
    "response.output_text.delta": _TEXT,
    "response.refusal.delta": _REFUSAL,
    "response.reasoning_summary_text.delta": _REASONING,
    "response.function_call_arguments.delta": _ARGUMENTS,
}


@dataclass
class _Output:
    """An output item of the response, from output_item.added until output_item.done."""

    ordinal: int
    provider_id: str
    client_id: str
    type: str
    role: str
    output_index: int
    call_id: str = ""
    done: bool = False
    # Some delta of the item came with tokens (a `.done` then adds none).
    tokens: bool = False
    # What clients were sent as deltas of this item, by kind.
    streamed: dict[DeltaKind, list[str]] = field(default_factory=dict)


def _assign_item_id(item_type: str) -> str:
    prefix = "msg" if item_type == "message" else "item"
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(response: Any) -> common_pb2.TokenUsage | None:
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None

    def count(source: Any, key: str) -> int:
        value = source.get(key) if isinstance(source, dict) else None
        return _bounded(value, MAX_COUNT) or 0

    return common_pb2.TokenUsage(
        input_tokens=count(usage, "input_tokens"),
        output_tokens=count(usage, "output_tokens"),
        total_tokens=count(usage, "total_tokens"),
        cached_input_tokens=count(usage.get("input_tokens_details"), "cached_tokens"),
        reasoning_tokens=count(usage.get("output_tokens_details"), "reasoning_tokens"),
    )


def _bounded(value: Any, limit: int) -> int | None:
    """value when it is an integer from 0 to limit (a JSON integer has no bound), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit:
        return value
    return None


def _clip(value: str, limit: int = MAX_ID_CHARS) -> str:
    if len(value) <= limit:
        return value
    return f"{value[: limit - 40]}...[clipped from {len(value)} chars]"


def _has_tokens(data: dict[str, Any]) -> bool:
    return bool(data.get("logprobs") or data.get("token_ids"))


def _str(mapping: Any, key: str, limit: int = MAX_ID_CHARS) -> str:
    """A provider string field ('' when absent or not a string), clipped to limit."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    return _clip(value, limit) if isinstance(value, str) else ""


def _delta(mapping: dict[str, Any]) -> str:
    """The text of a delta event, never clipped (it is split instead where it must be)."""
    value = mapping.get("delta")
    return value if isinstance(value, str) else ""


def _texts_of(item: dict[str, Any]) -> dict[DeltaKind, str]:
    """The texts of an accepted item by kind: output text, refusal, reasoning summary,
    function arguments (each concatenated over its parts)."""
    texts: dict[DeltaKind, list[str]] = {}
    content = item.get("content")
    if isinstance(content, str):
        texts[_TEXT] = [content]
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str):
                texts.setdefault(_TEXT, []).append(part["text"])
            elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                texts.setdefault(_REFUSAL, []).append(part["refusal"])
    summary = item.get("summary")
    if isinstance(summary, list):
        for part in summary:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.setdefault(_REASONING, []).append(part["text"])
    if isinstance(item.get("arguments"), str):
        texts[_ARGUMENTS] = [item["arguments"]]
    return {kind: "".join(parts) for kind, parts in texts.items()}


class Response:
    """The events of one attempt, handled in order: each is recorded before any client hears
    of it. Accepted items join the thread's history; accepted function calls become tool
    calls (announced through `on_tool_call`)."""

    def __init__(
        self,
        ordinal: int,
        thread: Thread,
        turn_id: str,
        on_tool_call: Callable[[ToolCall], None],
        redactor: Redactor,
    ) -> None:
        self.ordinal = ordinal
        self.response_id = ""
        self.usage: common_pb2.TokenUsage | None = None
        self.accepted = 0
        self.tool_calls: list[ToolCall] = []
        self._outputs: list[_Output] = []
        # The client ids of _outputs, for a new item's id in O(1).
        self._client_ids: set[str] = set()
        self._thread = thread
        self._recorder: Recorder = thread.recorder
        self._turn_id = turn_id
        self._on_tool_call = on_tool_call
        # `response.incomplete`'s reason, as `response.incomplete:<reason>`, once it came.
        self.incomplete_reason = ""
        self._prompt_tokens = False
        # The provider's key and URL credentials, taken out of what its events may echo.
        self._redactor = redactor

    # -- finding outputs -----------------------------------------------------------------------

    def _find(self, provider_id: str, output_index: Any = None) -> _Output | None:
        """The open output an event is about: by id (by output index among several with that
        id, else the latest of them), else by output index, else the latest open one (without
        an id of its own when the event names an id nobody announced)."""
        latest = self._outputs[-1] if self._outputs else None
        if (
            latest is not None
            and not latest.done
            and provider_id
            and provider_id == latest.client_id == latest.provider_id
            and (not isinstance(output_index, int) or output_index == latest.output_index)
        ):
            # Nearly every event is a delta of the item added last: no search for it. Its
            # client id equals the provider's only when no other item of the response had it.
            return latest
        open_outputs = [output for output in self._outputs if not output.done]
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

    def _client_id_for(self, provider_id: str, item_type: str) -> str:
        """The provider's id, unless an output of this response already has it: two items of
        a response must never share the id clients and the trace know them by."""
        client_id = (
            provider_id
            if provider_id and provider_id not in self._client_ids
            else _assign_item_id(item_type)
        )
        self._client_ids.add(client_id)
        return client_id

    # -- batches -------------------------------------------------------------------------------

    def on_batch(self, batch: list[ProviderEvent]) -> bool:
        """Handle events that arrived together; True once the response completed.

        A run of deltas for one item becomes one record and one client event: they were all
        waiting already, so nothing is delayed, and the bundle stays small. When an event
        fails the attempt, the rest of the batch is still recorded (and what it completes is
        accepted) before the first failure ends the attempt."""
        failure: ProviderError | None = None
        position = 0
        while position < len(batch):
            event = batch[position]
            output = self._delta_target(event)
            if output is None:
                try:
                    if self._on_event(event) and failure is None:
                        return True
                except ProviderError as error:
                    failure = failure or error
                position += 1
                continue
            data = event.data or {}
            texts = [_delta(data)]
            position += 1
            tokens = self._tokens(data, texts[0])
            # A delta with tokens is recorded alone: its columns describe its own text.
            while tokens is None and position < len(batch):
                following = batch[position]
                if following.type != event.type or self._delta_target(following) is not output:
                    break
                if _has_tokens(following.data or {}):
                    break
                texts.append(_delta(following.data or {}))
                position += 1
            self._delta(output, DELTA_EVENTS[event.type], "".join(texts), tokens)
        if failure is not None:
            raise failure
        return False

    def _delta_target(self, event: ProviderEvent) -> _Output | None:
        """The output a delta is for; None for any other event (or a delta nobody announced
        an item for)."""
        kind = DELTA_EVENTS.get(event.type)
        if kind is None or event.data is None:
            return None
        output = self._find(_str(event.data, "item_id"), event.data.get("output_index"))
        # Reasoning and arguments only ever belong to an item of their own type.
        wanted = _ITEM_TYPE_OF.get(kind)
        if output is not None and wanted is not None and output.type != wanted:
            return None
        return output

    def _tokens(self, data: dict[str, Any], text: str) -> common_pb2.DeltaTokens | None:
        """The tokens an event carries (logprobs, engine ids), its prompt's ids recorded once."""
        if not _has_tokens(data):
            return None
        self._take_prompt_tokens(data)
        return delta_tokens(text, data.get("logprobs"), data.get("token_ids"))

    def _take_prompt_tokens(self, data: Any) -> None:
        """vLLM-style `prompt_token_ids`, on the event or its `response`: recorded once."""
        if self._prompt_tokens or not isinstance(data, dict):
            return
        ids = data.get("prompt_token_ids")
        if ids is None and isinstance(data.get("response"), dict):
            ids = data["response"].get("prompt_token_ids")
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids)
        ):
            self._prompt_tokens = True
            self._recorder.prompt_tokens(self.ordinal, ids)

    def _delta(
        self,
        output: _Output,
        kind: DeltaKind,
        delta: str,
        tokens: common_pb2.DeltaTokens | None = None,
    ) -> None:
        self._recorder.output_text_delta(
            self.ordinal, output.ordinal, delta, kind=kind, tokens=tokens
        )
        if tokens is not None:
            output.tokens = True
        if not delta:
            return
        output.streamed.setdefault(kind, []).append(delta)
        self._emit_delta(output, kind, delta)

    def _on_text_done(self, data: dict[str, Any], raw: str) -> bool:
        """`response.output_text.done`: kept verbatim; its logprobs, when the deltas brought
        none, are recorded as the item's tokens (a delta record without text)."""
        self._verbatim("response.output_text.done", raw)
        output = self._find(_str(data, "item_id"), data.get("output_index"))
        if output is None or output.tokens or not _has_tokens(data):
            return False
        text = _delta({"delta": data.get("text")})
        tokens = delta_tokens(text, data.get("logprobs"), data.get("token_ids"))
        if tokens is not None:
            if tokens.text_lengths:
                # The record carries no text for the lengths to measure: spell the tokens.
                pieces, start = [], 0
                for length in tokens.text_lengths:
                    pieces.append(text[start : start + length])
                    start += length
                tokens.ClearField("text_lengths")
                tokens.texts.extend(pieces)
            self._take_prompt_tokens(data)
            self._delta(output, _TEXT, "", tokens)
        return False

    def _emit_delta(self, output: _Output, kind: DeltaKind, delta: str) -> None:
        thread, turn_id, item_id = self._thread, self._turn_id, output.client_id
        if kind in (_TEXT, _REFUSAL):
            thread.emit_delta(turn_id, item_id, delta, refusal=kind == _REFUSAL)
            return
        for start in range(0, len(delta), MAX_DELTA_CHARS):
            piece = delta[start : start + MAX_DELTA_CHARS]
            if kind == _REASONING:
                thread.emit(
                    turn_id,
                    reasoning_delta=agent_pb2.ReasoningDeltaEvent(item_id=item_id, delta=piece),
                )
            else:
                thread.emit(
                    turn_id,
                    tool_call_arguments_delta=agent_pb2.ToolCallArgumentsDeltaEvent(
                        item_id=item_id, call_id=output.call_id, delta=piece
                    ),
                )

    # -- single events -------------------------------------------------------------------------

    def _on_event(self, event: ProviderEvent) -> bool:
        """Handle one event; True once the response completed. Raises ProviderError on failure."""
        data = event.data
        if data is None:
            self._verbatim(_clip(event.type), event.raw)
            raise ProviderError(
                "malformed_event",
                f"the provider sent an event that is not a JSON object ({_clip(event.type, 100)})",
            )
        handler = _HANDLERS.get(event.type)
        if handler is None:
            self._verbatim(_clip(event.type), event.raw)
            return False
        return handler(self, data, event.raw)

    def _verbatim(self, event_type: str, raw: str) -> None:
        """Keep an event as the provider sent it. An event a dialect derived from another
        (a Chat chunk's Responses events) has no bytes of its own: its source was kept."""
        if raw:
            self._recorder.provider_event(self.ordinal, event_type, self._redactor.data(raw))

    def _on_created(self, data: dict[str, Any], raw: str) -> bool:
        self.response_id = _str(data.get("response"), "id") or self.response_id
        self._recorder.response_created(self.ordinal, self.response_id)
        self._take_prompt_tokens(data)
        return False

    def _on_item_added(self, data: dict[str, Any], raw: str) -> bool:
        item = data.get("item")
        if not isinstance(item, dict):
            self._verbatim("response.output_item.added", raw)
            return False
        provider_id = _str(item, "id")
        item_type = _str(item, "type") or "message"
        role = _str(item, "role")
        index = _bounded(data.get("output_index"), MAX_OUTPUT_INDEX)
        output_index = index if index is not None else len(self._outputs)
        output = _Output(
            ordinal=self._recorder.output_item_added(
                self.ordinal,
                provider_item_id=provider_id,
                item_type=item_type,
                role=role,
                output_index=output_index,
            ),
            provider_id=provider_id,
            client_id=self._client_id_for(provider_id, item_type),
            type=item_type,
            role=role,
            output_index=output_index,
            call_id=_str(item, "call_id"),
        )
        self._outputs.append(output)
        self._thread.emit(
            self._turn_id,
            item_started=agent_pb2.ItemStartedEvent(
                item=agent_pb2.Item(id=output.client_id, type=item_type, role=role)
            ),
        )
        return False

    def _on_unplaced_delta(self, data: dict[str, Any], raw: str) -> bool:
        # A delta for an item that was never announced: kept verbatim, nobody to show it to.
        self._verbatim(_str(data, "type"), raw)
        return False

    def _on_item_done(self, data: dict[str, Any], raw: str) -> bool:
        item = data.get("item")
        if not isinstance(item, dict):
            self._verbatim("response.output_item.done", raw)
            return False
        provider_id = _str(item, "id")
        item_type = _str(item, "type") or "message"
        output = self._find(provider_id, data.get("output_index"))
        if output is None:
            # Never announced: it still takes an id no other item of the response has.
            output = _Output(
                ordinal=0,
                provider_id=provider_id,
                client_id=self._client_id_for(provider_id, item_type),
                type=item_type,
                role=_str(item, "role"),
                output_index=-1,
            )
            self._outputs.append(output)
        output.done = True
        item_id = output.client_id
        self._recorder.output_item_done(
            self.ordinal,
            output.ordinal,
            item_id=item_id,
            assigned=item_id != provider_id,
            payload=item,
        )
        # Accepted: the item is part of the conversation whatever ends the call.
        self._thread.history.append(item)
        self._thread.accepted_items.add(item_id)
        self.accepted += 1
        texts = _texts_of(item)
        completed = agent_pb2.Item(id=item_id, type=item_type, role=_str(item, "role"))
        shown = {kind: text for kind, text in texts.items() if kind != _ARGUMENTS}
        if sum(map(len, shown.values())) <= MAX_DELTA_CHARS:
            completed.text = shown.get(_TEXT, "") or shown.get(_REASONING, "")
            completed.refusal = shown.get(_REFUSAL, "")
        else:
            for kind, text in shown.items():
                self._complete_in_deltas(output, kind, text)
            completed.text_in_deltas = True
        tool_call = (
            self._tool_call(item, item_id, texts.get(_ARGUMENTS))
            if item_type == ("function_call")
            else None
        )
        requested = None
        if tool_call is not None:
            requested = agent_pb2.ToolCallRequestedEvent(
                item_id=item_id, call_id=tool_call.call_id, name=tool_call.name
            )
            if len(tool_call.arguments) <= MAX_DELTA_CHARS:
                requested.arguments = tool_call.arguments
            else:
                self._complete_in_deltas(output, _ARGUMENTS, tool_call.arguments)
                requested.arguments_in_deltas = True
        output.streamed.clear()
        self._thread.emit(
            self._turn_id, item_completed=agent_pb2.ItemCompletedEvent(item=completed)
        )
        if tool_call is not None and requested is not None:
            self._thread.emit(self._turn_id, tool_call_requested=requested)
            self._on_tool_call(tool_call)
        return False

    def _tool_call(self, item: dict[str, Any], item_id: str, arguments: str | None) -> ToolCall:
        """Record the accepted function call as a tool call of the turn."""
        call_id = _str(item, "call_id") or item_id
        name = _str(item, "name")
        arguments = arguments or ""
        tool_call_id = new_tool_call_id()
        ordinal = self._recorder.tool_call_started(
            self.ordinal,
            tool_call_id=tool_call_id,
            call_id=call_id,
            name=name,
            item_id=item_id,
            arguments=arguments,
        )
        call = ToolCall(ordinal, tool_call_id, call_id, name, item_id, arguments)
        self.tool_calls.append(call)
        return call

    def _complete_in_deltas(self, output: _Output, kind: DeltaKind, final: str) -> None:
        """Stream what the deltas have not carried yet of a text too large for one event, so
        that its deltas hold all of it (it was recorded whole, in the item's payload)."""
        streamed = "".join(output.streamed.get(kind, ()))
        if not final.startswith(streamed):
            self._thread.emit(
                self._turn_id,
                error=agent_pb2.ErrorEvent(
                    code="item_text_mismatch",
                    message=f"item {output.client_id}: the provider's final text does not "
                    "extend what it streamed and is too large for one event; the trace has both",
                ),
            )
            return
        rest = final[len(streamed) :]
        if rest:
            self._emit_delta(output, kind, rest)

    def _on_completed(self, data: dict[str, Any], raw: str) -> bool:
        self._verbatim("response.completed", raw)
        self._take_prompt_tokens(data)
        response = self._take_response(data)
        if isinstance(response, dict) and response.get("status") == "incomplete":
            # vLLM ends a max_output_tokens cut this way: the same as `response.incomplete`.
            return self._incomplete(response)
        return True

    def _on_failed(self, data: dict[str, Any], raw: str) -> bool:
        self._verbatim("response.failed", raw)
        response = self._take_response(data)
        error = response.get("error") if isinstance(response, dict) else None
        raise ProviderError(
            self._said(error, "code") or "response_failed",
            self._said(error, "message", MAX_MESSAGE_CHARS)
            or "the provider reported that the response failed",
            reason="response.failed",
        )

    def _on_incomplete(self, data: dict[str, Any], raw: str) -> bool:
        self._verbatim("response.incomplete", raw)
        return self._incomplete(self._take_response(data))

    def _incomplete(self, response: Any) -> bool:
        """A response that ended early. Cut at the output limit, it is an answer (True: the
        call completed, its stop reason LENGTH, what was accepted kept); for any other
        reason (a content filter) the provider withheld it: ProviderError."""
        details = response.get("incomplete_details") if isinstance(response, dict) else None
        why = _str(details, "reason") or "unknown reason"
        self.incomplete_reason = f"response.incomplete:{why}"
        if why in LENGTH_REASONS:
            return True
        raise ProviderError(
            "response_incomplete",
            f"the provider ended the response incomplete: {why}",
            reason="response.incomplete",
        )

    def _on_error(self, data: dict[str, Any], raw: str) -> bool:
        self._verbatim("error", raw)
        nested = data.get("error")
        source = nested if isinstance(nested, dict) else data
        raise ProviderError(
            self._said(source, "code") or self._said(source, "type") or "provider_error",
            self._said(source, "message", MAX_MESSAGE_CHARS) or "the provider sent an error event",
            reason="error",
        )

    def _said(self, mapping: Any, key: str, limit: int = MAX_ID_CHARS) -> str:
        """What an error event says in a field, without the secrets it may echo (taken out
        before the text is clipped, so no part of one is left)."""
        value = mapping.get(key) if isinstance(mapping, dict) else None
        return _clip(self._redactor.text(value), limit) if isinstance(value, str) else ""

    def _take_response(self, data: dict[str, Any]) -> Any:
        response = data.get("response")
        self.response_id = _str(response, "id") or self.response_id
        usage = _usage(response)
        if usage is not None:
            self.usage = usage
            self._thread.emit(
                self._turn_id,
                token_usage=agent_pb2.TokenUsageEvent(
                    input_tokens=usage.input_tokens,
                    output_tokens=usage.output_tokens,
                    total_tokens=usage.total_tokens,
                ),
            )
        return response


_HANDLERS: dict[str, Callable[[Response, dict[str, Any], str], bool]] = {
    "response.created": Response._on_created,
    "response.output_item.added": Response._on_item_added,
    **{event_type: Response._on_unplaced_delta for event_type in DELTA_EVENTS},
    "response.output_item.done": Response._on_item_done,
    "response.output_text.done": Response._on_text_done,
    "response.completed": Response._on_completed,
    "response.failed": Response._on_failed,
    "response.incomplete": Response._on_incomplete,
    "error": Response._on_error,
}
