"""What the gateway needs to know of each API a client speaks: items, turns, hints, records."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agent_server.gateway._sessions import Session, SessionKey
from agent_server.gateway._sse import SseEvent
from agent_server.provider import ProviderEvent, _parse
from agent_server.response import Response
from rollout.trace.v1 import common_pb2
from trace_reducer import canonical_json

# Item fields that change between the provider's answer and the client's echo of it.
_VOLATILE = frozenset({"id", "status", "annotations", "logprobs"})


class CallRecorder(Protocol):
    """One call's upstream answer, recorded as the agent server records a provider's."""

    @property
    def response_id(self) -> str: ...

    @property
    def usage(self) -> common_pb2.TokenUsage | None: ...

    @property
    def incomplete_reason(self) -> str: ...

    def on_events(self, events: Sequence[SseEvent]) -> bool:
        """Record streamed events; True once a terminal one came. Raises ProviderError on a
        failure event (after recording it)."""

    def on_body(self, body: Any, raw: str) -> None:
        """Record a whole (non-streamed) answer. Raises ProviderError when it says it failed."""

    def output_fingerprints(self) -> list[str]:
        """The accepted output, as the client will send it back."""


class Dialect(Protocol):
    """One client API: how its requests carry the conversation."""

    name: str
    # The path under the base URL, e.g. "/responses".
    path: str

    def input_items(self, body: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    def envelope(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def fingerprint(self, item: Mapping[str, Any]) -> str: ...

    def starts_turn(self, item: Mapping[str, Any]) -> bool: ...

    def tool_output(self, item: Mapping[str, Any]) -> str | None: ...

    def hint(self, body: Mapping[str, Any], sessions: Any) -> SessionKey | None: ...

    def recorder(self, session: Session, ordinal: int, turn_id: str) -> CallRecorder: ...


def _text(content: Any) -> str:
    """The text of a content string or list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text") or part.get("refusal") or ""
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text") or part.get("refusal"), str)
        )
    return ""


def _json(value: Any) -> str:
    return canonical_json(value).decode("ascii")


class ResponsesDialect:
    """The Responses API: `input` items, `previous_response_id`, response events."""

    name = "responses"
    path = "/responses"

    def input_items(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        value = body.get("input")
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, list):
            return [item if isinstance(item, dict) else {"value": item} for item in value]
        return []

    def envelope(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in body.items() if key != "input"}

    def fingerprint(self, item: Mapping[str, Any]) -> str:
        kind = item.get("type") or ("message" if "role" in item else "")
        if kind == "message":
            return _json(["message", item.get("role"), _text(item.get("content"))])
        if kind == "function_call":
            return _json(["call", item.get("call_id"), item.get("name"), item.get("arguments")])
        if kind == "function_call_output":
            return _json(["output", item.get("call_id"), _text(item.get("output"))])
        return _json({k: v for k, v in item.items() if k not in _VOLATILE})

    def starts_turn(self, item: Mapping[str, Any]) -> bool:
        kind = item.get("type") or ("message" if "role" in item else "")
        return kind == "message" and item.get("role") == "user"

    def tool_output(self, item: Mapping[str, Any]) -> str | None:
        call_id = item.get("call_id")
        if item.get("type") == "function_call_output" and isinstance(call_id, str):
            return call_id
        return None

    def hint(self, body: Mapping[str, Any], sessions: Any) -> SessionKey | None:
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            session = sessions.by_response(previous)
            if session is not None:
                return SessionKey(session.key, "hint:previous_response_id")
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if isinstance(conversation, str) and conversation:
            return SessionKey(f"conversation:{conversation}", "hint:conversation")
        cache_key = body.get("prompt_cache_key")
        if isinstance(cache_key, str) and cache_key:
            # Coding agents (Codex) set it to their conversation's id.
            return SessionKey(f"prompt_cache_key:{cache_key}", "hint:prompt_cache_key")
        return None

    def recorder(self, session: Session, ordinal: int, turn_id: str) -> CallRecorder:
        return _ResponsesCall(self, session, ordinal, turn_id)


class _ResponsesCall:
    """The agent server's own Response handler, fed the upstream's events."""

    def __init__(
        self, dialect: ResponsesDialect, session: Session, ordinal: int, turn_id: str
    ) -> None:
        self._dialect = dialect
        self._response = Response(ordinal, session.thread, turn_id, session.on_tool_call)
        self._history = session.thread.history
        self._mark = len(self._history)

    @property
    def response_id(self) -> str:
        return self._response.response_id

    @property
    def usage(self) -> common_pb2.TokenUsage | None:
        return self._response.usage

    @property
    def incomplete_reason(self) -> str:
        return self._response.incomplete_reason

    def on_events(self, events: Sequence[SseEvent]) -> bool:
        batch = [_parse(event.event, event.data) for event in events if event.data != "[DONE]"]
        return bool(batch) and self._response.on_batch(batch)

    def on_body(self, body: Any, raw: str) -> None:
        if not isinstance(body, dict):
            self._response.on_batch([ProviderEvent("response.completed", None, raw)])
            return
        events = [ProviderEvent("response.created", {"response": {"id": body.get("id")}}, "")]
        output = body.get("output")
        for index, item in enumerate(output if isinstance(output, list) else []):
            if not isinstance(item, dict):
                continue
            placed = {"output_index": index, "item": item}
            events.append(ProviderEvent("response.output_item.added", placed, ""))
            events.append(ProviderEvent("response.output_item.done", placed, ""))
        status = body.get("status")
        terminal = {
            "failed": "response.failed",
            "incomplete": "response.incomplete",
        }.get(status if isinstance(status, str) else "", "response.completed")
        # The body itself is what the trace keeps verbatim, as the terminal event's data.
        events.append(ProviderEvent(terminal, {"type": terminal, "response": body}, raw))
        self._response.on_batch(events)

    def output_fingerprints(self) -> list[str]:
        return [self._dialect.fingerprint(item) for item in self._history[self._mark :]]


def loads(raw: bytes) -> Any:
    """JSON of a request or response body; None when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
