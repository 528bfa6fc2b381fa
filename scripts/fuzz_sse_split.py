"""Mutated provider reads through the agent's C split (scripts/fuzz-scan.sh builds it with
AddressSanitizer).

Memory safety first, and beside it the one rule the tests hold on random reads: whatever the C
way reads, it reads as the Python way does. Each input is a stream of SSE events such as a
provider sends (names, data lines, comments, JSON of every kind) with bytes changed, cut,
inserted or dropped.
"""

from __future__ import annotations

import json
import random
import sys
import time
from types import ModuleType
from typing import Any

import orjson
from fuzz_scan import load, mutate

from agent_server.provider import MAX_EVENT_DEPTH, ProviderEvent, _parse_event
from agent_server.sse import SseEvent, _parse_events
from trace_reducer.bundle import LONG_NUMBER_DIGITS


def load_split(path: str) -> ModuleType:
    split = load(path, "_sse_split")
    split.setup_sse(SseEvent)
    split.setup_events(
        ProviderEvent, orjson.loads, orjson.JSONDecodeError, MAX_EVENT_DEPTH, LONG_NUMBER_DIGITS
    )
    return split


def sample_stream() -> bytes:
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": "r", "output": []}},
        {"type": "response.output_text.delta", "item_id": "m", "delta": "wé€😀 \u2028"},
        {"type": "response.output_text.delta", "delta": "x" * 40, "n": 12345678901234567},
        {"type": 7, "nested": [[[{"a": [1, 2.5, None, True]}]]]},
        {"type": "response.completed", "response": {"usage": {"input_tokens": 3}}},
    ]
    lines = []
    for number, event in enumerate(events):
        if number % 2:
            lines.append(f"event: {event['type']}")
        text = json.dumps(event, ensure_ascii=number % 3 == 0)
        if number == 3:
            lines += [f"data: {text[:10]}", f"data:{text[10:]}"]
        else:
            lines.append(f"data: {text}")
        lines += [": comment", ""] if number == 2 else [""]
    return "\n".join(lines).encode() + b"\n"


def mutate_read(data: bytes, rng: random.Random) -> bytes:
    """fuzz_scan's mutations, some of them with the bytes SSE and JSON give a meaning to."""
    out = bytearray(mutate(data, rng))
    for _ in range(rng.randint(0, 3)):
        out[rng.randrange(len(out))] = rng.choice(b'\n:\\"{}[] 0123456789du')
    return bytes(out)


def main() -> None:
    split = load_split(sys.argv[1])
    seconds = float(sys.argv[2])
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    data = sample_stream()
    deadline = time.monotonic() + seconds
    inputs = taken = 0
    while time.monotonic() < deadline:
        damaged = mutate_read(data, rng)
        events = split.parse_events(damaged)
        if events is not None:
            assert events == _parse_events(damaged), damaged
        read = split.responses_events(damaged)
        if read is not None:
            taken += 1
            expected = [_parse_event(e.event, e.data) for e in _parse_events(damaged) if e.data]
            assert read == expected, damaged
        for event in _parse_events(damaged):
            single = split.parse_event(event.event, event.data)
            if single is not None:
                assert single == _parse_event(event.event, event.data), damaged
        inputs += 1
    print(f"fuzz-sse-split: {inputs:,} mutated reads, {taken:,} taken the C way, no memory error")


if __name__ == "__main__":
    main()
