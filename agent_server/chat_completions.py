"""The Chat Completions dialect: requests from a thread's items, streamed chunks as events.

A thread's history stays in Responses API items whichever dialect its provider speaks, so the
reducer and everything after it never see a difference. This module translates both ways:

* `envelope` and `request_body` turn the Responses-style envelope and input items into a
  `POST /chat/completions` body (`trace_reducer.chat_messages` makes the messages, so the
  reducer rebuilds the same body from the trace).
* `ChunkMapper` turns each streamed chunk into the Responses events it amounts to, after the
  chunk itself (kept verbatim, event type `chat.completion.chunk`). It is pure: the agent's
  `Response` records and announces what it yields; a gateway or a replayer can use it alone.

A chunk has no item ids: each item gets `{completion id}/{output index}` (the `id` of the
completion and the item's place in it), stable across replays of the same stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agent_server.provider import EncodedItems, ProviderEvent, parse_event
from trace_reducer import LOGPROBS_INCLUDE, canonical_json, chat_messages

CHUNK_EVENT = "chat.completion.chunk"
DONE_EVENT = "chat.completion.done"
DONE_DATA = "[DONE]"
PATH = "/chat/completions"


def stream_ended_message(stream: str, *, chat: bool = True) -> str:
    """The failure a stream that ended without a terminal event records (`stream_ended`),
    `stream` naming whose it was (`upstream`, `provider`): for a Chat stream, that it was cut
    before every choice had its finish_reason, which ChunkMapper.end_of_stream takes as whole.
    The agent and the gateway say it in these words alike."""
    said = f"the {stream} stream ended without a terminal event"
    return f"{said} (a Chat stream: before every choice had its finish_reason)" if chat else said


def item_id(completion_id: str, output_index: int) -> str:
    """The id of the item at output_index of a completion: stable, derived, documented."""
    return f"{completion_id}/{output_index}"


# -- requests -----------------------------------------------------------------------------------


def _tool(entry: Mapping[str, Any]) -> dict[str, Any]:
    function = {key: entry[key] for key in ("name", "description", "parameters") if key in entry}
    if "strict" in entry:
        function["strict"] = entry["strict"]
    return {"type": "function", "function": function}


def tool_choice(choice: Any) -> Any:
    """A Responses `tool_choice` in Chat's spelling (a named function nests its name)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    return choice


