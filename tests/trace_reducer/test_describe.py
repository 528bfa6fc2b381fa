"""The reducer's item description in C (_describe.c) against its Python reference.

parse_item takes the C way for the common case and the Python way (_parse_item) for the rest;
the two must describe every item alike, and the C way must not keep what it allocates.
"""

from __future__ import annotations

import gc
import json
import random
import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import timestamp_pb2

from bench.agent_shapes import AgentBundles, record_agent_bundles
from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import replay_bundle
from trace_reducer.bundle import read_bundle
from trace_reducer.bundle._payloads import LONG_NUMBER_DIGITS
from trace_reducer.reduce import _describe, _items, _reducer
from trace_reducer.reduce._items import ItemInfo, parse_item

_LONG_RUN = re.compile(rb"[0-9]{%d}" % LONG_NUMBER_DIGITS)
_ITEM_KINDS = (
    record_pb2.PAYLOAD_KIND_INPUT_ITEM,
    record_pb2.PAYLOAD_KIND_OUTPUT_ITEM,
    record_pb2.PAYLOAD_KIND_TOOL_OUTPUT,
)
_WORDS = ["", "a", "hi", "é", "日本", "null", "none", "\\", '"', "\u2028", "n", "nul"]
_TYPES = ["message", "function_call", "function_call_output", "reasoning", "web_search", "", 7]
_ROLES = ["user", "assistant", "system", "developer", "tool", "", "robot", None, 3]
_PART_TYPES = [
    "input_text",
    "output_text",
    "text",
    "refusal",
    "summary_text",
    "input_image",
    None,
    1,
]


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.choice(_WORDS),
            rng.randint(-5, 10**6),
            rng.random(),
            rng.choice([True, False, None]),
            "n" * rng.randint(0, 6),
        ]
    )


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.6:
        return _scalar(rng)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "text", "type", "x"]): _value(rng, depth + 1) for _ in range(2)}


