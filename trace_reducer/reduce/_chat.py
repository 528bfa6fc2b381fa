"""Chat Completions `messages` from a thread's instructions and its Responses input items:
the one translation the agent sends and the reducer rebuilds request bodies with."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CHAT_API = "chat"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


# The key of an item `chat_items` made from a Chat message that its items alone would not give
# back (an image part, `name`, a `refusal: null` or `annotations: []` the SDK echoes, a missing
# `content`): `{"set": {field: value}, "unset": [field]}`, applied to the message
# `chat_messages` makes. So `trace-reducer request` gives back the body the client sent, and a
# replay of it matches. Not part of what the model saw: the reducer's matching leaves it out.
CHAT_MESSAGE_KEY = "chat_message"

# The content parts of the Responses API (a Chat message's text part is `text`, its picture
# `image_url`, and servers add their own: vLLM's `video_url`): a content list with none of
# these came from a Chat message and goes back as it came, else it is sent as its text.
_RESPONSES_PARTS = frozenset(
    {"input_text", "output_text", "input_image", "input_file", "refusal", "summary_text"}
)


def _content(content: Any) -> Any:
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(part, dict) and part.get("type") not in _RESPONSES_PARTS for part in content
        )
    ):
        return list(content)
    return _text(content)


def chat_messages(instructions: str, items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Chat `messages` for a thread's instructions and Responses input items.

    Consecutive function calls join the assistant message before them (or one of their own,
    as does a call whose item begins a message `chat_items` made); reasoning items are not
    sent back (Chat has no field for them)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    # What a message had beyond its items, applied once its items (its calls) are all in.
    extras: list[tuple[dict[str, Any], Mapping[str, Any]]] = []
    for item in items:
        kind = item.get("type", "message")
        extra = item.get(CHAT_MESSAGE_KEY)
        marked = isinstance(extra, Mapping)
        if kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {
                    "name": str(item.get("name", "")),
                    "arguments": str(item.get("arguments", "")),
                },
            }
            last = out[-1] if out else None
            if (
                not marked
                and last is not None
                and last["role"] == "assistant"
                and "tool_call_id" not in last
            ):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": str(item.get("output", "")),
                }
            )
        elif kind == "message":
            out.append(
                {"role": str(item.get("role", "user")), "content": _content(item.get("content"))}
            )
        else:
            continue
        if marked:
            assert isinstance(extra, Mapping)
            extras.append((out[-1], extra))
    for message, extra in extras:
        fields = extra.get("set")
        if isinstance(fields, Mapping):
            message.update(fields)
        unset = extra.get("unset")
        for name in unset if isinstance(unset, list) else []:
            if isinstance(name, str):
                message.pop(name, None)
    return out


def chat_items(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat `messages` as the Responses items a trace holds, which `chat_messages("", items)`
    turns back into the same messages: a message's text and parts, tool calls (function_call
    items) and tool results (function_call_output items); what a message has beyond them goes
    under CHAT_MESSAGE_KEY of its first item."""
    items: list[dict[str, Any]] = []
    after_assistant = False
    for message in messages:
        own = _message_items(message)
        # Calls with no message item join an assistant message before them: marked, they
        # begin their own.
        joins = after_assistant and own[0]["type"] == "function_call"
        after_assistant = message.get("role") == "assistant"
        if joins or chat_messages("", own) != [message]:
            own[0] = {**own[0], CHAT_MESSAGE_KEY: {}}
            (made,) = chat_messages("", own)
            extra: dict[str, Any] = {}
            fields = {k: v for k, v in message.items() if k not in made or made[k] != v}
            if fields:
                extra["set"] = fields
            unset = [name for name in made if name not in message]
            if unset:
                extra["unset"] = unset
            own[0][CHAT_MESSAGE_KEY] = extra
        items.extend(own)
    return items


def _message_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The items of one message, at least one."""
    role = message.get("role")
    content = message.get("content")
    if role == "tool":
        output = _text(content)
        return [
            {
                "type": "function_call_output",
                "call_id": str(message.get("tool_call_id", "")),
                "output": output,
            }
        ]
    calls: list[dict[str, Any]] = []
    listed = message.get("tool_calls")
    for call in listed if isinstance(listed, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        calls.append(
            {
                "type": "function_call",
                "call_id": str(call.get("id", "")),
                "name": str(function.get("name", "")),
                "arguments": str(function.get("arguments", "")),
            }
        )
    if content is not None or not calls:
        refusal = message.get("refusal")
        if content is None and isinstance(refusal, str) and refusal:
            # An echoed refusal is the refusal part it was recorded as (the same item).
            content = [{"type": "refusal", "refusal": refusal}]
        calls.insert(0, {"type": "message", "role": role, "content": content or ""})
    return calls


__all__ = ["CHAT_API", "CHAT_MESSAGE_KEY", "chat_items", "chat_messages"]
