"""What the gateway needs to know of each API a client speaks: its conversation, hints, records.

Whatever the client speaks, the trace holds Responses API items (as the agent server's does), so
every reader works on gateway bundles unchanged: a Chat request's `messages` become the items
`trace_reducer.chat_messages` turns back into the same messages, and the upstream's chunks are
recorded through the agent server's Chat dialect (`agent_server.chat_completions`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agent_server import chat_completions
from agent_server.gateway._sessions import Session, SessionKey, hint_key
from agent_server.provider import Decode, ProviderEvent, parse_event
from agent_server.response import Response
from agent_server.sse import SseEvent
from grpc_common import Redactor
from rollout.trace.v1 import common_pb2
from trace_reducer import CHAT_API, canonical_json, chat_items, chat_messages

# Item fields that change between the provider's answer and the client's echo of it.
_VOLATILE = frozenset({"id", "status", "annotations", "logprobs"})


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


def _mapping(value: Any) -> Mapping[str, Any]:
    """A JSON object, or an empty one for anything else (a client's or upstream's body may put
    any JSON value where the API has an object)."""
    return value if isinstance(value, Mapping) else {}


def _json(value: Any) -> str:
    """An entry's fingerprint: the digest of its canonical JSON. A session keeps the
    fingerprints of its whole last exchange for as long as it is open; the JSON itself was a
    second copy of the conversation (1.2 times its text) for every open session."""
    return hashlib.blake2b(canonical_json(value), digest_size=16).hexdigest()


# What a leading system or developer message is fingerprinted as, whatever it says, in the
# second look continuation takes (Sessions.continuing): it is the conversation's instructions
# (the Responses API's `instructions`, no part of `input`), which an agent changes as it hands
# the conversation to another agent (the Agents SDK's handoffs on Chat Completions).
_INSTRUCTIONS = _json(["instructions"])


def without_instructions(
    entries: Sequence[Mapping[str, Any]], fingerprints: Sequence[str]
) -> tuple[str, ...] | None:
    """The fingerprints with those of the leading system and developer messages as one
    placeholder; None when there are none."""
    leading = 0
    for entry in entries:
        kind = entry.get("type") or ("message" if "role" in entry else "")
        if kind != "message" or entry.get("role") not in ("system", "developer"):
            break
        leading += 1
    if not leading:
        return None
    return (_INSTRUCTIONS,) * leading + tuple(fingerprints[leading:])


def _arguments(value: Any) -> Any:
    """A tool call's arguments as what they mean: clients re-encode the JSON they were given
    (pydantic-ai sends every call's arguments back compact: `{"a":1}` for the model's
    `{"a": 1}`), which made a conversation extend no exchange and split its run in two
    bundles. Arguments that are no JSON (or none a fingerprint can hold) stay as they are."""
    if not isinstance(value, str):
        return value
    try:
        return canonical_json(json.loads(value)).decode()
    except (ValueError, TypeError, RecursionError, OverflowError):
        return value


class CallRecorder:
    """One call's upstream answer, recorded through the agent server's own Response handler
    (the events a dialect's decoder makes of the stream, or of a whole answer)."""

    def __init__(
        self, dialect: Dialect, session: Session, ordinal: int, turn_id: str, redactor: Redactor
    ) -> None:
        self._dialect = dialect
        self.turn_id = turn_id
        # What this call's answers must never show (the upstream's key, the client's token).
        self.redactor = redactor
        self._response = Response(ordinal, session.thread, turn_id, session.on_tool_call, redactor)
        self._decode = dialect.decoder()
        self._history = session.thread.history
        self._mark = len(self._history)
        # A Chat answer's choices past 0 (n > 1): no part of the trace's conversation, but
        # what a client that goes on with one of them sends back.
        self._others = _OtherChoices() if dialect.name == ChatDialect.name else None

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
        """Record streamed events; True once a terminal one came. Raises ProviderError on a
        failure event (after recording it)."""
        batch = [found for event in events for found in self._decode(event.event, event.data)]
        if self._others is not None:
            for found in batch:
                if found.type == chat_completions.CHUNK_EVENT and isinstance(found.data, dict):
                    self._others.chunk(found.data)
        return bool(batch) and self._response.on_batch(batch)

    def on_end_of_stream(self) -> bool:
        """The stream ended cleanly without a terminal event: record what that end amounts to
        (a Chat stream whose choices all finished, without `[DONE]`, is a whole answer); True
        when the call completed with it."""
        batch = self._decode.end_of_stream()
        return bool(batch) and self._response.on_batch(batch)

    def on_body(self, body: Any, raw: str) -> None:
        """Record a whole (non-streamed) answer. Raises ProviderError when it says it failed."""
        if self._others is not None and isinstance(body, dict):
            self._others.body(body)
        self._response.on_batch(self._dialect.body_events(body, raw))

    def output_fingerprints(self) -> list[str]:
        """The accepted output, fingerprinted as the client will send it back."""
        return self._dialect.output_fingerprints(self._history[self._mark :])

    def other_choice_fingerprints(self) -> list[list[str]]:
        """Each other choice of a Chat answer (n > 1), fingerprinted as a client that goes on
        with it sends it back; by index."""
        if self._others is None:
            return []
        return [self._dialect.output_fingerprints(items) for items in self._others.items()]


class _OtherChoices:
    """The choices past 0 of one Chat answer, as Responses items: its text, refusal and
    function calls, from the streamed deltas or the whole answer's messages."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._refusal: dict[int, list[str]] = {}
        # Per choice, per tool call index: [id, name, argument pieces...].
        self._calls: dict[int, dict[int, list[str]]] = {}

    def _choices(self, data: Mapping[str, Any], field: str) -> list[tuple[int, Mapping[str, Any]]]:
        listed = data.get("choices")
        out = []
        for choice in listed if isinstance(listed, list) else []:
            index = choice.get("index") if isinstance(choice, dict) else None
            if isinstance(index, int) and not isinstance(index, bool) and index > 0:
                out.append((index, _mapping(choice.get(field))))
        return out

    def chunk(self, data: Mapping[str, Any]) -> None:
        for index, delta in self._choices(data, "delta"):
            self._add(index, delta)

    def body(self, data: Mapping[str, Any]) -> None:
        for index, message in self._choices(data, "message"):
            calls = message.get("tool_calls")
            numbered = dict(message)
            if isinstance(calls, list):
                numbered["tool_calls"] = [
                    {**call, "index": i} for i, call in enumerate(calls) if isinstance(call, dict)
                ]
            self._add(index, numbered)

    def _add(self, index: int, delta: Mapping[str, Any]) -> None:
        text = _text(delta.get("content"))
        if text or index not in self._text:
            self._text.setdefault(index, []).append(text)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._refusal.setdefault(index, []).append(refusal)
        for piece in chat_completions.tool_call_pieces(delta.get("tool_calls")):
            held = self._calls.setdefault(index, {}).setdefault(piece.position, ["", ""])
            if isinstance(piece.call_id, str) and not held[0]:
                held[0] = piece.call_id
            if isinstance(piece.name, str) and not held[1]:
                held[1] = piece.name
            if piece.arguments is not None:
                held.append(piece.arguments)

    def items(self) -> list[list[dict[str, Any]]]:
        out = []
        for index in sorted(self._text.keys() | self._calls.keys() | self._refusal.keys()):
            items: list[dict[str, Any]] = []
            text = "".join(self._text.get(index, []))
            refusal = "".join(self._refusal.get(index, []))
            if text or refusal:
                part = (
                    {"type": "refusal", "refusal": refusal}
                    if refusal and not text
                    else {"type": "output_text", "text": text}
                )
                items.append({"type": "message", "role": "assistant", "content": [part]})
            for _, (call_id, name, *pieces) in sorted(self._calls.get(index, {}).items()):
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call_id,
                        "name": name,
                        "arguments": "".join(pieces),
                    }
                )
            out.append(items)
        return out


class _ResponsesDecoder:
    """A Responses stream's events as they are; its end is its terminal event, nothing else."""

    def __call__(self, sse_event: str, raw: str) -> list[ProviderEvent]:
        # A Responses stream has no `[DONE]`; some servers send one anyway.
        return [] if raw.strip() == chat_completions.DONE_DATA else [parse_event(sse_event, raw)]

    def end_of_stream(self) -> list[ProviderEvent]:
        return []


class Dialect(Protocol):
    """One client API: how its requests carry the conversation, how its answers are recorded."""

    name: str
    # The path under the base URL, e.g. "/responses".
    path: str
    # `inference_started.provider_api`: how the reducer rebuilds the request body.
    provider_api: str

    def entries(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation as the client sent it (input items, or messages)."""

    def items(self, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Those entries as Responses items (what the trace records)."""

    def envelope(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The request body without its conversation."""

    def input_as_string(self, body: Mapping[str, Any]) -> bool:
        """Whether the conversation came as a string, the short form of one user message
        (`inference_started.input_as_string`: the trace gives the body back as it was)."""

    def fingerprint(self, entry: Mapping[str, Any]) -> str:
        """What stays the same when a client sends an entry back."""

    def output_fingerprints(self, items: Sequence[Mapping[str, Any]]) -> list[str]:
        """Accepted output items, fingerprinted as the client will send them back."""

    def hint(self, body: Mapping[str, Any], sessions: Any) -> SessionKey | None:
        """The session a request's own fields name, if any."""

    def decoder(self) -> Decode:
        """A fresh decoder of one stream's SSE events."""

    def body_events(self, body: Any, raw: str) -> list[ProviderEvent]:
        """The events a whole answer amounts to, itself first (kept verbatim)."""


def starts_turn(item: Mapping[str, Any]) -> bool:
    """A user message starts a turn (tool outputs continue one)."""
    kind = item.get("type") or ("message" if "role" in item else "")
    return kind == "message" and item.get("role") == "user"


def tool_output(item: Mapping[str, Any]) -> str | None:
    """The call id a function call output answers."""
    call_id = item.get("call_id")
    if item.get("type") == "function_call_output" and isinstance(call_id, str):
        return call_id
    return None


def _cache_key_hint(body: Mapping[str, Any]) -> SessionKey | None:
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        # Coding agents (Codex) set it to their conversation's id.
        return hint_key("prompt_cache_key", cache_key)
    return None


class ResponsesDialect:
    """The Responses API: `input` items, `previous_response_id`, response events."""

    name = "responses"
    path = "/responses"
    provider_api = ""

    def entries(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        value = body.get("input")
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, list):
            return [item if isinstance(item, dict) else {"value": item} for item in value]
        return []

    def items(self, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [dict(entry) for entry in entries]

    def envelope(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in body.items() if key != "input"}

    def input_as_string(self, body: Mapping[str, Any]) -> bool:
        return isinstance(body.get("input"), str)

    def fingerprint(self, entry: Mapping[str, Any]) -> str:
        kind = entry.get("type") or ("message" if "role" in entry else "")
        if kind == "message":
            return _json(["message", entry.get("role"), _text(entry.get("content"))])
        if kind == "function_call":
            arguments = _arguments(entry.get("arguments"))
            return _json(["call", entry.get("call_id"), entry.get("name"), arguments])
        if kind == "function_call_output":
            return _json(["output", entry.get("call_id"), _text(entry.get("output"))])
        return _json({k: v for k, v in entry.items() if k not in _VOLATILE})

    def output_fingerprints(self, items: Sequence[Mapping[str, Any]]) -> list[str]:
        return [self.fingerprint(item) for item in items]

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
            return hint_key("conversation", conversation)
        return _cache_key_hint(body)

    def decoder(self) -> Decode:
        return _ResponsesDecoder()

    def body_events(self, body: Any, raw: str) -> list[ProviderEvent]:
        if not isinstance(body, dict):
            return [ProviderEvent("response.completed", None, raw)]
        events = [ProviderEvent("response.created", {"response": {"id": body.get("id")}}, "")]
        output = body.get("output")
        for index, item in enumerate(output if isinstance(output, list) else []):
            if not isinstance(item, dict):
                continue
            placed = {"output_index": index, "item": item}
            events.append(ProviderEvent("response.output_item.added", placed, ""))
            events.append(ProviderEvent("response.output_item.done", placed, ""))
        status = body.get("status")
        terminal = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(
            status if isinstance(status, str) else "", "response.completed"
        )
        # The body itself is what the trace keeps verbatim, as the terminal event's data.
        events.append(ProviderEvent(terminal, {"type": terminal, "response": body}, raw))
        return events


class ChatDialect:
    """Chat Completions: `messages`, chunks recorded through the agent server's Chat dialect."""

    name = "chat"
    path = chat_completions.PATH
    provider_api = CHAT_API

    def entries(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        value = body.get("messages")
        if isinstance(value, list):
            return [entry if isinstance(entry, dict) else {"value": entry} for entry in value]
        return []

    def items(self, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Messages as Responses items, which `chat_messages("", items)` turns back into the
        same messages (`trace_reducer.chat_items`)."""
        return chat_items(entries)

    def envelope(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in body.items() if key != "messages"}

    def input_as_string(self, body: Mapping[str, Any]) -> bool:
        return False

    def fingerprint(self, entry: Mapping[str, Any]) -> str:
        calls = entry.get("tool_calls")
        return _json(
            [
                entry.get("role"),
                _text(entry.get("content")),
                entry.get("tool_call_id"),
                [
                    [
                        c.get("id"),
                        _mapping(c.get("function")).get("name"),
                        _arguments(_mapping(c.get("function")).get("arguments")),
                    ]
                    for c in (calls if isinstance(calls, list) else [])
                    if isinstance(c, dict)
                ],
            ]
        )

    def output_fingerprints(self, items: Sequence[Mapping[str, Any]]) -> list[str]:
        return [self.fingerprint(message) for message in chat_messages("", items)]

    def hint(self, body: Mapping[str, Any], sessions: Any) -> SessionKey | None:
        return _cache_key_hint(body)

    def decoder(self) -> Decode:
        return chat_completions.ChunkDecoder()

    def body_events(self, body: Any, raw: str) -> list[ProviderEvent]:
        """A whole `chat.completion`: kept verbatim, then read as the one chunk it amounts to."""
        if not isinstance(body, dict):
            return [ProviderEvent("chat.completion", None, raw)]
        events = [ProviderEvent("chat.completion", body, raw)]
        mapper = chat_completions.ChunkMapper()
        chunk = {key: value for key, value in body.items() if key != "choices"}
        choices = []
        listed = body.get("choices")
        for choice in listed if isinstance(listed, list) else []:
            if not isinstance(choice, dict):
                continue
            message = dict(_mapping(choice.get("message")))
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                message["tool_calls"] = [
                    {**call, "index": index}
                    for index, call in enumerate(calls)
                    if isinstance(call, dict)
                ]
            choices.append({**choice, "delta": message})
        chunk["choices"] = choices
        mapped = [*mapper.chunk(chunk), *mapper.done()]
        events.extend(ProviderEvent(m.type, m.data, "") for m in mapped)
        return events


RESPONSES = ResponsesDialect()
CHAT = ChatDialect()


def loads(raw: bytes) -> Any:
    """JSON of a request or response body; None when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
