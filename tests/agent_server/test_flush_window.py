"""StreamEvents' flush window: a subscriber holds a delta so that its item's next deltas join it."""

from __future__ import annotations

import grpc
import pytest

from agent_server.events import EventBuffer
from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import EventLog, Harness, StartAgent, error_info, error_reason
from tests.agent_server.event_reader import Subscription
from tests.agent_server.test_events_merge import delta_event, publish_delta, texts

# Longer than any test runs: only another event or the end of the stream releases a held delta.
FOREVER = 3600.0


async def test_the_first_delta_goes_at_once_and_the_next_ones_join_while_held() -> None:
    buffer = EventBuffer(10)
    live = Subscription(buffer, 0, flush_window=FOREVER)
    publish_delta(buffer, "a")
    first = await anext(live)
    assert texts([first]) == ["a"]
    # Handed out right away: "a" did not wait for a window, nothing had been sent before it.
    nxt = anext(live)
    publish_delta(buffer, "b")
    publish_delta(buffer, "c")
    publish_delta(buffer, "d")
    # Another kind of event releases the held delta, which went out with all three.
    buffer.publish(agent_pb2.ThreadEvent(turn_id="t"))
    merged = await nxt
    assert texts([merged]) == ["bcd"]
    other = await anext(live)
    assert other.WhichOneof("kind") is None
    assert [first.index, merged.index, other.index] == [1, 2, 3]
    buffer.close()
    assert [e async for e in live] == []
    # A subscriber resuming after the merged event's index misses nothing and sees nothing twice.
    assert [e.index for e in [e async for e in Subscription(buffer, merged.index)]] == [3]
    assert texts([e async for e in Subscription(buffer, 0)])[:2] == ["a", "bcd"]


async def test_the_window_ending_releases_a_held_delta() -> None:
    buffer = EventBuffer(10)
    live = Subscription(buffer, 0, flush_window=0.05)
    publish_delta(buffer, "a")
    assert texts([await anext(live)]) == ["a"]
    publish_delta(buffer, "b")
    publish_delta(buffer, "c")
    # Nothing else is published: only the window's end lets it out.
    assert texts([await anext(live)]) == ["bc"]
    buffer.close()


async def test_close_and_another_item_release_a_held_delta() -> None:
    buffer = EventBuffer(10)
    live = Subscription(buffer, 0, flush_window=FOREVER)
    publish_delta(buffer, "a")
    await anext(live)
    publish_delta(buffer, "b")
    publish_delta(buffer, "x", item_id="other")
    assert texts([await anext(live)]) == ["b"]
    # "x" is now the newest delta, held in turn; closing the buffer lets it out.
    nxt = anext(live)
    buffer.close()
    assert texts([await nxt]) == ["x"]


async def test_a_subscriber_without_window_freezes_what_it_takes() -> None:
    buffer = EventBuffer(10)
    held = Subscription(buffer, 0, flush_window=FOREVER)
    eager = Subscription(buffer, 0)
    publish_delta(buffer, "a")
    assert texts([await anext(held), await anext(eager)]) == ["a", "a"]
    publish_delta(buffer, "b")
    # The eager subscriber takes "b" at once, so "c" cannot join it: both keep their events.
    assert texts([await anext(eager)]) == ["b"]
    publish_delta(buffer, "c")
    buffer.close()
    assert texts([e async for e in held]) == ["b", "c"]
    assert texts([e async for e in eager]) == ["c"]


async def test_a_window_of_zero_never_holds() -> None:
    buffer = EventBuffer(10)
    live = Subscription(buffer, 0, flush_window=0.0)
    buffer.publish(delta_event("a"))
    assert texts([await anext(live)]) == ["a"]
    nxt = anext(live)
    buffer.publish(delta_event("b"))
    assert texts([await nxt]) == ["b"]
    buffer.close()


def _stream(agent: Harness, thread_id: str, **fields: int) -> EventLog:
    log = EventLog(
        agent.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id, **fields))
    )
    agent.logs.append(log)
    return log


