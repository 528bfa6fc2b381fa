"""The SSE splitter: whatever the reads, the same events, and only whole events forwarded."""

from __future__ import annotations

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
