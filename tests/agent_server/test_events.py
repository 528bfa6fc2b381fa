"""The bounded per-thread event buffer: replay, live delivery, slow subscribers, close."""

from __future__ import annotations

import asyncio

import pytest

from agent_server.errors import EventsOutOfRangeError
from agent_server.events import EventBuffer
from rollout.agent.v1 import agent_pb2
from tests.agent_server.event_reader import Subscription


def event(delta: str) -> agent_pb2.ThreadEvent:
    return agent_pb2.ThreadEvent(
        agent_message_delta=agent_pb2.AgentMessageDeltaEvent(item_id="i", delta=delta)
    )


def deltas(events: list[agent_pb2.ThreadEvent]) -> list[str]:
    return [e.agent_message_delta.delta for e in events]


async def collect(buffer: EventBuffer, after: int) -> list[agent_pb2.ThreadEvent]:
    return [e async for e in Subscription(buffer, after)]


async def test_replay_then_live_then_end_on_close() -> None:
    buffer = EventBuffer(10)
    for text in "ab":
        buffer.publish(event(text))
    task = asyncio.create_task(collect(buffer, 0))
    await asyncio.sleep(0)
    buffer.publish(event("c"))
    buffer.close()
    got = await task
    assert deltas(got) == ["a", "b", "c"]
    assert [e.index for e in got] == [1, 2, 3]
    assert deltas(await collect(buffer, 2)) == ["c"]


async def test_dropped_events_are_out_of_range() -> None:
    buffer = EventBuffer(2)
    for text in "abcd":
        buffer.publish(event(text))
    buffer.close()
    with pytest.raises(EventsOutOfRangeError) as raised:
        await collect(buffer, 1)
    assert raised.value.metadata["first_index"] == "3"
    assert deltas(await collect(buffer, 2)) == ["c", "d"]
    with pytest.raises(EventsOutOfRangeError):
        await collect(buffer, 5)


async def test_a_slow_subscriber_never_blocks_the_publisher_and_learns_it_fell_behind() -> None:
    buffer = EventBuffer(3)
    buffer.publish(event("a"))
    slow = Subscription(buffer, 0)
    assert deltas([await anext(slow)]) == ["a"]
    # The publisher goes on without waiting for the subscriber, which keeps its events held
    # up to HOLD_FACTOR times the capacity, and no further.
    for text in "bcdefghijklmn":
        buffer.publish(event(text))
    assert buffer.last_index == 14
    with pytest.raises(EventsOutOfRangeError):
        await anext(slow)


async def test_a_burst_beyond_the_capacity_reaches_a_reading_subscriber() -> None:
    buffer = EventBuffer(3)
    buffer.publish(event("-"))
    reader = Subscription(buffer, 0)
    await anext(reader)
    burst = "abcdefghij"  # more than the capacity, within what the buffer holds for readers
    for text in burst:
        buffer.publish(event(text))
    got = [await anext(reader) for _ in burst]
    assert deltas(got) == list(burst)
    # A new subscription is only promised the capacity's worth of replay.
    with pytest.raises(EventsOutOfRangeError):
        buffer.check(1)
    buffer.check(8)


async def test_only_the_subscriber_that_stopped_reading_falls_behind() -> None:
    buffer = EventBuffer(3)
    stalled = Subscription(buffer, 0)
    fast = Subscription(buffer, 0)
    buffer.publish(event("a"))
    assert deltas([await anext(stalled), await anext(fast)]) == ["a", "a"]
    received = 0
    for count in range(1, 21):
        buffer.publish(event(str(count)))
        await anext(fast)
        received += 1
    assert received == 20
    with pytest.raises(EventsOutOfRangeError):
        await anext(stalled)


async def test_deltas_of_interleaved_items_merge_while_nobody_has_them() -> None:
    buffer = EventBuffer(3)
    buffer.publish(event("-"))
    reader = Subscription(buffer, 0)
    await anext(reader)
    for count in range(1000):
        item = "a" if count % 2 else "b"
        if not buffer.merge_delta("t", item, "x"):
            buffer.publish(
                agent_pb2.ThreadEvent(
                    turn_id="t",
                    agent_message_delta=agent_pb2.AgentMessageDeltaEvent(item_id=item, delta="x"),
                )
            )
    buffer.close()
    got = [e async for e in reader]
    assert [(e.agent_message_delta.item_id, len(e.agent_message_delta.delta)) for e in got] == [
        ("b", 500),
        ("a", 500),
    ]


