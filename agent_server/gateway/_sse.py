"""Server-Sent Events cut out of a byte stream as it arrives, the bytes kept as they came."""

from __future__ import annotations

import re
from dataclasses import dataclass

# An event ends at a blank line; any of the three line endings SSE allows may end it.
_TERMINATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
# Only these end a line in SSE (str.splitlines would also cut at U+2028 inside a JSON string).
_LINES = re.compile("\r\n|\r|\n")


@dataclass(frozen=True)
class SseEvent:
    """One dispatched event: its `event:` name ('' when it had none) and its joined data."""

    event: str
    data: str


class SseSplitter:
    """feed(chunk) -> (the bytes that end on an event boundary, the events they hold).

    What follows the last complete event is kept for the next chunk: the gateway forwards a
    client only bytes whose events it has recorded. The held tail is bounded by one event."""

    def __init__(self) -> None:
        self._held = b""

    @property
    def held(self) -> int:
        return len(self._held)

    def feed(self, chunk: bytes) -> tuple[bytes, list[SseEvent]]:
        data = self._held + chunk if self._held else chunk
        end = 0
        for terminator in _TERMINATORS:
            found = data.rfind(terminator)
            if found >= 0:
                end = max(end, found + len(terminator))
        if end == 0:
            self._held = data
            return b"", []
        self._held = data[end:]
        complete = data[:end]
        return complete, parse_events(complete)

    def rest(self) -> bytes:
        """What the stream ended with after its last complete event (a torn event)."""
        rest, self._held = self._held, b""
        return rest


def parse_events(block: bytes) -> list[SseEvent]:
    """The events of complete SSE text; a block with no `data:` dispatches nothing."""
    events: list[SseEvent] = []
    name = ""
    data: list[str] = []
    for line in _LINES.split(block.decode("utf-8", "replace")):
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
