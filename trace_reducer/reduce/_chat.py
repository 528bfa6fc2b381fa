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


def chat_messages(instructions: str, items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Chat `messages` for a thread's instructions and Responses input items.

    Consecutive function calls join the assistant message before them (or one of their own);
    reasoning items are not sent back (Chat has no field for them)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
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
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
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
                {"role": str(item.get("role", "user")), "content": _text(item.get("content"))}
            )
    return out


__all__ = ["CHAT_API", "chat_messages"]
