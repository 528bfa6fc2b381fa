"""Item normalisation and the matching of a request's input against a thread's history."""

from __future__ import annotations

import json

from rollout.trace.v1 import state_pb2
from trace_reducer.reduce._items import ItemInfo, ThreadItems, parse_item


def info(item: object) -> ItemInfo:
    return parse_item(json.dumps(item).encode())


def test_normalised_content_ignores_id_status_and_part_extras() -> None:
    sent = info(
        {
            "type": "message",
            "id": "msg-1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}],
        }
    )
    returned = info(
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
    )
    assert sent.key == returned.key
    assert sent.responses_item_id == "msg-1"
    assert returned.responses_item_id == ""


def test_string_content_is_one_input_text_part_and_type_defaults_to_message() -> None:
    short = info({"role": "user", "content": "hello"})
    full = info(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
    )
    assert short.key == full.key
    assert short.kind == state_pb2.ITEM_KIND_MESSAGE
    assert short.content == (("input_text", "hello"),)


def test_an_answer_sent_back_in_chats_spelling_is_the_item_the_model_made() -> None:
    # The model's answer as recorded (output_text); a Chat client sends it back as a string, or
    # as a list of `text` parts.
    made = info(
        {
            "type": "message",
            "id": "chatcmpl-1/0",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        }
    )
    as_string = info({"type": "message", "role": "assistant", "content": "hi"})
    as_parts = info({"role": "assistant", "content": [{"type": "text", "text": "hi"}]})
    assert made.key == as_string.key == as_parts.key
    # A user's text is input text in either spelling, never the assistant's.
    user = info({"role": "user", "content": [{"type": "input_text", "text": "hi"}]})
    assert user.key == info({"role": "user", "content": "hi"}).key
    assert user.key == info({"role": "user", "content": [{"type": "text", "text": "hi"}]}).key
    assert user.key != made.key


def test_different_roles_texts_and_part_types_differ() -> None:
    base = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}
    keys = {
        info(base).key,
        info({**base, "role": "assistant"}).key,
        info({**base, "content": [{"type": "input_text", "text": "b"}]}).key,
        info({**base, "content": [{"type": "output_text", "text": "a"}]}).key,
        info({**base, "content": [{"type": "input_image", "image_url": "data:1"}]}).key,
        info({**base, "content": [{"type": "input_image", "image_url": "data:2"}]}).key,
    }
    assert len(keys) == 6


def test_kinds_roles_and_fields() -> None:
    call = info({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"})
    assert (call.kind, call.call_id) == (state_pb2.ITEM_KIND_FUNCTION_CALL, "c1")
    output = info({"type": "function_call_output", "call_id": "c1", "output": "42"})
    assert output.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT
    assert output.role == state_pb2.CONVERSATION_ROLE_TOOL
    reasoning = info(
        {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "hm"}]}
    )
    assert reasoning.kind == state_pb2.ITEM_KIND_REASONING
    assert reasoning.content == (("summary_text", "hm"),)
    assert info({"type": "web_search_call"}).kind == state_pb2.ITEM_KIND_OTHER
    assert info({"role": "system", "content": "s"}).role == state_pb2.CONVERSATION_ROLE_SYSTEM


def test_malformed_json_is_an_opaque_item_not_an_error() -> None:
    broken = parse_item(b"{not json")
    assert broken.kind == state_pb2.ITEM_KIND_OTHER
    assert broken.key == "{not json"
    assert parse_item(b"[1, 2]").kind == state_pb2.ITEM_KIND_OTHER


