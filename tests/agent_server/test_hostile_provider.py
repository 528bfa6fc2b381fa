"""A hostile provider: whatever it sends, clients and the trace agree and nothing is lost."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_server.config import Secret
from agent_server.provider import ProviderClient, ProviderError
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import record_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, error_reason, reduce_with_cli
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
from trace_reducer import read_bundle

# More than any gRPC client takes in one message by default, and than a bundle record holds.
HUGE = 5 * 1024 * 1024
CLIENT_MESSAGE_LIMIT = 4 * 1024 * 1024


async def one_turn(
    agent: Harness, text: str = "hello"
) -> tuple[agent_pb2.Turn, list[agent_pb2.ThreadEvent], agent_pb2.Thread]:
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, text)
    final = await events.turn_completed(turn.id)
    return final, events.events, thread


async def closed_state(agent: Harness, thread: agent_pb2.Thread) -> state_pb2.RolloutTrace:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    rollout = await reduce_with_cli(Path(thread.bundle_path))
    assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    return rollout


def accepted_texts(rollout: state_pb2.RolloutTrace) -> dict[str, str]:
    """responses_item_id -> text of every item an inference call produced."""
    return {
        item.responses_item_id: "".join(part.text for part in item.content)
        for item in rollout.conversation_items.values()
        if any(ref.HasField("inference") for ref in item.produced_by)
    }


def streamed(events: list[agent_pb2.ThreadEvent], item_id: str) -> str:
    return "".join(
        e.agent_message_delta.delta
        for e in events
        if e.HasField("agent_message_delta") and e.agent_message_delta.item_id == item_id
    )


def completed_items(events: list[agent_pb2.ThreadEvent]) -> list[agent_pb2.Item]:
    return [e.item_completed.item for e in events if e.HasField("item_completed")]


def bundle_records(thread: agent_pb2.Thread) -> list[record_pb2.TraceRecord]:
    with read_bundle(thread.bundle_path) as reader:
        return list(reader)


async def test_lone_surrogates_become_replacement_characters_for_clients_and_trace(
    provider: ScriptedProvider, agent: Harness
) -> None:
    # JSON escapes that decode to unpaired UTF-16 halves: json.loads takes them, UTF-8 cannot.
    raw_item = (
        '{"type":"message","id":"msg-s","role":"assistant",'
        '"content":[{"type":"output_text","text":"a\\udc00b\\ud83d"}]}'
    )
    provider.queue(
        sse(created(), item_added(message("", "msg-s")))
        + 'data: {"type":"response.output_text.delta","item_id":"msg-s","delta":"a\\udc00b"}\n\n'
        + 'data: {"type":"response.output_text.delta","item_id":"msg-s","delta":"\\ud83d"}\n\n'
        + f'data: {{"type":"response.output_item.done","item":{raw_item}}}\n\n'
        + sse(completed())
    )
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert streamed(events, "msg-s") == "a\ufffdb\ufffd"
    [item] = completed_items(events)
    assert item.text == "a\ufffdb\ufffd"
    rollout = await closed_state(agent, thread)
    assert accepted_texts(rollout) == {"msg-s": "a\ufffdb\ufffd"}


async def test_a_huge_delta_is_recorded_and_reaches_a_client_with_default_limits(
    provider: ScriptedProvider, agent: Harness
) -> None:
    text = "x" * HUGE
    item = message(text, "msg-big")
    provider.queue(
        sse(created(), item_added(message("", "msg-big")), text_delta(text, "msg-big")),
        sse(item_done(item), completed()),
    )
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    # Every event fitted a default client's limit: the stream would have failed otherwise.
    assert all(e.ByteSize() < CLIENT_MESSAGE_LIMIT for e in events)
    assert streamed(events, "msg-big") == text
    [done] = completed_items(events)
    assert done.text_in_deltas
    assert done.text == ""
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert reply.thread.recording_status == agent_pb2.RECORDING_STATUS_ACTIVE
    rollout = await closed_state(agent, thread)
    assert accepted_texts(rollout) == {"msg-big": text}


async def test_a_huge_final_item_without_deltas_is_streamed_before_it_completes(
    provider: ScriptedProvider, agent: Harness
) -> None:
    text = "y" * HUGE
    provider.queue(sse(created()), sse(item_done(message(text, "msg-quiet")), completed()))
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert streamed(events, "msg-quiet") == text
    assert [i.text_in_deltas for i in completed_items(events)] == [True]
    assert accepted_texts(await closed_state(agent, thread)) == {"msg-quiet": text}


async def test_huge_ids_and_messages_are_clipped_alike_for_clients_and_trace(
    provider: ScriptedProvider, agent: Harness
) -> None:
    long_id = "r" * HUGE
    provider.queue(
        sse(
            created(long_id),
            {"type": "error", "code": "c" * HUGE, "message": "m" * HUGE},
        )
    )
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert len(final.error.message) < 64 * 1024
    assert "clipped from" in final.error.message
    assert all(e.ByteSize() < CLIENT_MESSAGE_LIMIT for e in events)
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert reply.thread.recording_status == agent_pb2.RECORDING_STATUS_ACTIVE
    rollout = await closed_state(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.error.message == final.error.message
    assert call.response_id.startswith("rrr")
    assert "clipped from" in call.response_id
    # The raw events are kept whole, in payloads.
    found = bundle_records(thread)
    sizes = [
        len(r.payload.data)
        for r in found
        if r.payload.kind == record_pb2.PAYLOAD_KIND_PROVIDER_EVENT
    ]
    assert sum(sizes) > 2 * HUGE


async def test_sse_blocks_without_data_are_ignored(
    provider: ScriptedProvider, agent: Harness
) -> None:
    provider.queue(
        "retry: 1000\n\n"
        + "id: 7\n\n"
        + ": a comment\n\n"
        + "event: ping\n\n"
        + "event: ping\ndata:\n\n"
        + answer("still fine")
    )
    final, _, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert accepted_texts(await closed_state(agent, thread)) == {"msg-1": "still fine"}


async def test_deeply_nested_json_is_a_malformed_event(
    provider: ScriptedProvider, agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    deep = "[" * 5000 + "]" * 5000
    provider.queue(sse(created()) + f'data: {{"type":"response.weird","x":{deep}}}\n\n')
    with caplog.at_level(logging.WARNING):
        final, _, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "malformed_event"
    assert "Traceback" not in caplog.text
    assert "internal" not in final.error.message
    rollout = await closed_state(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.error.code == "malformed_event"


async def test_an_input_just_over_the_grpc_default_limit_gets_the_service_s_answer(
    agent: Harness,
) -> None:
    thread = await agent.start_thread()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.start_turn(thread.id, "z" * (4 * 1024 * 1024 + 1))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(raised.value) == "INPUT_TOO_LARGE"


async def test_items_sharing_one_provider_id_get_distinct_ids(
    provider: ScriptedProvider, agent: Harness
) -> None:
    first, second = message("first", "dup"), message("second", "dup")
    provider.queue(
        sse(
            created(),
            {**item_added(first), "output_index": 0},
            {**item_added(second), "output_index": 1},
            {**text_delta("first", "dup"), "output_index": 0},
            {**text_delta("second", "dup"), "output_index": 1},
            {**item_done(first), "output_index": 0},
            {**item_done(second), "output_index": 1},
            completed(),
        )
    )
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    started = [e.item_started.item.id for e in events if e.HasField("item_started")]
    assert len(set(started)) == 2
    done = {i.id: i.text for i in completed_items(events)}
    assert set(done) == set(started)
    assert sorted(done.values()) == ["first", "second"]
    assert {streamed(events, item_id) for item_id in started} == {"first", "second"}
    rollout = await closed_state(agent, thread)
    assert accepted_texts(rollout) == done


async def test_refusals_are_streamed_and_reduced_as_refusals(
    provider: ScriptedProvider, agent: Harness
) -> None:
    item = {
        "type": "message",
        "id": "msg-no",
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": "I can't help with that."}],
    }
    provider.queue(
        sse(
            created(),
            item_added(message("", "msg-no")),
            {"type": "response.refusal.delta", "item_id": "msg-no", "delta": "I can't "},
            {"type": "response.refusal.delta", "item_id": "msg-no", "delta": "help with that."},
            {
                "type": "response.refusal.done",
                "item_id": "msg-no",
                "refusal": "I can't help with that.",
            },
            item_done(item),
            completed(),
        )
    )
    final, events, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    deltas = [e.agent_message_delta for e in events if e.HasField("agent_message_delta")]
    assert deltas
    assert all(d.refusal for d in deltas)
    assert "".join(d.delta for d in deltas) == "I can't help with that."
    [done] = completed_items(events)
    assert (done.text, done.refusal) == ("", "I can't help with that.")
    rollout = await closed_state(agent, thread)
    [accepted] = [i for i in rollout.conversation_items.values() if i.responses_item_id == "msg-no"]
    assert [(p.type, p.text) for p in accepted.content] == [("refusal", "I can't help with that.")]


async def test_events_after_an_error_event_are_recorded(
    provider: ScriptedProvider, agent: Harness
) -> None:
    failed = {
        "type": "response.failed",
        "response": {"id": "resp-1", "error": {"code": "server_error", "message": "later"}},
    }
    provider.queue(
        sse(created(), {"type": "error", "code": "overloaded", "message": "first"}, failed)
    )
    final, _, thread = await one_turn(agent)
    assert (final.error.code, final.error.message) == ("overloaded", "first")
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    kinds = [
        r.provider_event.event_type for r in bundle_records(thread) if r.HasField("provider_event")
    ]
    assert kinds == ["error", "response.failed"]


async def test_credentials_in_the_provider_url_are_never_recorded(
    provider: ScriptedProvider, start_agent: StartAgent, caplog: pytest.LogCaptureFixture
) -> None:
    url = provider.url.replace("http://", "http://alice:s3cret-pw@") + "/?api-key=s3cret-q"
    agent = await start_agent(provider_url=url)
    provider.queue(answer("hi"))
    with caplog.at_level(logging.DEBUG):
        final, _, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    rollout = await closed_state(agent, thread)
    [call] = rollout.inference_calls.values()
    assert "alice" not in call.provider_base_url
    assert "s3cret" not in call.provider_base_url
    assert call.provider_base_url.startswith("http://127.0.0.1:")
    for data in await asyncio.to_thread(_bundle_files, Path(thread.bundle_path)):
        assert b"s3cret" not in data
    assert "s3cret" not in caplog.text


async def test_a_key_that_cannot_be_a_header_never_shows_in_errors(
    provider: ScriptedProvider,
) -> None:
    key = "sk-SECRET-with-newline\n"
    client = ProviderClient(provider.url, Secret(key), idle_timeout=5)
    try:
        with pytest.raises(ProviderError) as raised:
            async for _ in client.stream("call", {"model": "m", "input": []}):
                pass
    finally:
        await client.aclose()
    assert "SECRET" not in raised.value.message
    assert raised.value.code == "request_not_sent"


def _delta_of(turn_id: str) -> Callable[[agent_pb2.ThreadEvent], bool]:
    return lambda event: event.HasField("agent_message_delta") and event.turn_id == turn_id


def _bundle_files(bundle: Path) -> list[bytes]:
    return [path.read_bytes() for path in bundle.iterdir()]


def _sockets_to(port: int) -> int:
    """Sockets this process holds whose remote end is 127.0.0.1:port (the client side)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == port and fields[9] in inodes:
            count += 1
    return count


