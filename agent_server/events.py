"""A thread's bounded event buffer: numbered events, replay after an index, then live ones."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from agent_server.errors import EventsOutOfRangeError
from rollout.agent.v1 import agent_pb2


class EventBuffer:
    """Keeps the last `capacity` events of a thread; subscribers never slow the publisher.

    Publishing is synchronous and O(1); every subscriber walks the shared buffer at its own
    pace and waits on a one-shot Event that the next publish (or close) sets, so a slow
    subscriber costs no memory beyond its position and is told when it fell out of the buffer.

    Text deltas may be merged (merge_delta) into the delta event before them while that event
    is still waiting for every live subscriber: nothing is delayed, and a subscriber that
    cannot keep up with one message per delta gets fewer, larger ones instead of lagging.
    """

    def __init__(self, capacity: int) -> None:
        self._events: deque[agent_pb2.ThreadEvent] = deque(maxlen=capacity)
        self._next_index = 1
        self._closed = False
        self._changed = asyncio.Event()
        # The highest index handed to any subscriber: events up to it are frozen.
        self._taken = 0
        self._subscribers = 0

    @property
    def last_index(self) -> int:
        return self._next_index - 1

    @property
    def closed(self) -> bool:
        return self._closed

    def _first_index(self) -> int:
        return self._next_index - len(self._events)

    def publish(self, event: agent_pb2.ThreadEvent) -> agent_pb2.ThreadEvent:
        """Number the event, keep it, wake the subscribers; events after close are dropped."""
        if self._closed:
            return event
        event.index = self._next_index
        self._next_index += 1
        self._events.append(event)
        self._wake()
        return event

    def merge_delta(self, turn_id: str, item_id: str, delta: str) -> bool:
        """Append delta to the latest event when it is a delta of the same turn and item that
        no subscriber has been handed yet while at least one is live; False when it is not."""
        if self._closed or not self._subscribers or self._taken >= self.last_index:
            return False
        last = self._events[-1]
        if last.turn_id != turn_id or last.WhichOneof("kind") != "agent_message_delta":
            return False
        body = last.agent_message_delta
        if body.item_id != item_id:
            return False
        body.delta += delta
        return True

    def close(self) -> None:
        """End every subscription once it has drained what is buffered."""
        if not self._closed:
            self._closed = True
            self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def check(self, after_index: int) -> None:
        """Raise EventsOutOfRangeError unless a subscription after `after_index` can start."""
        if after_index > self.last_index:
            raise EventsOutOfRangeError(
                f"after_index {after_index} is beyond the last event {self.last_index}",
                last_index=str(self.last_index),
            )
        if after_index + 1 < self._first_index():
            raise EventsOutOfRangeError(
                f"events after index {after_index} are no longer buffered; "
                f"the oldest buffered event is {self._first_index()}",
                first_index=str(self._first_index()),
            )

    async def subscribe(self, after_index: int) -> AsyncIterator[agent_pb2.ThreadEvent]:
        """Yield the events after `after_index`, then live ones until the buffer closes."""
        self.check(after_index)
        position = after_index
        self._subscribers += 1
        try:
            while True:
                first = self._first_index()
                if position + 1 < first:
                    raise EventsOutOfRangeError(
                        f"the subscriber fell behind: event {position + 1} was dropped from the "
                        f"buffer; resume from index {first - 1} or later",
                        first_index=str(first),
                    )
                if position < self.last_index:
                    position += 1
                    self._taken = max(self._taken, position)
                    yield self._events[position - first]
                    continue
                if self._closed:
                    return
                await self._changed.wait()
        finally:
            self._subscribers -= 1
