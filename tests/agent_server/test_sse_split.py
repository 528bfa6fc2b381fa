"""A provider read's events in C (_sse_split.c) against their Python reference.

sse.parse_events and the agent's reader take the C way for the common case and the Python way
(sse._parse_events, provider._parse_event) for the rest; the two must give every read the same
events, and the C way must not keep what it allocates.
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

from agent_server import _sse_split, provider, sse
from agent_server.provider import ProviderEvent, _parse_event, parse_event
from agent_server.sse import SseEvent, _parse_events
from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, StartAgent
from trace_reducer.bundle import LONG_NUMBER_DIGITS

_LONG_RUN = re.compile(rb"[0-9]{%d}" % LONG_NUMBER_DIGITS)
_NAMES = ["", "response.output_text.delta", "response.completed", "é", "x y", "a:b"]
_TEXTS = ["", "hi", " lead", "é", "日本", "\u2028", "[DONE]", "a:b", "tab\there", "\\"]


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.5:
        return rng.choice(
            [rng.choice(_TEXTS), rng.randint(-5, 10**6), rng.random(), True, None, "\U0001f600"]
        )
    if roll < 0.75:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "delta", "item_id"]): _json_value(rng, depth + 1) for _ in range(2)}


def _data(rng: random.Random) -> str:
    """An event's data: mostly a JSON object such as a provider sends, sometimes anything."""
    roll = rng.random()
    if roll < 0.7:
        event: dict[str, Any] = {
            "type": rng.choice([*_NAMES, 7, None]),
            "delta": rng.choice(_TEXTS),
            "n": rng.choice([1, 12345678901234567890, 10**17, -3]),
            "v": _json_value(rng),
        }
        if rng.random() < 0.2:
            del event["type"]
        text = json.dumps(event, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.05:
            # Nested past MAX_EVENT_DEPTH (hostile), or only holding as many brackets.
            depth = rng.choice([30, 70])
            text = '{"a":' * depth + text + "}" * depth
        if rng.random() < 0.05:
            text = text.replace('"delta"', '"delta\\ud800"', 1)
        return text
    return rng.choice(
        ["[1, 2]", '"text"', "{", "NaN", '{"x": NaN}', '{"a": Infinity}', "", "  ", "{}", "null"]
    )


def _block(rng: random.Random) -> bytes:
    """Complete SSE text: events of data lines, names, comments and other fields."""
    lines: list[str] = []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            lines.append(f"event:{rng.choice(['', ' '])}{rng.choice(_NAMES)}")
        data = _data(rng)
        for piece in data.split("\n") if rng.random() < 0.9 else [data, data]:
            lines.append(f"data:{rng.choice([' ', '', '  '])}{piece}")
        if rng.random() < 0.2:
            lines.append(rng.choice([": comment", "id: 5", "retry: 10", "data", "event"]))
        lines.append("")
    ending = "\n" if rng.random() < 0.9 else rng.choice(["\r\n", "\r"])
    block = (ending.join(lines) + ending).encode()
    if rng.random() < 0.05 and block:
        cut = rng.randrange(len(block))
        block = block[:cut] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + block[cut:]
    return block


def _python_events(block: bytes) -> list[ProviderEvent]:
    return [_parse_event(event.event, event.data) for event in _parse_events(block) if event.data]


@pytest.mark.parametrize(
    ("c_way", "python_way", "made", "fewest_taken"),
    [
        # Most blocks are the common case of the split; fewer have every event's JSON in it.
        (_sse_split.parse_events, _parse_events, SseEvent, 4000),
        (_sse_split.responses_events, _python_events, ProviderEvent, 1500),
    ],
    ids=["split", "responses events"],
)
def test_the_c_way_reads_random_blocks_as_the_python_way_does(
    c_way: Callable[[bytes], list[Any] | None],
    python_way: Callable[[bytes], list[Any]],
    made: type,
    fewest_taken: int,
) -> None:
    rng = random.Random(5)
    taken = 0
    for _ in range(6000):
        block = _block(rng)
        events = c_way(block)
        if events is not None:
            taken += 1
            assert events == python_way(block), block
            assert all(type(event) is made for event in events)
    # Not a test of nothing.
    assert taken > fewest_taken


def test_the_c_way_reads_random_events_as_the_python_way_does() -> None:
    rng = random.Random(8)
    taken = 0
    for _ in range(6000):
        name = rng.choice(_NAMES)
        raw = _data(rng)
        if rng.random() < 0.05:
            raw = raw.replace("a", "\ud800", 1)  # a lone surrogate, as a decoded read may hold
        event = _sse_split.parse_event(name, raw)
        if event is not None:
            taken += 1
            assert event == _parse_event(name, raw), raw
            assert type(event) is ProviderEvent
            assert event.raw is raw
        assert parse_event(name, raw) == _parse_event(name, raw)
    assert taken > 2500


def test_sse_parse_events_gives_the_python_ways_events() -> None:
    rng = random.Random(6)
    for _ in range(2000):
        block = _block(rng)
        assert sse.parse_events(block) == _parse_events(block)


@pytest.mark.parametrize(
    "block",
    [
        b"data: {}\r\n\r\n",  # another line ending
        b"data: {}\rdata: {}\r\r",
        b'data: {"delta": "\xff"}\n\n',  # not UTF-8
        b"event: \xc3\ndata: {}\n\n",
        b'data: {"n": 1234567890123456789}\n\n',  # 19 digits: json keeps it exact
        b'data: {"delta": "\\ud83d"}\n\n',  # an escaped surrogate, maybe lone
        b'data: {"delta": "\\uD83D\\uDE00"}\n\n',
        b"data: " + b'{"a":' * 70 + b"1" + b"}" * 70 + b"\n\n",  # deeper than an event nests
        b'data: {"a": "' + b"[" * 70 + b'"}\n\n',  # as many brackets, in a string
        b"data: [1, 2]\n\n",  # not an object
        b'data: "text"\n\n',
        b"data: {\n\n",  # not JSON
        b'data: {"x": NaN}\n\n',  # json reads it, orjson does not
        b"data: [DONE]\n\n",
    ],
)
def test_what_the_python_way_decides_is_left_to_it(block: bytes) -> None:
    assert _sse_split.responses_events(block) is None
    # And the Python way still reads it, as before.
    assert isinstance(_python_events(block), list)


@pytest.mark.parametrize(
    "block",
    [
        b"",
        b": only a comment\n\n",
        b"event: response.created\n\n",  # a name and no data: nothing dispatched
        b"data:\n\n",  # empty data: no event to decode
        b'event: x\ndata: {"type": "response.output_text.delta", "delta": "\xe2\x80\xa8"}\n\n',
        b'data: {"delta": "a"}\n\n',  # no type: the SSE name stands, here ''
        b'event: named\ndata: {"type": 7}\n\n',
        b'data: {"a":\ndata: 1}\n\n',  # two data lines, one JSON text
        b'data:{"x": "no space"}\n\ndata:  {"x": "two spaces"}\n\n',
        b'data: {"x": 1}',  # the last event needs no blank line
        b'id: 1\nretry: 5\ndata: {"ok": true}\ndata\n\n',
    ],
)
def test_the_common_case_and_its_edges_take_the_c_way(block: bytes) -> None:
    events = _sse_split.responses_events(block)
    assert events is not None
    assert events == _python_events(block)
    assert _sse_split.parse_events(block) == _parse_events(block)


def test_the_c_way_keeps_nothing_it_allocates() -> None:
    rng = random.Random(7)
    blocks = [_block(rng) for _ in range(300)]
    blocks.append(b'data: {"a":\ndata: 1}\n\n' * 20)

    def read_all() -> None:
        for block in blocks:
            _sse_split.responses_events(block)
            _sse_split.parse_events(block)

    read_all()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            read_all()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 24,000 reads: a leak of one small object each would be ~1 MB.
    assert grown < 64 * 1024


class _Counting:
    """_sse_split with its reads of whole Responses events counted: taken, or left to Python."""

    def __init__(self) -> None:
        self.taken = 0
        self.left: list[bytes] = []

    def responses_events(self, block: bytes) -> list[ProviderEvent] | None:
        events = _sse_split.responses_events(block)
        if events is None:
            self.left.append(block)
        else:
            self.taken += 1
        return events


async def _conversation(agent: Harness) -> list[tuple[str, str]]:
    """Two turns with the built-in model; the events a client saw, by kind and text, a run of
    deltas as one: how the words fall into network reads (several at once on a loaded machine)
    decides where one delta ends, not which way the reads were split."""
    thread = await agent.start_thread()
    seen: list[tuple[str, str]] = []
    log = agent.events(thread.id)
    for question in ("What is a trace?", "And a bundle?"):
        turn = await agent.start_turn(thread.id, question)
        done = await log.turn_completed(turn.id)
        assert done.status == agent_pb2.TURN_STATUS_COMPLETED
    for event in log.events:
        kind = event.WhichOneof("kind")
        assert kind is not None
        text = event.agent_message_delta.delta if kind == "agent_message_delta" else ""
        if not text and kind == "agent_message_delta":
            seen.append((kind, text))  # an empty delta is a fault the test looks for
        elif seen and kind == "agent_message_delta" and seen[-1][0] == kind and seen[-1][1]:
            seen[-1] = (kind, seen[-1][1] + text)
        else:
            seen.append((kind, text))
    return seen


async def test_every_read_of_the_built_in_model_takes_the_c_way_and_streams_alike(
    start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _Counting()
    monkeypatch.setattr(provider, "_sse_split", counting)
    with_c = await _conversation(await start_agent(provider_url=None))
    assert counting.taken > 20
    # Only the long-number rule may leave a read of the built-in model to Python: a random hex
    # id holds 19 digits in a row about once in 1,400.
    assert all(_LONG_RUN.search(block) for block in counting.left), counting.left
    monkeypatch.setattr(provider, "_sse_split", None)
    monkeypatch.setattr(sse, "_sse_split", None)
    without_c = await _conversation(await start_agent(provider_url=None))
    assert with_c == without_c
    assert ("agent_message_delta", "") not in with_c