@pytest.mark.parametrize("window", [None, 0, 1000])
async def test_every_window_delivers_the_same_text_and_resumes_exactly(
    start_agent: StartAgent, window: int | None
) -> None:
    agent = await start_agent(provider_url=None, local_word_delay=0.002)
    thread = await agent.start_thread()
    fields = {} if window is None else {"flush_window_ms": window}
    log = _stream(agent, thread.id, **fields)
    turn = await agent.start_turn(thread.id, "tell me about flush windows")
    await log.turn_completed(turn.id)
    deltas = log.of_kind("agent_message_delta")
    text = "".join(e.agent_message_delta.delta for e in deltas)
    assert text == log.of_kind("item_completed")[-1].item_completed.item.text
    if window == 1000:
        # The reply streams in well under a second: its words go out in a few events.
        assert len(deltas) < len(text.split())
    # Indexes are 1, 2, 3, ... whatever was merged.
    assert [e.index for e in log.events] == list(range(1, len(log.events) + 1))
    # Resuming after any delta event yields exactly the rest, under the same indexes.
    middle = deltas[len(deltas) // 2]
    resumed = _stream(agent, thread.id, after_index=middle.index, **fields)
    await resumed.turn_completed(turn.id)
    assert [e.index for e in resumed.events] == [e.index for e in log.events[middle.index :]]
    rest = "".join(e.agent_message_delta.delta for e in resumed.of_kind("agent_message_delta"))
    upto = "".join(e.agent_message_delta.delta for e in deltas if e.index <= middle.index)
    assert upto + rest == text


async def test_a_window_above_a_second_is_refused(agent: Harness) -> None:
    thread = await agent.start_thread()
    call = agent.stub.StreamEvents(
        agent_pb2.StreamEventsRequest(thread_id=thread.id, flush_window_ms=1001)
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await anext(aiter(call))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(raised.value) == "INVALID_FLUSH_WINDOW"
    assert "1001" in (raised.value.details() or "")


async def test_a_client_joining_mid_reply_after_the_last_event_gets_the_rest_as_deltas(
    start_agent: StartAgent,
) -> None:
    """A client asking only for what comes next (after the last index, learnt from a refusal)
    while a reply streams that nobody else reads: the item's next deltas come to it as events,
    not joined to the delta event before its start, which it never receives."""
    agent = await start_agent(provider_url=None, local_word_delay=0.05)
    thread = await agent.start_thread()
    first = _stream(agent, thread.id)
    turn = await agent.start_turn(thread.id, "tell me what a client joining late should see")
    deltas_seen = 0

    def second_delta(event: agent_pb2.ThreadEvent) -> bool:
        nonlocal deltas_seen
        deltas_seen += event.WhichOneof("kind") == "agent_message_delta"
        return deltas_seen == 2

    taken = (await first.wait_for(second_delta)).index
    await first.close()  # the reply goes on with nobody reading it

    async def last_index() -> int:
        """Where the events are, as a client learns it: the refusal of an index beyond them."""
        beyond = agent.stub.StreamEvents(
            agent_pb2.StreamEventsRequest(thread_id=thread.id, after_index=10**9)
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await anext(aiter(beyond))
        return int(error_info(raised.value).metadata["last_index"])

    # Asked until a delta nobody was handed is the last event (a word comes every 50 ms).
    while (last := await last_index()) <= taken:
        pass
    joined = _stream(agent, thread.id, after_index=last)
    await joined.turn_completed(turn.id)
    replay = _stream(agent, thread.id)
    await replay.turn_completed(turn.id)
    text = replay.of_kind("item_completed")[-1].item_completed.item.text
    joined_deltas = joined.of_kind("agent_message_delta")
    assert joined_deltas, "the reply ended before the client joined: nothing was tested"
    before = "".join(
        e.agent_message_delta.delta
        for e in replay.of_kind("agent_message_delta")
        if e.index <= last
    )
    assert before + "".join(e.agent_message_delta.delta for e in joined_deltas) == text
