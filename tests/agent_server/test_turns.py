"""Turns over the agent API: history across turns, event replay, concurrent threads."""

from __future__ import annotations

import asyncio
import json

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)


async def test_second_turn_sends_the_history_and_reuses_its_items(
    provider: ScriptedProvider, agent: Harness
) -> None:
    provider.queue(answer("first answer", "msg-a", "resp-a"))
    provider.queue(answer("second answer", None, "resp-b"))
    thread = await agent.start_thread(instructions="be brief")
    events = agent.events(thread.id)
    first = await agent.start_turn(thread.id, "question one")
    assert (await events.turn_completed(first.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    second = await agent.start_turn(thread.id, "question two")
    assert (await events.turn_completed(second.id)).status == agent_pb2.TURN_STATUS_COMPLETED

    bodies = [json.loads(request.body) for request in provider.requests]
    assert [body["instructions"] for body in bodies] == ["be brief", "be brief"]
    assert all(body["stream"] is True and body["store"] is False for body in bodies)
    assert bodies[1]["input"][:2] == [bodies[0]["input"][0], bodies[1]["input"][1]]
    roles_and_texts = [(item["role"], item["content"][0]["text"]) for item in bodies[1]["input"]]
    assert roles_and_texts == [
        ("user", "question one"),
        ("assistant", "first answer"),
        ("user", "question two"),
    ]

    closed = await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    assert closed.thread.status == agent_pb2.THREAD_STATUS_CLOSED
    assert closed.thread.recording_status == agent_pb2.RECORDING_STATUS_CLOSED
    assert [t.status for t in closed.thread.turns] == [agent_pb2.TURN_STATUS_COMPLETED] * 2
    rollout = await reduce_with_cli(agent.bundles()[0])
    assert rollout.recording_complete
    call_a, call_b = (
        rollout.inference_calls[call_id]
        for turn in (first, second)
        for call_id in rollout.turns[turn.id].inference_call_ids
    )
    # The second request reuses the items of the first: no duplicate conversation items.
    assert list(call_b.request_item_ids[:2]) == [
        *call_a.request_item_ids,
        *call_a.response_item_ids,
    ]
    assert list(rollout.threads[thread.id].conversation_item_ids) == [
        *call_b.request_item_ids,
        *call_b.response_item_ids,
    ]
    ids = [e.item_completed.item.id for e in events.of_kind("item_completed")]
    assert ids == [
        rollout.conversation_items[call.response_item_ids[0]].responses_item_id
        for call in (call_a, call_b)
    ]
    assert ids[0] == "msg-a"
    assert ids[1].startswith("msg_")


async def test_a_late_subscriber_gets_every_event_from_index_one(
    provider: ScriptedProvider, agent: Harness
) -> None:
    gate = asyncio.Event()
    item = message("held answer", "msg-held")
    provider.queue(
        sse(created(), item_added(item), text_delta("held answer", "msg-held"), item_done(item)),
        gate,
        sse(completed(usage={"input_tokens": 1, "output_tokens": 2, "total_tokens": 3})),
    )
    thread = await agent.start_thread()
    early = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    await early.wait_for(lambda e: e.HasField("item_completed"))

    late = agent.events(thread.id)
    await late.wait_for(lambda e: e.HasField("item_completed"))
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert reply.thread.turns[0].status == agent_pb2.TURN_STATUS_IN_PROGRESS
    gate.set()
    await early.turn_completed(turn.id)
    await late.turn_completed(turn.id)
    assert [e.index for e in late.events] == list(range(1, len(late.events) + 1))
    assert late.events == early.events
    kinds = [e.WhichOneof("kind") for e in late.events]
    assert kinds[0] == "turn_started"
    assert kinds[-1] == "turn_completed"
    assert {"item_started", "agent_message_delta", "item_completed", "token_usage"} <= set(kinds)
    assert all(e.thread_id == thread.id and e.turn_id == turn.id for e in late.events)

    resumed = agent.events(thread.id, after_index=3)
    await resumed.turn_completed(turn.id)
    assert [e.index for e in resumed.events] == [e.index for e in late.events[3:]]

    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    # Closing the thread ends every live stream, after what was buffered.
    assert len(await late.until_end()) == len(early.events)
    assert late.error is None


async def test_several_threads_run_at_once(provider: ScriptedProvider, agent: Harness) -> None:
    gates = [asyncio.Event() for _ in range(3)]
    for number, gate in enumerate(gates):
        provider.queue(gate, answer(f"answer {number}", f"msg-{number}", f"resp-{number}"))
    threads = [await agent.start_thread() for _ in gates]
    logs = [agent.events(thread.id) for thread in threads]
    turns = [await agent.start_turn(thread.id, "go") for thread in threads]
    # Every turn is in flight at the same time before any of them may finish.
    for thread in threads:
        reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
        assert [t.status for t in reply.thread.turns] == [agent_pb2.TURN_STATUS_IN_PROGRESS]
    for gate in reversed(gates):
        gate.set()
    finals = [await log.turn_completed(turn.id) for log, turn in zip(logs, turns, strict=True)]
    assert {turn.status for turn in finals} == {agent_pb2.TURN_STATUS_COMPLETED}
    texts = {log.of_kind("item_completed")[0].item_completed.item.text for log in logs}
    assert texts == {"answer 0", "answer 1", "answer 2"}
    await agent.server.stop()

    bundles = agent.bundles()
    assert len(bundles) == 3
    for bundle in bundles:
        rollout = await reduce_with_cli(bundle)
        assert rollout.recording_complete
        [thread_state] = rollout.threads.values()
        assert thread_state.execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
        [turn_state] = rollout.turns.values()
        assert turn_state.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED


async def test_token_usage_reaches_clients_and_the_trace(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent()
    provider.queue(answer("counted"))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "count")
    await events.turn_completed(turn.id)
    [usage] = events.of_kind("token_usage")
    assert (usage.token_usage.input_tokens, usage.token_usage.total_tokens) == (3, 5)
    await agent.server.stop()
    rollout = await reduce_with_cli(agent.bundles()[0])
    [call] = rollout.inference_calls.values()
    assert (call.usage.input_tokens, call.usage.output_tokens) == (3, 2)
    assert call.response_id == "resp-1"


async def test_interleaved_items_with_and_without_ids(
    provider: ScriptedProvider, agent: Harness
) -> None:
    first = message("", "a")
    anonymous = message("", None)
    announced_late = message("never added", "c")
    anonymous_done = message("y", None)
    provider.queue(
        sse(
            created(),
            item_added(first),
            item_added(anonymous),
            text_delta("x", "a"),
            text_delta("y"),
            item_done(anonymous_done),
            item_done(announced_late),
            completed(),
        )
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "mix")
    await events.turn_completed(turn.id)
    started = [e.item_started.item.id for e in events.of_kind("item_started")]
    assert started[0] == "a"
    assert started[1].startswith("msg_")
    deltas = [
        (e.agent_message_delta.item_id, e.agent_message_delta.delta)
        for e in events.of_kind("agent_message_delta")
    ]
    assert deltas == [("a", "x"), (started[1], "y")]
    done = [e.item_completed.item.id for e in events.of_kind("item_completed")]
    assert done == [started[1], "c"]
    await agent.server.stop()

    rollout = await reduce_with_cli(agent.bundles()[0])
    [call] = rollout.inference_calls.values()
    accepted = [rollout.conversation_items[i].responses_item_id for i in call.response_item_ids]
    assert accepted == done
    assert [(d.provider_item_id, d.partial_text) for d in call.discarded_outputs] == [("a", "x")]


async def test_interrupt_before_the_turn_task_ever_ran(
    provider: ScriptedProvider, agent: Harness
) -> None:
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    core = agent.server.agent
    # No await between the two calls: the turn's task has not had a single step yet.
    turn = core.start_turn(thread.id, ["never sent"])
    stopped = await core.interrupt(thread.id, turn.id, "test-client")
    assert stopped.status == agent_pb2.TURN_STATUS_INTERRUPTED
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_INTERRUPTED
    assert provider.requests == []
    await agent.server.stop()

    rollout = await reduce_with_cli(agent.bundles()[0])
    assert rollout.recording_complete
    assert rollout.turns[turn.id].execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert rollout.turns[turn.id].interrupt.requested_by == "test-client"
    assert list(rollout.inference_calls) == []
