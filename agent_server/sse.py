"""Server-Sent Events cut out of a byte stream as it arrives, the bytes kept as they came."""

from __future__ import annotations

import re
from typing import NamedTuple

try:
    from agent_server import _sse_split
except ImportError:  # built where a C compiler is (setup.py); the Python way below otherwise
    _sse_split = None  # type: ignore[assignment]

# An event ends at a blank line; any of the three line endings SSE allows may end it.
_TERMINATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
# Only these end a line in SSE (str.splitlines would also cut at U+2028 inside a JSON string).
_LINES = re.compile("\r\n|\r|\n")
# The most one event (or a whole answer that is not streamed) may hold: past it the upstream is
# sending no answer a client could use, and holding more would let it exhaust the gateway.
MAX_EVENT_BYTES = 64 * 1024 * 1024


class SseEvent(NamedTuple):
    """One dispatched event: its `event:` name ('' when it had none) and its joined data.

    A named tuple: immutable, and made in one C call (one is made per event of every stream)."""

    event: str
    data: str


class SseSplitter:
    """feed(chunk) -> (the bytes that end on an event boundary, the events they hold).

    What follows the last complete event is kept for the next chunk: the gateway forwards a
    client only bytes whose events it has recorded. The held tail is bounded by one event."""

    def __init__(self) -> None:
        # The bytes after the last complete event, in the pieces they came in: an event larger
        # than a read is joined once, when it is complete, never copied at every read.
        self._held: list[bytes] = []
        self._tail = b""
        self.held = 0  # bytes in _held: the size of the event still coming

    def whole(self, chunk: bytes) -> bool:
        """Whether chunk is a whole number of events on its own: nothing is held from before
        and it ends on an event boundary (what feed would return whole)."""
        return not self._held and chunk.endswith(b"\n\n")

    def feed(self, chunk: bytes) -> tuple[bytes, list[SseEvent]]:
        if self.whole(chunk):
            # Nearly every read of a stream: nothing held from before, and the read ends on an
            # event boundary (whatever line endings come earlier, a final `\n\n` ends one).
            return chunk, parse_events(chunk)
        # A terminator may straddle the previous read and this one: look from 3 bytes back.
        window = self._tail + chunk
        end = 0
        for terminator in _TERMINATORS:
            found = window.rfind(terminator)
            if found >= 0:
                end = max(end, found + len(terminator))
        end -= len(self._tail)
        if end <= 0:
            self._held.append(chunk)
            self.held += len(chunk)
            self._tail = window[-3:]
            return b"", []
        if self._held:
            self._held.append(chunk[:end])
            complete = b"".join(self._held)
        else:
            complete = chunk[:end]
        rest = chunk[end:]
        self._held = [rest] if rest else []
        self.held = len(rest)
        self._tail = rest[-3:]
        return complete, parse_events(complete)

    def rest(self) -> bytes:
        """What the stream ended with after its last complete event (a torn event)."""
        rest = b"".join(self._held)
        self._held, self._tail, self.held = [], b"", 0
        return rest


def parse_events(block: bytes) -> list[SseEvent]:
    """The events of complete SSE text; a block with no `data:` dispatches nothing."""
    if _sse_split is not None:
        # The common case in one C call (_sse_split.c), the same steps as _parse_events's;
        # None for a block with carriage returns or text that is not UTF-8.
        split: list[SseEvent] | None = _sse_split.parse_events(block)
        if split is not None:
            return split
    return _parse_events(block)


def _parse_events(block: bytes) -> list[SseEvent]:
    """parse_events the Python way: the reference _sse_split.c follows, and every case it
    leaves."""
    events: list[SseEvent] = []
    name = ""
    data: list[str] = []
    text = block.decode("utf-8", "replace")
    for line in _LINES.split(text) if "\r" in text else text.split("\n"):
        if not line:
            if data:
                events.append(SseEvent(name, "\n".join(data)))
            name, data = "", []
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
    if data:
        events.append(SseEvent(name, "\n".join(data)))
    return events


if _sse_split is not None:
    _sse_split.setup_sse(SseEvent)

__all__ = ["SseEvent", "SseSplitter", "parse_events"]