async def test_provider_sockets_are_closed_after_every_turn(
    provider: ScriptedProvider, agent: Harness
) -> None:
    # Whatever ended a turn, its connection to the provider is either reused or closed: the
    # sockets do not pile up (one kept alive between turns at most).
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    provider.queue(answer("warm up"))
    turn = await agent.start_turn(thread.id, "warm up")
    await events.turn_completed(turn.id)
    port = int(provider.url.rsplit(":", 1)[1])
    gates = []
    for number in range(200):
        kind = number % 4
        if kind == 0:
            gate = asyncio.Event()
            gates.append(gate)
            provider.queue(
                sse(created(), item_added(message("", "msg-i")), text_delta("par", "msg-i")), gate
            )
        elif kind == 1:
            provider.queue(sse(created(), {"type": "error", "code": "boom", "message": "no"}))
        elif kind == 2:
            provider.queue(sse(created()) + "data: {broken\n\n")
        else:
            provider.queue(answer(f"answer {number}"))
        turn = await agent.start_turn(thread.id, f"turn {number}")
        if kind == 0:
            await events.wait_for(_delta_of(turn.id))
            await agent.stub.Interrupt(
                agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id)
            )
        await events.turn_completed(turn.id)
    assert _sockets_to(port) <= 1
    for gate in gates:
        gate.set()


