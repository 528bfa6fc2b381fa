"""Delta merging in the event buffer: only into an event that every live subscriber still awaits."""

from __future__ import annotations

import asyncio

from agent_server.events import EventBuffer
from rollout.agent.v1 import agent_pb2
from tests.agent_server.event_reader import Subscription


def delta_event(delta: str, item_id: str = "i", turn_id: str = "t") -> agent_pb2.ThreadEvent:
    return agent_pb2.ThreadEvent(
        turn_id=turn_id,
        agent_message_delta=agent_pb2.AgentMessageDeltaEvent(item_id=item_id, delta=delta),
    )


def publish_delta(buffer: EventBuffer, delta: str, item_id: str = "i") -> None:
    if not buffer.merge_delta("t", item_id, delta):
        buffer.publish(delta_event(delta, item_id))


def texts(events: list[agent_pb2.ThreadEvent]) -> list[str]:
    return [e.agent_message_delta.delta for e in events]


async def test_without_subscribers_nothing_is_merged() -> None:
    buffer = EventBuffer(10)
    for text in "abc":
        publish_delta(buffer, text)
    buffer.close()
    assert texts([e async for e in Subscription(buffer, 0)]) == ["a", "b", "c"]


async def test_a_waiting_subscriber_gets_what_arrived_meanwhile_as_one_event() -> None:
    buffer = EventBuffer(10)
    publish_delta(buffer, "a")
    live = Subscription(buffer, 0)
    first = await anext(live)
    assert texts([first]) == ["a"]
    # "a" was handed out: it is never changed again; "b" starts a new event that "c" joins.
    publish_delta(buffer, "b")
    publish_delta(buffer, "c")
    # Another item, or any other kind of event, is never merged into.
    publish_delta(buffer, "x", item_id="other")
    buffer.publish(agent_pb2.ThreadEvent(turn_id="t"))
    publish_delta(buffer, "d")
    buffer.close()
    rest = [e async for e in live]
    assert texts(rest) == ["bc", "x", "", "d"]
    assert [e.index for e in [first, *rest]] == [1, 2, 3, 4, 5]
    assert first.agent_message_delta.delta == "a"
    # A later subscriber replays the same events.
    replay = [e async for e in Subscription(buffer, 0)]
    assert texts(replay) == ["a", "bc", "x", "", "d"]


async def test_an_event_one_subscriber_has_is_frozen_for_every_other() -> None:
    buffer = EventBuffer(10)
    publish_delta(buffer, "a")
    fast = Subscription(buffer, 0)
    slow = Subscription(buffer, 0)
    assert texts([await anext(fast), await anext(slow)]) == ["a", "a"]
    publish_delta(buffer, "b")
    assert texts([await anext(fast)]) == ["b"]
    # The slow subscriber has not seen "b" yet, but the fast one has: "c" is its own event.
    publish_delta(buffer, "c")
    buffer.close()
    assert texts([e async for e in slow]) == ["b", "c"]
    assert texts([e async for e in fast]) == ["c"]


async def test_a_subscriber_starting_after_an_event_is_not_sent_deltas_joined_to_it() -> None:
    """Nobody was handed "b", but a subscriber starts after it (a client asking only for what
    comes next): the item's next delta is an event of its own, not joined to "b" where that
    subscriber would never see it."""
    buffer = EventBuffer(10)
    publish_delta(buffer, "-", item_id="other")
    reader = Subscription(buffer, 0)
    await anext(reader)
    publish_delta(buffer, "a")  # waiting for the reader: the item's next delta may join it
    await reader.aclose()
    publish_delta(buffer, "b")  # nobody attached: no subscriber has it
    again = asyncio.create_task(anext(Subscription(buffer, 3)))
    await asyncio.sleep(0)
    assert buffer.subscribers == 1  # waiting for what follows "b"
    publish_delta(buffer, "c")
    buffer.close()
    assert texts([await again]) == ["c"]
    assert texts([e async for e in Subscription(buffer, 0)]) == ["-", "a", "b", "c"]
