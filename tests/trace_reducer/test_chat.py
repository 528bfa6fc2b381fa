"""`chat_items` and `chat_messages`: Chat messages as trace items, and back, exactly."""

from __future__ import annotations

from typing import Any

import pytest

from trace_reducer import chat_items, chat_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

# What clients send: OpenAI's own message objects echoed back, pictures, names, tool results as
# parts, a message without `content`, two assistant messages in a row.
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, PICTURE]}],
    [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///v.mp4"}}]}],
    [{"role": "user", "content": "hi", "name": "ana"}],
    [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "done"}]},
        {"role": "assistant", "content": None, "refusal": "I can't.", "annotations": []},
    ],
    [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}],
    [
        {"role": "assistant", "content": "first"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ],
]  # fmt: skip


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_messages_come_back_as_they_were_sent(messages: list[dict[str, Any]]) -> None:
    # Was: text, roles and tool calls only (no picture, no `name`, a tool result's parts as
    # a string, no echoed `refusal`), so a request rebuilt from a trace was not the one sent.
    assert chat_messages("", chat_items(messages)) == messages


def test_plain_messages_are_plain_items() -> None:
    items = chat_items(
        [
            {"role": "user", "content": "call f"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
        ]
    )
    assert items == [
        {"type": "message", "role": "user", "content": "call f"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    ]


def test_a_picture_is_kept_once() -> None:
    # The parts are the item's content, given back as they are: not a second copy of them.
    (item,) = chat_items([{"role": "user", "content": [PICTURE], "name": "ana"}])
    assert item["content"] == [PICTURE]
    assert item["chat_message"] == {"set": {"name": "ana"}}