async def test_closed_threads_are_forgotten_after_their_retention(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(closed_thread_retention=0.0)
    provider.queue(answer("one"))
    final, _, thread = await one_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await agent.stub.ListThreads(agent_pb2.ListThreadsRequest())
    assert [t.id for t in listed.threads] == []


async def test_only_so_many_closed_threads_are_kept(start_agent: StartAgent) -> None:
    agent = await start_agent(max_closed_threads=2)
    ids = []
    for _ in range(4):
        thread = await agent.start_thread()
        await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        ids.append(thread.id)
    listed = await agent.stub.ListThreads(agent_pb2.ListThreadsRequest())
    assert [t.id for t in listed.threads] == ids[2:]
    assert all(
        t.status == agent_pb2.THREAD_STATUS_CLOSED and t.HasField("closed_at")
        for t in listed.threads
    )


async def test_list_threads_pages_and_filters(agent: Harness, provider: ScriptedProvider) -> None:
    ids = [(await agent.start_thread()).id for _ in range(5)]
    provider.queue(answer("one"))
    events = agent.events(ids[0])
    turn = await agent.start_turn(ids[0], "hi")
    await events.turn_completed(turn.id)
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=ids[1]))
    seen: list[agent_pb2.Thread] = []
    token = ""
    pages = 0
    while True:
        page = await agent.stub.ListThreads(
            agent_pb2.ListThreadsRequest(page_size=2, page_token=token)
        )
        seen.extend(page.threads)
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert pages == 3
    assert [t.id for t in seen] == ids
    assert [t.turn_count for t in seen] == [1, 0, 0, 0, 0]
    assert all(not t.turns for t in seen)
    active = await agent.stub.ListThreads(
        agent_pb2.ListThreadsRequest(status=agent_pb2.THREAD_STATUS_ACTIVE)
    )
    assert [t.id for t in active.threads] == [ids[0], *ids[2:]]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.stub.ListThreads(agent_pb2.ListThreadsRequest(page_token="not-a-token"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(raised.value) == "INVALID_PAGE_TOKEN"


async def test_a_burst_reaches_a_reading_subscriber_while_a_stalled_one_falls_behind(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    # Each item is two events (started, completed) that no merging can shrink: a burst of
    # 3,000 events into a buffer of 1,000, twice.
    agent = await start_agent(event_buffer=1000)

    def burst(prefix: str) -> str:
        items = [message(f"{prefix}{n}", f"{prefix}{n}") for n in range(1500)]
        return sse(
            created(),
            *(event for item in items for event in (item_added(item), item_done(item))),
            completed(),
        )

    provider.queue(answer("warm up"))
    provider.queue(burst("a"))
    provider.queue(burst("b"))
    thread = await agent.start_thread()
    # A second client on its own connection, which reads one event and then nothing; without
    # window growth its connection soon holds as much as it will take unread.
    other = grpc.aio.insecure_channel(
        agent.server.address,
        options=[("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)],
    )
    try:
        stalled = agent_pb2_grpc.AgentServiceStub(other).StreamEvents(
            agent_pb2.StreamEventsRequest(thread_id=thread.id)
        )
        fast = agent.events(thread.id)
        # A first small turn: once both have an event of it, both are attached.
        warm_up = await agent.start_turn(thread.id, "warm up")
        await stalled.read()
        await fast.turn_completed(warm_up.id)
        for text in ("one", "two"):
            turn = await agent.start_turn(thread.id, text)
            done = await fast.turn_completed(turn.id)
            assert done.status == agent_pb2.TURN_STATUS_COMPLETED
        indexes = [e.index for e in fast.events]
        assert indexes == list(range(1, len(indexes) + 1))
        assert len(completed_items(fast.events)) == 3001
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _read_to_the_end(stalled)
        assert raised.value.code() == grpc.StatusCode.OUT_OF_RANGE
    finally:
        await other.close(None)


async def _read_to_the_end(call: grpc.aio.UnaryStreamCall[Any, Any]) -> None:
    while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
        pass


async def test_hostile_payload_texts_in_requests_round_trip(
    provider: ScriptedProvider, agent: Harness
) -> None:
    """The next request carries the cleaned item, and the trace rebuilds that request."""
    raw_item = (
        '{"type":"message","id":"msg-s","role":"assistant",'
        '"content":[{"type":"output_text","text":"\\udfff"}]}'
    )
    provider.queue(
        sse(created())
        + f'data: {{"type":"response.output_item.done","item":{raw_item}}}\n\n'
        + sse(completed())
    )
    provider.queue(answer("two"))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    for text in ("one", "two"):
        turn = await agent.start_turn(thread.id, text)
        await events.turn_completed(turn.id)
    sent = json.loads(provider.requests[1].body)
    assert sent["input"][1]["content"][0]["text"] == "\ufffd"
