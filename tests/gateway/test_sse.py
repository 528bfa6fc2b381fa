"""The SSE splitter: whatever the reads, the same events, and only whole events forwarded."""

from __future__ import annotations

import random

import pytest

from agent_server.sse import SseEvent, SseSplitter

STREAM = (
    b"event: a\ndata: one\n\n"
    b'data: {"x": "\xe2\x80\xa8 kept"}\r\n\r\n'
    b": comment\ndata: multi\ndata: line\n\n"
    b"data: cr\r\r"
    b"data: [DONE]\n\n"
)
EVENTS = [
    SseEvent("a", "one"),
    SseEvent("", '{"x": "\u2028 kept"}'),
    SseEvent("", "multi\nline"),
    SseEvent("", "cr"),
    SseEvent("", "[DONE]"),
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, len(STREAM)])
def test_any_read_sizes_give_the_same_events_and_bytes(size: int) -> None:
    splitter = SseSplitter()
    forwarded, events = b"", []
    for start in range(0, len(STREAM), size):
        ready, found = splitter.feed(STREAM[start : start + size])
        # Only whole events go out: what was forwarded parses to exactly what was found.
        forwarded += ready
        events.extend(found)
    assert forwarded == STREAM
    assert events == EVENTS
    assert splitter.rest() == b""


def test_a_torn_last_event_is_held_back() -> None:
    splitter = SseSplitter()
    ready, events = splitter.feed(b"data: whole\n\ndata: tor")
    assert (ready, events) == (b"data: whole\n\n", [SseEvent("", "whole")])
    assert splitter.held == len(b"data: tor")
    assert splitter.rest() == b"data: tor"


def test_random_reads_give_the_events_of_the_whole_stream() -> None:
    # Reads cut anywhere: inside a line ending, right after an event (the common case, taken
    # without a search), after a read that held a torn event.
    stream = STREAM * 3 + b"data: \r\n\ndata: x\n\n"
    whole_ready, whole_events = SseSplitter().feed(stream)
    assert whole_ready == stream
    rng = random.Random(5)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        splitter = SseSplitter()
        forwarded, events = b"", []
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            ready, found = splitter.feed(stream[start:end])
            forwarded += ready
            events.extend(found)
        assert (forwarded, events) == (stream, whole_events)
        assert splitter.rest() == b""
