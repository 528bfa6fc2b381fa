"""EncodedItems: a history's items encoded once, and again from the first place that changed."""

from __future__ import annotations

import json
from typing import Any

from agent_server.chat_completions import CHAT
from agent_server.provider import RESPONSES, EncodedItems
from trace_reducer import canonical_json


def _items(count: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"role": "user", "type": "message", "content": [{"type": "input_text", "text": f"q{i}"}]}
        for i in range(start, start + count)
    ]


def test_items_kept_in_place_are_not_encoded_again() -> None:
    encodings = EncodedItems()
    history = _items(3)
    first = encodings.of(history)
    assert first == [canonical_json(item) for item in history]
    history.extend(_items(2, start=3))
    second = encodings.of(history)
    assert second == [canonical_json(item) for item in history]
    # The three kept items' bytes are the very objects made the first time.
    assert all(a is b for a, b in zip(first, second[:3], strict=True))


def test_from_the_first_item_that_changed_everything_is_encoded_again() -> None:
    encodings = EncodedItems()
    history = _items(4)
    before = encodings.of(history)
    # The same place now holds another object, equal to the old one but for its text: a
    # changed object in place is what a history never does, a replaced one what a fork does.
    history[1] = {**history[1], "content": [{"type": "input_text", "text": "other"}]}
    after = encodings.of(history)
    assert after == [canonical_json(item) for item in history]
    assert after[0] is before[0]
    assert after[1] != before[1]
    assert after[2] is not before[2]
    assert after[2] == before[2]


def test_a_history_cut_back_or_copied_is_encoded_as_it_is_now() -> None:
    encodings = EncodedItems()
    history = _items(5)
    encodings.of(history)
    assert encodings.of(history[:2]) == [canonical_json(item) for item in history[:2]]
    copies = [dict(item) for item in history]
    assert encodings.of(copies) == [canonical_json(item) for item in copies]
    encodings.clear()
    assert encodings.of([]) == []


def test_each_dialects_request_is_its_body_encoded() -> None:
    envelope = {"model": "m", "stream": True, "store": False, "temperature": 0.5, "zz": [1]}
    encodings = EncodedItems()
    history = _items(3)
    for _ in range(2):  # the second time from the kept encodings
        sent = RESPONSES.request(envelope, "", history, encodings)
        assert sent == canonical_json({**envelope, "input": history})
        history.extend(_items(1, start=len(history)))
    chat = CHAT.request(CHAT.envelope(envelope), "be brief", history, encodings)
    assert json.loads(chat)["messages"][0] == {"role": "system", "content": "be brief"}
    assert chat == canonical_json(json.loads(chat))