def test_keys_are_equal_exactly_when_the_canonical_json_is() -> None:
    # Each group is one value spelled several ways, some of which orjson refuses or would read
    # differently (json reads those); every group's spellings share a key, no two groups do.
    message = '{"type":"message","role":"user","content":[{"type":"input_text","text":%s}]}'
    groups = [
        [b'"a\xef\xbf\xbd"', b'"a\\ufffd"', b'"a\xff"', b'"a\\udc00"'],
        [b"12345678901234567890123", b"12345678901234567890123 "],
        [b"12345678901234567890124"],
        [b"18446744073709551615", b" 18446744073709551615"],
        [b"1e400", b"Infinity", b"2e308"],
        [b"NaN"],
        [b"null"],
        [b"1"],
        [b"1.0", b"1e0", b"10e-1"],
        [b"true"],
        [b'"x"', b'"\\u0078"'],
    ]
    keys = []
    for spellings in groups:
        group = {parse_item(message.encode() % text).key for text in spellings}
        assert len(group) == 1, spellings
        keys.append(group.pop())
    assert len(set(keys)) == len(keys)
    # The same key when the item's keys come in another order, or repeated (the last counts).
    assert parse_item(b'{"b":1,"a":2}').key == parse_item(b'{"a":2,"b":1}').key
    assert parse_item(b'{"a":1,"a":2}').key == parse_item(b'{"a":2}').key


class Items:
    """A ThreadItems with a counter for new ids, as the reducer drives it."""

    def __init__(self) -> None:
        self.items = ThreadItems()
        self.created: list[str] = []

    def request(self, inputs: list[ItemInfo], *, known: int = 0) -> list[str]:
        def new_item(index: int) -> str:
            item_id = f"new-{len(self.created) + 1}"
            self.created.append(item_id)
            self.items.register(item_id, inputs[index].key, inputs[index].responses_item_id)
            return item_id

        return self.items.match_request(inputs, new_item, known=known)


def test_matching_by_position_then_id_then_content() -> None:
    a = info({"role": "user", "content": "a"})
    b = info({"role": "user", "content": "b"})
    items = Items()
    assert items.request([a, b]) == ["new-1", "new-2"]
    # Position: same content at the same index of the previous request.
    assert items.request([a, b]) == ["new-1", "new-2"]
    # Content: b moved to the front, still the same item.
    assert items.request([b, a]) == ["new-2", "new-1"]
    # An id that matches a registered Responses id wins over content.
    items.items.register("out-1", "other content", "msg-9")
    by_id = info({"id": "msg-9", "role": "assistant", "content": "x"})
    assert items.request([by_id]) == ["out-1"]


def test_identical_content_at_a_new_position_is_a_new_item() -> None:
    a = info({"role": "user", "content": "a"})
    items = Items()
    assert items.request([a]) == ["new-1"]
    assert items.request([a, a]) == ["new-1", "new-2"]
    assert items.request([a, a, a]) == ["new-1", "new-2", "new-3"]
    # Past the previous request's length only content matches: the first-seen copy wins.
    others = [info({"role": "user", "content": text}) for text in ("x", "y", "z")]
    assert items.request([*others, a]) == ["new-4", "new-5", "new-6", "new-1"]


def test_position_wins_over_first_seen_content() -> None:
    a = info({"role": "user", "content": "a"})
    b = info({"role": "user", "content": "b"})
    items = Items()
    assert items.request([a, a]) == ["new-1", "new-2"]
    # The history was rewritten at the front; the copy at index 1 is still the one seen there.
    assert items.request([b, a]) == ["new-3", "new-2"]


def test_content_matches_find_copies_a_cut_back_request_let_go() -> None:
    """Each request after the first is `known` inputs of the previous one plus its own: the
    same content appended turn after turn is a new item each time, and once a request cuts the
    history back, the copies it dropped are found by content again, first-seen first."""
    a = info({"role": "user", "content": "a"})
    x = info({"role": "user", "content": "x"})
    y = info({"role": "user", "content": "y"})
    z = info({"role": "user", "content": "z"})
    items = Items()
    assert items.request([a]) == ["new-1"]
    assert items.request([a], known=1) == ["new-2"]
    assert items.request([a], known=2) == ["new-3"]
    assert items.request([a], known=3) == ["new-4"]
    # Back to the first input: new-2 to new-4 left the request. Past their three positions
    # content finds the first-seen copy not in the request.
    assert items.request([x, y, z, a], known=1) == ["new-5", "new-6", "new-7", "new-2"]
    assert items.request([a, a], known=5) == ["new-3", "new-4"]