async def test_events_after_close_are_dropped() -> None:
    buffer = EventBuffer(3)
    buffer.close()
    buffer.publish(event("late"))
    assert buffer.last_index == 0
    assert await collect(buffer, 0) == []


async def test_a_handed_out_event_is_serialized_once_for_every_subscriber() -> None:
    buffer = EventBuffer(10)
    first, second = buffer.subscribe(0), buffer.subscribe(0)
    # Both attached (each has had an event of another item), neither has the next one yet.
    buffer.publish(
        agent_pb2.ThreadEvent(
            agent_message_delta=agent_pb2.AgentMessageDeltaEvent(item_id="j", delta="x")
        )
    )
    await anext(first)
    await anext(second)
    joined = buffer.publish(event("a"))
    assert buffer.merge_delta("", "i", "b")  # joined before anyone has the event
    sent_first, sent_second = await anext(first), await anext(second)
    # What the second subscriber sends is the very same bytes, not a second serialization.
    assert sent_second is sent_first
    message = agent_pb2.StreamEventsResponse.FromString(sent_first)
    assert message.event.index == joined.index == 2
    assert message.event.agent_message_delta.delta == "ab"
    assert sent_first == agent_pb2.StreamEventsResponse(event=joined).SerializeToString()
    # A subscriber replaying it later sends the same bytes too.
    late = buffer.subscribe(1)
    assert await anext(late) is sent_first
    for reader in (first, second, late):
        await reader.aclose()


async def test_an_event_is_kept_as_sent_once_handed_out() -> None:
    """A thread keeps its last `capacity` events however long ago they were read: each as the
    bytes a subscriber sends, not as a message, once one has been handed it; an event nobody
    has read is never serialized."""
    buffer = EventBuffer(4)
    reader = buffer.subscribe(0)
    for text in "abc":
        buffer.publish(event(text))
        await anext(reader)
    buffer.publish(event("d"))  # not handed out yet: the next delta may join it
    assert [type(entry) for entry in buffer._events] == [tuple, tuple, tuple, agent_pb2.ThreadEvent]
    await reader.aclose()
    buffer.publish(event("e"))  # nobody attached
    kinds = [type(entry) for entry in buffer._events]
    assert kinds == [tuple, tuple, agent_pb2.ThreadEvent, agent_pb2.ThreadEvent]
    # A replay reads them all the same, and keeps what it was handed as sent.
    buffer.close()
    assert deltas([e async for e in Subscription(buffer, 1)]) == ["b", "c", "d", "e"]
    assert [type(entry) for entry in buffer._events] == [tuple] * 4


async def test_waits_that_end_without_an_event_leave_nothing_behind() -> None:
    buffer = EventBuffer(10)
    buffer.publish(event("a"))
    # Subscribers that wait on a quiet thread and leave (a client's deadline), and one that
    # waits out its flush window on a held delta: none of their waits stays with the buffer.
    for _ in range(50):
        reader = Subscription(buffer, 1)
        waiting = asyncio.create_task(anext(reader))
        await asyncio.sleep(0)
        assert len(buffer._waiters) == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert buffer._waiters == []
    held = Subscription(buffer, 0, flush_window=0.05)
    assert deltas([await anext(held)]) == ["a"]
    buffer.publish(event("b"))
    # "b" is held for the window, then handed over: the wait timed out, and was dropped.
    assert deltas([await anext(held)]) == ["b"]
    assert buffer._waiters == []
    # A subscriber still waiting is woken by the next publish, each on its own future.
    readers = [Subscription(buffer, 2) for _ in range(3)]
    waits = [asyncio.create_task(anext(reader)) for reader in readers]
    await asyncio.sleep(0)
    assert len(buffer._waiters) == 3
    waits[0].cancel()
    buffer.publish(event("c"))
    assert [deltas([await wait]) for wait in waits[1:]] == [["c"], ["c"]]
    with pytest.raises(asyncio.CancelledError):
        await waits[0]
    await held.aclose()
