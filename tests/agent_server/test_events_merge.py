"""Delta merging in the event buffer: only into an event that every live subscriber still awaits."""

from __future__ import annotations

from agent_server.events import EventBuffer
from rollout.agent.v1 import agent_pb2


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
    assert texts([e async for e in buffer.subscribe(0)]) == ["a", "b", "c"]


async def test_a_waiting_subscriber_gets_what_arrived_meanwhile_as_one_event() -> None:
    buffer = EventBuffer(10)
    publish_delta(buffer, "a")
    live = buffer.subscribe(0)
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
    replay = [e async for e in buffer.subscribe(0)]
    assert texts(replay) == ["a", "bc", "x", "", "d"]


async def test_an_event_one_subscriber_has_is_frozen_for_every_other() -> None:
    buffer = EventBuffer(10)
    publish_delta(buffer, "a")
    fast = buffer.subscribe(0)
    slow = buffer.subscribe(0)
    assert texts([await anext(fast), await anext(slow)]) == ["a", "a"]
    publish_delta(buffer, "b")
    assert texts([await anext(fast)]) == ["b"]
    # The slow subscriber has not seen "b" yet, but the fast one has: "c" is its own event.
    publish_delta(buffer, "c")
    buffer.close()
    assert texts([e async for e in slow]) == ["b", "c"]
    assert texts([e async for e in fast]) == ["c"]
