"""A thread's bounded event buffer: numbered events, replay after an index, then live ones."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncGenerator

from agent_server import telemetry
from agent_server.errors import EventsOutOfRangeError
from rollout.agent.v1 import agent_pb2
from trace_reducer import encode_varint

# A client receives at most 4 MiB per message by default; a delta event stays far below it
# (4 bytes per character at most).
MAX_DELTA_CHARS = 256 * 1024
# How long a subscriber may hold a text delta by default so that the item's next deltas join it
# (StreamEventsRequest.flush_window_ms), and the most a client may ask for.
DEFAULT_FLUSH_WINDOW_MS = 10
MAX_FLUSH_WINDOW_MS = 1000
# How far beyond its capacity the buffer grows to keep events an attached subscriber has not
# had yet (a burst published faster than any subscriber can take it).
HOLD_FACTOR = 4
# The wire tag of StreamEventsResponse's only field, `event` (field 1, length-delimited).
_EVENT_FIELD_TAG = b"\x0a"

# An event as a subscriber sends it: its StreamEventsResponse message, and whether it is a text
# delta (what a flush window holds).
_Sent = tuple[bytes, bool]


class EventBuffer:
    """Keeps the last `capacity` events of a thread; subscribers never slow the publisher.

    Publishing is synchronous; every subscriber walks the shared buffer at its own pace and
    waits on a future of its own that the next publish (or close) sets.

    `capacity` is the replay window: a subscription may start after any of the last
    `capacity` events. Events that an attached subscriber has not been handed yet are kept
    beyond it, up to `HOLD_FACTOR * capacity`, so that a burst published in one go reaches
    every subscriber that keeps reading; a subscriber that does not read is told it fell
    behind once the buffer passes that bound.

    Text deltas are merged (merge_delta) into the latest delta event of the same item while no
    subscriber has been handed that event and only other deltas followed it: nothing is
    delayed, and a subscriber that cannot keep up with one message per delta gets fewer,
    larger ones instead of lagging.

    An event is serialized once, as the StreamEventsResponse every subscriber sends, when it is
    first handed out; from then on the buffer keeps only those bytes, a fifth of what the
    message takes, since an open thread keeps up to `capacity` events however long ago they
    were read. One nobody reads (the gateway's threads have no subscriber) is never serialized.

    A subscriber with a flush window holds the newest event, when it is such a joinable delta,
    until `flush_window` seconds after the last delta it was handed, so that the item's deltas
    arriving meanwhile join it: at most one delta event per window, the first at once. A
    merged event keeps its index (later events are numbered after it) and every subscriber
    and every replay sees the same text under it, so `after_index` resumes exactly.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hold_limit = capacity * HOLD_FACTOR
        # An event not handed out yet (it may still be joined), or what it was sent as.
        self._events: deque[agent_pb2.ThreadEvent | _Sent] = deque()
        self._first = 1  # index of _events[0]
        self._next_index = 1
        self._closed = False
        # Each waiting subscriber's own future, all set by the next publish or close: what an
        # asyncio.Event keeps, without the Event made per publish and its wait's loop lookup
        # (on Python 3.11 a getpid() system call each time), once per delta.
        self._waiters: list[asyncio.Future[None]] = []
        # The highest index handed to any subscriber, or that one started after: events up to
        # it are frozen.
        self._taken = 0
        # Attached subscribers and the index of the last event each was handed.
        self._positions: dict[int, int] = {}
        self._subscriber_ids = itertools.count()
        # The delta event each item's next delta may join, while only deltas follow it.
        self._joinable: dict[tuple[str, str], agent_pb2.ThreadEvent] = {}
        # Text merged into an event not yet handed out, joined when it first is.
        self._parts: dict[int, list[str]] = {}
        self._part_chars: dict[int, int] = {}

    @property
    def last_index(self) -> int:
        return self._next_index - 1

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def subscribers(self) -> int:
        return len(self._positions)

    def publish(self, event: agent_pb2.ThreadEvent) -> agent_pb2.ThreadEvent:
        """Number the event, keep it, wake the subscribers; events after close are dropped."""
        if self._closed:
            return event
        event.index = self._next_index
        self._next_index += 1
        self._events.append(event)
        if event.WhichOneof("kind") == "agent_message_delta":
            body = event.agent_message_delta
            if not body.refusal:
                self._joinable[(event.turn_id, body.item_id)] = event
        elif self._joinable:
            self._joinable.clear()
        if len(self._events) > self._capacity:
            self._trim()
        self._wake()
        return event

    def _trim(self) -> None:
        held = min(self._positions.values(), default=self.last_index)
        events = self._events
        while len(events) > self._capacity and (
            held >= self._first or len(events) > self._hold_limit
        ):
            events.popleft()
            self._parts.pop(self._first, None)
            self._part_chars.pop(self._first, None)
            self._first += 1

    def merge_delta(self, turn_id: str, item_id: str, delta: str) -> bool:
        """Join delta to the item's latest delta event when no subscriber has that event yet
        while at least one is attached; False when it cannot be joined."""
        if self._closed or not self._positions:
            return False
        event = self._joinable.get((turn_id, item_id))
        if event is None or event.index <= self._taken:
            return False
        index = event.index
        chars = self._part_chars.get(index)
        if chars is None:
            chars = len(event.agent_message_delta.delta)
        if chars + len(delta) > MAX_DELTA_CHARS:
            return False
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = [event.agent_message_delta.delta]
        parts.append(delta)
        self._part_chars[index] = chars + len(delta)
        return True

    def close(self) -> None:
        """End every subscription once it has drained what is buffered."""
        if not self._closed:
            self._closed = True
            self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                # One that timed out or was cancelled is done already.
                if not waiter.done():
                    waiter.set_result(None)

    def _changed(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future the next publish or close sets; the subscriber's own, so that cancelling
        its wait (a timeout, the client leaving) leaves the others' alone."""
        waiter = loop.create_future()
        self._waiters.append(waiter)
        return waiter

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        """Drop a waiter no publish set (its wait timed out or was cancelled), so that waits
        that end that way on a quiet thread do not pile up."""
        if waiter.cancelled():
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def check(self, after_index: int) -> None:
        """Raise EventsOutOfRangeError unless a subscription after `after_index` can start."""
        # Only the replay window is promised to a new subscriber. Both ends go in every
        # refusal, so a client can resume from whichever end it needs.
        first = max(self._first, self._next_index - self._capacity)
        ends = {"first_index": str(first), "last_index": str(self.last_index)}
        if after_index > self.last_index:
            raise EventsOutOfRangeError(
                f"after_index {after_index} is beyond the last event {self.last_index}", **ends
            )
        if after_index + 1 < first:
            raise EventsOutOfRangeError(
                f"events after index {after_index} are no longer buffered; "
                f"the oldest buffered event is {first}",
                **ends,
            )

    def _take(self, index: int) -> _Sent:
        """The event at index as sent, serialized (with what joined it) the first time."""
        self._taken = max(self._taken, index)
        slot = index - self._first
        entry = self._events[slot]
        if isinstance(entry, tuple):
            return entry
        parts = self._parts.pop(index, None)
        if parts is not None:
            self._part_chars.pop(index, None)
            entry.agent_message_delta.delta = "".join(parts)
        sent = _sent(entry, entry.WhichOneof("kind") == "agent_message_delta")
        self._events[slot] = sent
        return sent

    def _joinable_at(self, index: int) -> bool:
        """Whether the event at index is a delta that the item's next delta may still join."""
        if index <= self._taken:
            return False
        event = self._events[index - self._first]
        if isinstance(event, tuple) or event.WhichOneof("kind") != "agent_message_delta":
            return False
        key = (event.turn_id, event.agent_message_delta.item_id)
        return self._joinable.get(key) is event

    async def subscribe(
        self, after_index: int, flush_window: float = 0.0
    ) -> AsyncGenerator[bytes, None]:
        """Yield the events after `after_index`, then live ones until the buffer closes, each
        as the serialized StreamEventsResponse that carries it (the same bytes for every
        subscriber); with a flush window (seconds), at most one delta event per window (see
        the class)."""
        self.check(after_index)
        subscriber = next(self._subscriber_ids)
        position = after_index
        self._positions[subscriber] = position
        # What it starts after is as good as handed out: a delta joining an event there would
        # reach none of it.
        self._taken = max(self._taken, position)
        loop = asyncio.get_running_loop()
        # Before this loop time the newest delta event is held for its item's next deltas.
        hold_until = 0.0
        telemetry.subscriber_attached()
        try:
            while True:
                if position + 1 < self._first:
                    raise EventsOutOfRangeError(
                        f"the subscriber fell behind: event {position + 1} was dropped from the "
                        f"buffer; resume from index {self._first - 1} or later",
                        first_index=str(self._first),
                        last_index=str(self.last_index),
                    )
                if position < self.last_index:
                    if (
                        hold_until
                        and position + 1 == self.last_index
                        and not self._closed
                        and loop.time() < hold_until
                        and self._joinable_at(position + 1)
                    ):
                        # Another event or the end of the window releases it; deltas that
                        # join it meanwhile do not wake us.
                        changed = self._changed(loop)
                        try:
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout_at(hold_until):
                                    await changed
                        finally:
                            self._forget(changed)
                        continue
                    position += 1
                    self._positions[subscriber] = position
                    message, is_delta = self._take(position)
                    if flush_window and is_delta:
                        hold_until = loop.time() + flush_window
                    yield message
                    continue
                if self._closed:
                    return
                changed = self._changed(loop)
                try:
                    await changed
                finally:
                    self._forget(changed)
        finally:
            del self._positions[subscriber]
            telemetry.subscriber_detached()


def _sent(event: agent_pb2.ThreadEvent, is_delta: bool) -> _Sent:
    """The StreamEventsResponse carrying event, serialized: the message is only a field
    around it, so its bytes are the event's own with that field's tag and length before them."""
    body = event.SerializeToString()
    return _EVENT_FIELD_TAG + encode_varint(len(body)) + body, is_delta