def envelope(responses_envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The Chat request body without `messages`, from the Responses one without `input`.

    `instructions` is not a Chat field: it leaves the envelope and becomes the system message.
    Usage is always asked for (`stream_options.include_usage`)."""
    out: dict[str, Any] = {"stream_options": {"include_usage": True}}
    for key, value in responses_envelope.items():
        if key in ("store", "instructions"):
            continue
        if key == "tools":
            out["tools"] = [_tool(entry) for entry in value]
        elif key == "include":
            if LOGPROBS_INCLUDE in value:
                out["logprobs"] = True
        elif key == "max_output_tokens":
            out["max_tokens"] = value
        elif key == "tool_choice":
            out["tool_choice"] = tool_choice(value)
        else:
            out[key] = value
    if out.get("top_logprobs"):
        out["logprobs"] = True
    return out


def request_body(
    chat_envelope: Mapping[str, Any], instructions: str, items: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """What is posted: the envelope plus the messages (rebuildable from the trace: the
    thread's instructions and the call's input items)."""
    return {**chat_envelope, "messages": chat_messages(instructions, items)}


# -- responses ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MappedEvent:
    """A Responses-shaped event a chunk amounts to: `raw` empty (the chunk holds the bytes)."""

    type: str
    data: dict[str, Any]


@dataclass
class _Item:
    output_index: int
    id: str
    type: str
    call_id: str = ""
    name: str = ""
    text: list[str] = field(default_factory=list)


def _ids(value: Any) -> list[int]:
    if isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        return list(value)
    return []


def _entries(logprobs: Any) -> list[dict[str, Any]]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return (
        [entry for entry in content if isinstance(entry, dict)] if isinstance(content, list) else []
    )


_EVENT_OF = {
    "message": "response.output_text.delta",
    # A message that is a refusal (`delta.refusal`, `message.refusal`: OpenAI's structured
    # outputs), as the Responses API has it: a message item with a `refusal` part.
    "refusal": "response.refusal.delta",
    "reasoning": "response.reasoning_summary_text.delta",
    "function_call": "response.function_call_arguments.delta",
}
_LENGTH = "length"
_FILTERED = "content_filter"


class ChunkMapper:
    """One streamed completion's chunks → Responses events, in order.

    Token ids and logprobs a chunk carries go with the delta of that chunk; tokens that come
    with no text of an item (a tool call's markup, the end-of-sequence token) go with the
    next delta of an item, else with the last open item when the completion finishes, so
    every sampled id is recorded against an item."""

    def __init__(self) -> None:
        self.completion_id = ""
        self.model = ""
        self.finish_reason = ""
        self._created = False
        self._finished = False
        self._ended = False
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._ids: list[int] = []
        self._logprobs: list[dict[str, Any]] = []
        self._usage: dict[str, Any] | None = None
        # The choices seen (n > 1 streams several, by index) and those that finished: a stream
        # may end without `[DONE]` once every choice has its finish_reason.
        self._choices: set[int] = set()
        self._finished_choices: set[int] = set()

    @property
    def ended(self) -> bool:
        return self._ended

    def chunk(self, data: Mapping[str, Any]) -> list[MappedEvent]:
        """The events one parsed chunk amounts to."""
        out: list[MappedEvent] = []
        if data.get("object") == "error" or isinstance(data.get("error"), dict):
            error = data.get("error") if isinstance(data.get("error"), dict) else data
            assert isinstance(error, Mapping)
            out.append(MappedEvent("error", {"type": "error", "error": dict(error)}))
            self._ended = True
            return out
        if not self._created:
            self._created = True
            self.completion_id = str(data.get("id") or "chatcmpl")
            self.model = str(data.get("model") or "")
            response: dict[str, Any] = {
                "id": self.completion_id,
                "object": "response",
                "model": self.model,
                "status": "in_progress",
            }
            prompt = _ids(data.get("prompt_token_ids"))
            if prompt:
                response["prompt_token_ids"] = prompt
            out.append(MappedEvent("response.created", {"response": response}))
        usage = data.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = data.get("choices")
        for listed in choices if isinstance(choices, list) else []:
            if isinstance(listed, dict):
                index = listed.get("index", 0)
                self._choices.add(index if isinstance(index, int) else 0)
                reason = listed.get("finish_reason")
                if isinstance(reason, str) and reason:
                    self._finished_choices.add(index if isinstance(index, int) else 0)
        choice = (
            next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
            if isinstance(choices, list)
            else None
        )
        if choice is not None and not self._finished:
            self._ids.extend(_ids(choice.get("token_ids")))
            self._logprobs.extend(_entries(choice.get("logprobs")))
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out.extend(self._delta(delta))
            if self._open is not None and (self._ids or self._logprobs):
                out.append(self._text_event(self._open, ""))
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason
                out.extend(self._finish())
        return out

    def done(self) -> list[MappedEvent]:
        """`data: [DONE]`: the terminal event, unless the stream never finished a choice.

        The usage chunk comes between the finish and `[DONE]`: the response ends here, so the
        stream is read to its end (and its connection can serve the next request)."""
        if not self._finished:
            return []
        return self._end()

    def end_of_stream(self) -> list[MappedEvent]:
        """The stream ended cleanly without `[DONE]`: the terminal event when every choice it
        streamed has its finish_reason (the openai SDK takes such a stream as whole, so it is
        an answer), else nothing (it was cut: the call fails)."""
        if not self._finished or not self._choices <= self._finished_choices:
            return []
        return self._end()

    def _delta(self, delta: Mapping[str, Any]) -> list[MappedEvent]:
        out: list[MappedEvent] = []
        for key in ("reasoning_content", "reasoning"):
            text = delta.get(key)
            if isinstance(text, str) and text:
                out.extend(self._append("reasoning", text))
                break
        content = delta.get("content")
        if isinstance(content, str) and content:
            out.extend(self._append("message", content))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            out.extend(self._append("refusal", refusal))
        for piece in tool_call_pieces(delta.get("tool_calls")):
            item = self._calls.get(piece.position)
            if item is None:
                item = self._begin("function_call", out)
                item.call_id = str(piece.call_id or item.id)
                item.name = str(piece.name or "")
                self._calls[piece.position] = item
                out.append(self._added(item))
            arguments = piece.arguments
            if arguments is not None and (arguments or self._ids or self._logprobs):
                item.text.append(arguments)
                out.append(self._text_event(item, arguments))
        return out

    def _append(self, kind: str, text: str) -> list[MappedEvent]:
        out: list[MappedEvent] = []
        item = self._open
        if item is None or item.type != kind:
            item = self._begin(kind, out)
            out.append(self._added(item))
        item.text.append(text)
        out.append(self._text_event(item, text))
        return out

    def _begin(self, kind: str, out: list[MappedEvent]) -> _Item:
        """A new item; the open one is done first (it is complete once another starts)."""
        if self._open is not None:
            out.append(self._item_done(self._open, "completed"))
        index = len(self._items)
        item = _Item(index, item_id(self.completion_id, index), kind)
        self._items.append(item)
        self._open = item
        return item

    def _added(self, item: _Item) -> MappedEvent:
        payload: dict[str, Any] = {"id": item.id, "type": item.type, "status": "in_progress"}
        if item.type in ("message", "refusal"):
            payload.update(type="message", role="assistant", content=[])
        elif item.type == "function_call":
            payload.update(call_id=item.call_id, name=item.name, arguments="")
        else:
            payload["summary"] = []
        return MappedEvent(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": item.output_index,
                "item": payload,
            },
        )

    def _text_event(self, item: _Item, text: str) -> MappedEvent:
        data: dict[str, Any] = {
            "type": _EVENT_OF[item.type],
            "item_id": item.id,
            "output_index": item.output_index,
            "delta": text,
        }
        if self._ids:
            data["token_ids"], self._ids = self._ids, []
        if self._logprobs:
            data["logprobs"], self._logprobs = self._logprobs, []
        return MappedEvent(data["type"], data)

    def _item_done(self, item: _Item, status: str) -> MappedEvent:
        text = "".join(item.text)
        payload: dict[str, Any] = {"id": item.id, "type": item.type, "status": status}
        if item.type == "message":
            payload.update(
                role="assistant",
                content=[{"type": "output_text", "text": text, "annotations": []}],
            )
        elif item.type == "refusal":
            payload.update(
                type="message", role="assistant", content=[{"type": "refusal", "refusal": text}]
            )
        elif item.type == "function_call":
            payload.update(call_id=item.call_id, name=item.name, arguments=text)
        else:
            payload["summary"] = [{"type": "summary_text", "text": text}]
        return MappedEvent(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "output_index": item.output_index,
                "item": payload,
            },
        )

    def _finish(self) -> list[MappedEvent]:
        """The choice finished: its leftover tokens go with the last item, every open item is
        done (accepted, a cut one too: a truncated answer is still an answer)."""
        self._finished = True
        out: list[MappedEvent] = []
        if self._ids or self._logprobs:
            if self._open is None:
                out.append(self._added(self._begin("message", out)))
            assert self._open is not None
            out.append(self._text_event(self._open, ""))
        status = "incomplete" if self.finish_reason == _LENGTH else "completed"
        if self._open is not None:
            out.append(self._item_done(self._open, status))
            self._open = None
        return out

    def _end(self) -> list[MappedEvent]:
        if self._ended:
            return []
        self._ended = True
        response: dict[str, Any] = {
            "id": self.completion_id,
            "object": "response",
            "model": self.model,
            "status": "completed",
        }
        usage = self._usage
        if usage is not None:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            response["usage"] = {
                "input_tokens": prompt,
                "output_tokens": completion,
                "total_tokens": usage.get("total_tokens"),
                "input_tokens_details": {
                    "cached_tokens": _detail(usage, "prompt_tokens_details", "cached_tokens")
                },
                # Reasoning models (o-series, and servers that count their thinking) say how
                # many of the completion's tokens were reasoning; was left out, so 0.
                "output_tokens_details": {
                    "reasoning_tokens": _detail(
                        usage, "completion_tokens_details", "reasoning_tokens"
                    )
                },
            }
        if self.finish_reason == _FILTERED:
            response.update(status="incomplete", incomplete_details={"reason": _FILTERED})
            return [MappedEvent("response.incomplete", {"response": response})]
        if self.finish_reason == _LENGTH:
            response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        return [MappedEvent("response.completed", {"response": response})]


def _detail(usage: Mapping[str, Any], field: str, name: str) -> Any:
    """A count of a usage details object; 0 when there is none. Any JSON value may stand where
    the object should (was: `"prompt_tokens_details": "…"` raised AttributeError recording
    the call, and the gateway answered its client 500 for the upstream's 200)."""
    details = usage.get(field)
    return details.get(name, 0) if isinstance(details, dict) else 0


class ChatDialect:
    """Chat Completions as a provider dialect: each chunk is one event kept verbatim, then
    the Responses events it amounts to (with no bytes of their own)."""

    name = "chat"
    path = PATH

    def envelope(self, responses_envelope: dict[str, Any]) -> dict[str, Any]:
        return envelope(responses_envelope)

    def request(
        self,
        chat_envelope: dict[str, Any],
        instructions: str,
        items: list[dict[str, Any]],
        encoded: EncodedItems,
    ) -> bytes:
        # The items become messages (some merged), so their own encodings do not serve here.
        return canonical_json(request_body(chat_envelope, instructions, items))

    def decoder(self) -> ChunkDecoder:
        return ChunkDecoder()


class ChunkDecoder:
    """One stream's decoder (a `Decode`): each SSE event → the chunk kept verbatim, then the
    Responses events it amounts to; `end_of_stream` at a clean end without `[DONE]`."""

    def __init__(self) -> None:
        self.mapper = ChunkMapper()

    def __call__(self, sse_event: str, raw: str) -> list[ProviderEvent]:
        if raw.strip() == DONE_DATA:
            mapped = self.mapper.done()
            first = ProviderEvent(DONE_EVENT, {}, raw)
        else:
            event = parse_event(sse_event, raw)
            if event.data is None:
                return [event]
            first = ProviderEvent(CHUNK_EVENT, event.data, raw)
            mapped = self.mapper.chunk(event.data)
        return [first, *(ProviderEvent(m.type, m.data, "") for m in mapped)]

    def end_of_stream(self) -> list[ProviderEvent]:
        """The events a clean end without `[DONE]` amounts to (no bytes of their own)."""
        return [ProviderEvent(m.type, m.data, "") for m in self.mapper.end_of_stream()]


CHAT = ChatDialect()


class ToolCallPiece(NamedTuple):
    """One tool call's piece of a Chat delta (or whole message): the call's position (its
    `index`) in its choice, and its id, name and arguments as the JSON has them (the id and
    name any value there; arguments None where they are not a string)."""

    position: int
    call_id: Any
    name: Any
    arguments: str | None


def tool_call_pieces(calls: Any) -> list[ToolCallPiece]:
    """The pieces of a delta's `tool_calls`; what is not shaped as the API has it is skipped
    (a call that is no object) or read as absent (an index that is no int is 0)."""
    if not isinstance(calls, list):
        return []
    pieces = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        index = call.get("index", 0)
        given = call.get("function")
        function: Mapping[str, Any] = given if isinstance(given, dict) else {}
        arguments = function.get("arguments")
        pieces.append(
            ToolCallPiece(
                index if isinstance(index, int) else 0,
                call.get("id"),
                function.get("name"),
                arguments if isinstance(arguments, str) else None,
            )
        )
    return pieces


__all__ = [
    "CHAT",
    "CHUNK_EVENT",
    "DONE_DATA",
    "DONE_EVENT",
    "PATH",
    "ChatDialect",
    "ChunkDecoder",
    "ChunkMapper",
    "MappedEvent",
    "ToolCallPiece",
    "envelope",
    "item_id",
    "request_body",
    "stream_ended_message",
    "tool_call_pieces",
    "tool_choice",
]