def _part(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return _value(rng)
    part: dict[str, Any] = {}
    for key, chance in (("type", 0.9), ("text", 0.7), ("refusal", 0.2), ("annotations", 0.3)):
        if rng.random() < chance:
            part[key] = (
                rng.choice(_PART_TYPES)
                if key == "type"
                else []
                if key == "annotations"
                else rng.choice([*_WORDS, None, 5])
            )
    if rng.random() < 0.2:
        part["logprobs"] = _value(rng)
    return part


def _content(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.2:
        return rng.choice(_WORDS)
    if roll < 0.85:
        return [_part(rng) for _ in range(rng.randint(0, 3))]
    return _value(rng)


def _item(rng: random.Random) -> dict[str, Any]:
    item: dict[str, Any] = {}
    fields: dict[str, Callable[[], Any]] = {
        "type": lambda: rng.choice([*_TYPES, None]),
        "role": lambda: rng.choice(_ROLES),
        "id": lambda: rng.choice(["msg_1", "fc_2", "", None, 4]),
        "status": lambda: rng.choice(["completed", "in_progress", None]),
        "content": lambda: _content(rng),
        "summary": lambda: _content(rng),
        "call_id": lambda: rng.choice(["call_1", "", None, 9]),
        "name": lambda: rng.choice(["lookup", "", None]),
        "arguments": lambda: rng.choice(['{"phrase": "x"}', "", None, {"a": 1}]),
        "output": lambda: rng.choice([*_WORDS, None, [_part(rng), 3, _part(rng)], {"text": "t"}]),
        "extra": lambda: _value(rng),
        # How a Chat client spelt the message: left out of the key both ways.
        "chat_message": lambda: rng.choice(
            [{}, {"set": {"name": "ana"}}, {"set": {"refusal": None}}, {"unset": ["content"]}]
        ),
    }
    for key, make in fields.items():
        if rng.random() < 0.5:
            item[key] = make()
    return item


def _encodings(rng: random.Random, item: Any) -> list[bytes]:
    """The item as JSON bytes, as the writer stores it and as other writers might."""
    compact = json.dumps(item, separators=(",", ":"), sort_keys=rng.random() < 0.5)
    return [compact.encode(), json.dumps(item, ensure_ascii=False, indent=1).encode()]


def _both_ways(data: bytes) -> tuple[ItemInfo | None, ItemInfo]:
    described = _describe.describe(data)
    reference = _items._parse_item(data)
    assert parse_item(data) == reference
    if described is not None:
        assert type(described) is ItemInfo
        assert described == reference
        # The same types too: a key as bytes, the enum values as ints.
        assert [type(field) for field in described] == [type(field) for field in reference]
    return described, reference


def test_the_c_way_describes_random_items_as_the_python_way_does() -> None:
    rng = random.Random(2026)
    described = 0
    total = 0
    for _ in range(3000):
        for data in _encodings(rng, _item(rng)):
            total += 1
            if _both_ways(data)[0] is not None:
                described += 1
    # Most random items take the C way (the rest hold a `null` somewhere in their key).
    assert described > total // 3


@pytest.fixture(scope="module")
def agent_bundles(tmp_path_factory: pytest.TempPathFactory) -> AgentBundles:
    """A thread of ordinary replies and one of tool rounds, recorded by the agent server."""
    return record_agent_bundles(tmp_path_factory.mktemp("shapes"), reply_turns=3, tool_turns=3)


def test_every_item_the_agent_writes_takes_the_c_way(agent_bundles: AgentBundles) -> None:
    bundles = agent_bundles
    items = 0
    for bundle in (bundles.replies, bundles.tools):
        with read_bundle(bundle) as reader:
            for record in reader:
                if record.WhichOneof("body") != "payload":
                    continue
                if record.payload.kind not in _ITEM_KINDS:
                    continue
                data = record.payload.data
                described, _ = _both_ways(data)
                # A run of 19 digits (a random hex id may hold one) goes the Python way, as
                # fast_json's rule says; every other item the agent writes goes the C way.
                assert described is not None or _LONG_RUN.search(data), data
                items += 1
    # Each tool round: the question, the call, its output, the reply; each reply: two.
    assert items >= 4 * 3 + 2 * 3


def test_a_replay_reduces_alike_without_the_c_way(
    agent_bundles: AgentBundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundles = (agent_bundles.replies, agent_bundles.tools)
    with_c = [replay_bundle(bundle) for bundle in bundles]
    replay_bundle_c_compact = {bundle: replay_bundle(bundle, compact=True) for bundle in bundles}
    assert all(state.conversation_items for state in with_c)
    calls: list[bytes] = []
    reference = _items._parse_item

    def python_way(data: bytes) -> ItemInfo:
        calls.append(data)
        return reference(data)

    monkeypatch.setattr(_items, "_describe", None)
    monkeypatch.setattr(_items, "_parse_item", python_way)
    # Each item's message set field by field, not merged from item_wire's encoding.
    monkeypatch.setattr(_reducer, "item_wire", None)
    for bundle, state in zip(bundles, with_c, strict=True):
        assert replay_bundle(bundle) == state
        assert replay_bundle(bundle, compact=True) == replay_bundle_c_compact[bundle]
    assert len(calls) >= 4 * 3 + 2 * 3


def test_a_strings_part_is_its_roles_text_both_ways() -> None:
    # Was: a Chat assistant message with string content (a few-shot example the client sent,
    # matching no earlier output) was shown as an input_text part; the model's text is
    # output_text everywhere else. Its key was output_text already.
    for role, shown in (("assistant", "output_text"), ("user", "input_text")):
        for data in (
            json.dumps({"role": role, "content": "Paris."}).encode(),
            json.dumps({"type": "message", "role": role, "content": "Paris."}).encode(),
        ):
            described, reference = _both_ways(data)
            assert described is not None, data
            assert reference.content == ((shown, "Paris."),), data
    # A part list keeps each part's own type, whatever the role.
    listed = b'{"role": "assistant", "content": [{"type": "input_text", "text": "a"}]}'
    assert _both_ways(listed)[1].content == (("input_text", "a"),)


def test_what_the_python_way_decides_is_left_to_it() -> None:
    deep = b'{"type": "message", "content": ' + b"[" * 300 + b"]" * 300 + b"}"
    cases = [
        b'{"type": "function_call", "arguments": 1234567890123456789012}',  # past 64 bits
        deep,  # nested past MAX_ITEM_DEPTH
        b'["not", "an", "object"]',
        b'"text"',
        b'{"type": "message", "content": "\xff\xfe"}',  # not UTF-8
        b'{"type": "message", "content": "\\ud800"}',  # a lone surrogate
        b'{"type": "message", "x": NaN}',
        b'{"type": "message", "x": null}',  # a null in the key: it may have been a NaN
        b"not json",
        b"",
    ]
    for data in cases:
        described, reference = _both_ways(data)
        assert described is None, data
        assert reference == _items._parse_item(data)
    # The deep item is opaque the Python way; a number past 64 bits is read exactly.
    assert _items._parse_item(deep).content == ()
    next_one = cases[0].replace(b"9012}", b"9013}")
    assert _items._parse_item(cases[0]).key != _items._parse_item(next_one).key


def test_the_c_way_keeps_nothing_it_allocates() -> None:
    rng = random.Random(7)
    payloads = [data for _ in range(200) for data in _encodings(rng, _item(rng))]
    for data in payloads:
        _describe.describe(data)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(50):
            for data in payloads:
                _describe.describe(data)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 20,000 descriptions: a leak of one small object each would be ~1 MB.
    assert grown < 64 * 1024


def test_an_items_encoding_is_the_message_its_fields_make() -> None:
    rng = random.Random(11)
    producer = state_pb2.ProducerRef(
        inference=state_pb2.InferenceProducer(inference_call_id="call-1")
    )
    for number in range(2000):
        data = _encodings(rng, _item(rng))[0]
        info = parse_item(data)
        seconds = rng.choice([0, 1, 1_700_000_000, -62_135_596_800, rng.randint(-(10**9), 10**10)])
        nanos = rng.choice([0, 1000, rng.randrange(0, 1_000_000_000, 1000)])
        values = (
            f"item-{number}",
            rng.choice(["thread_1", "é"]),
            rng.choice(["", "turn_1"]),
            rng.choice(["", info.responses_item_id, "msg_9"]),
            rng.choice([0, 1, 2**40]),
            rng.choice(["", "a" * 64]),
        )
        with_producer = rng.random() < 0.5
        wire = _items.item_wire(
            info,
            *values,
            seconds,
            nanos,
            producer.SerializeToString() if with_producer else b"",
        )
        assert wire is not None
        expected = state_pb2.ConversationItem(
            item_id=values[0],
            thread_id=values[1],
            turn_id=values[2],
            responses_item_id=values[3],
            first_seen_seq=values[4],
            payload_id=values[5],
            role=info.role,
            kind=info.kind,
            call_id=info.call_id,
            name=info.name,
            arguments=info.arguments,
            output=info.output,
            content=[state_pb2.ContentPart(type=kind, text=text) for kind, text in info.content],
            first_seen_at=timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos),
            produced_by=[producer] if with_producer else [],
        )
        assert state_pb2.ConversationItem.FromString(wire) == expected
    # What is not UTF-8 (a lone surrogate) is left to the message library, which refuses it.
    info = parse_item(b'{"type": "message", "role": "user", "content": "hi"}')
    assert _items.item_wire(info, "item-1", "t\ud800", "", "", 1, "", 0, 0, b"") is None
