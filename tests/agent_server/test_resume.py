"""Continuing threads from what was recorded: ForkThread from a closed thread and from one the
server no longer holds, ResumeThread, ListThreads over the trace root — across restarts of a
real `agent-server serve`, then reduced: the chain is in the state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import record_pb2
from tests.agent_server.conftest import (
    EventLog,
    Harness,
    StartAgent,
    error_reason,
    reduce_with_cli,
    serve,
)
from tests.trace_reducer.bundles import COMPLETED, BundleBuilder
from trace_reducer import BundleWriter, encode_record, request_body

WEATHER = agent_pb2.FunctionTool(
    name="weather",
    description="The weather in a city.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)


async def run_turn(
    stub: agent_pb2_grpc.AgentServiceAsyncStub, thread_id: str, text: str
) -> agent_pb2.Turn:
    events = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id)))
    reply = await stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
    )
    turn = await events.turn_completed(reply.turn.id)
    await events.close()
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn
    return turn


def user_texts(rollout_items: list[dict[str, object]]) -> list[str]:
    texts = []
    for item in rollout_items:
        if item.get("role") == "user":
            content = item["content"]
            assert isinstance(content, list)
            texts.append(content[0]["text"])
    return texts


async def test_fork_and_resume_from_disk_across_restarts_then_reduce(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    server_args = ("--trace-root", str(traces), "--local-word-delay", "0")

    # Run 1: a thread with a tool and a temperature, two turns, closed, then the server stops.
    async with serve(*server_args) as served, grpc.aio.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        original = (
            await stub.StartThread(
                agent_pb2.StartThreadRequest(
                    instructions="Be brief.",
                    tools=[WEATHER],
                    temperature=0.5,
                    metadata={"task": "q-17"},
                )
            )
        ).thread
        first = await run_turn(stub, original.id, "first question")
        second = await run_turn(stub, original.id, "second question")
        # Closed but still held: forking it reads its bundle (the history left memory).
        await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=original.id))
        [early] = (
            await stub.ForkThread(
                agent_pb2.ForkThreadRequest(
                    thread_id=original.id, after_turn_id=first.id, count=1, group_id="g"
                )
            )
        ).threads
        await run_turn(stub, early.id, "another second question")
        await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=early.id))

    # Run 2: a fresh server holds nothing; the original is found under the trace root.
    async with serve(*server_args) as served, grpc.aio.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        listed = await stub.ListThreads(agent_pb2.ListThreadsRequest(include_recorded=True))
        by_id = {t.id: t for t in listed.threads}
        assert set(by_id) == {original.id, early.id}
        assert by_id[original.id].recorded
        assert by_id[original.id].status == agent_pb2.THREAD_STATUS_CLOSED
        assert by_id[original.id].metadata["task"] == "q-17"
        assert by_id[early.id].fork.parent_thread_id == original.id
        assert not (await stub.ListThreads(agent_pb2.ListThreadsRequest())).threads

        forks = (
            await stub.ForkThread(
                agent_pb2.ForkThreadRequest(
                    thread_id=original.id, after_turn_id=first.id, count=2, group_id="retry"
                )
            )
        ).threads
        assert [f.fork.repetition_index for f in forks] == [0, 1]
        # The thread's tools and sampling come back from its recorded requests.
        assert [t.name for t in forks[0].tools] == ["weather"]
        assert forks[0].temperature == 0.5
        assert forks[0].metadata["task"] == "q-17"
        for thread in forks:
            await run_turn(stub, thread.id, "retried second question")
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

        resumed = (
            await stub.ResumeThread(agent_pb2.ResumeThreadRequest(thread_id=original.id))
        ).thread
        assert resumed.fork.resumed
        assert resumed.fork.parent_thread_id == original.id
        assert resumed.fork.after_turn_id == second.id
        await run_turn(stub, resumed.id, "third question")
        await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=resumed.id))

    # Run 3: resume the resumed thread by its bundle path.
    async with serve(*server_args) as served, grpc.aio.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        again = (
            await stub.ResumeThread(
                agent_pb2.ResumeThreadRequest(bundle_path=Path(resumed.bundle_path).name)
            )
        ).thread
        await run_turn(stub, again.id, "fourth question")
        await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=again.id))
        paged: list[str] = []
        token = ""
        while True:
            page = await stub.ListThreads(
                agent_pb2.ListThreadsRequest(include_recorded=True, page_size=2, page_token=token)
            )
            assert len(page.threads) <= 2
            paged.extend(t.id for t in page.threads)
            token = page.next_page_token
            if not token:
                break
        # The one in memory first, then the recorded ones by bundle, each once.
        assert paged[0] == again.id
        assert sorted(paged) == sorted(
            {original.id, early.id, resumed.id, again.id, *(f.id for f in forks)}
        )

    # Reduced: each bundle holds only what it added, and its state names the whole chain.
    last = await reduce_with_cli(Path(again.bundle_path))
    assert last.recording_complete
    assert last.fork.resumed
    assert last.fork.resolved
    assert last.fork.parent_thread_id == resumed.id
    chain = [(link.thread_id, link.parent_thread_id, link.resumed) for link in last.fork.ancestors]
    assert chain == [(resumed.id, original.id, True), (original.id, "", False)]
    [call] = [c for c in last.inference_calls.values() if c.thread_id == again.id]
    body = json.loads(request_body(again.bundle_path, call.inference_call_id))
    assert user_texts(body["input"]) == [
        "first question",
        "second question",
        "third question",
        "fourth question",
    ]
    assert body["instructions"] == "Be brief."
    assert body["tools"][0]["name"] == "weather"
    assert body["temperature"] == 0.5
    data = (Path(again.bundle_path) / "trace.binpb").read_bytes()
    assert b"first question" not in data
    assert b"third question" not in data

    for thread in forks:
        state = await reduce_with_cli(Path(thread.bundle_path))
        assert state.fork.group_id == "retry"
        assert not state.fork.resumed
        assert state.fork.after_turn_id == first.id
        [call] = [c for c in state.inference_calls.values() if c.thread_id == thread.id]
        body = json.loads(request_body(thread.bundle_path, call.inference_call_id))
        assert user_texts(body["input"]) == ["first question", "retried second question"]
    early_state = await reduce_with_cli(Path(early.bundle_path))
    assert early_state.fork.resolved
    assert early_state.fork.after_turn_id == first.id


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def test_a_recorded_header_past_year_9999_is_left_out_of_the_listing(
    local: Harness,
) -> None:
    assert local.trace_root is not None
    closed = await local.start_thread()
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=closed.id))
    # A bundle whose header's created_at no Timestamp can hold (year 33658).
    writer = BundleWriter.create(local.trace_root, "thread_far_future")
    writer.abandon()
    header = record_pb2.Header(format_version=1, trace_id="t", thread_id="thread_far_future")
    header.created_at.seconds = 1_000_000_000_000
    started = record_pb2.ThreadStarted(thread=1, thread_id="thread_far_future", model="m")
    writer.file_path.write_bytes(
        encode_record(record_pb2.TraceRecord(seq=1, header=header))
        + encode_record(record_pb2.TraceRecord(seq=2, thread_started=started))
    )
    # Was: INTERNAL (a ValueError from the header's time) for every listing of the root.
    listed = await local.stub.ListThreads(agent_pb2.ListThreadsRequest(include_recorded=True))
    assert {t.id for t in listed.threads} == {closed.id}
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await local.stub.ResumeThread(agent_pb2.ResumeThreadRequest(thread_id="thread_far_future"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_continuing_from_disk_refuses_what_it_cannot_read(
    local: Harness, start_agent: StartAgent, tmp_path: Path
) -> None:
    assert local.trace_root is not None
    open_thread = await local.start_thread()
    await run_turn(local.stub, open_thread.id, "hello")
    closed = await local.start_thread()
    await run_turn(local.stub, closed.id, "hello")
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=closed.id))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (local.trace_root / "20260101T000000Z-thread_link").symlink_to(
        Path(closed.bundle_path), target_is_directory=True
    )
    garbage = local.trace_root / "20260101T000000Z-thread_garbage"
    garbage.mkdir()
    (garbage / "trace.binpb").write_bytes(os.urandom(64))
    cases = [
        (agent_pb2.ResumeThreadRequest(thread_id=open_thread.id), "THREAD_ACTIVE"),
        (agent_pb2.ResumeThreadRequest(), "MISSING_THREAD_ID"),
        (agent_pb2.ResumeThreadRequest(thread_id="thread_nope"), "THREAD_NOT_FOUND"),
        (agent_pb2.ResumeThreadRequest(thread_id="../../etc"), "THREAD_NOT_FOUND"),
        (
            agent_pb2.ResumeThreadRequest(thread_id=closed.id, after_turn_id="turn_x"),
            "TURN_NOT_FOUND",
        ),
        (agent_pb2.ResumeThreadRequest(bundle_path=str(outside)), "BUNDLE_PATH_DENIED"),
        (agent_pb2.ResumeThreadRequest(bundle_path="../elsewhere"), "BUNDLE_PATH_DENIED"),
        (
            agent_pb2.ResumeThreadRequest(bundle_path="20260101T000000Z-thread_link"),
            "BUNDLE_PATH_DENIED",
        ),
        (
            agent_pb2.ResumeThreadRequest(bundle_path=garbage.name),
            "RECORDED_THREAD_UNREADABLE",
        ),
        (agent_pb2.ResumeThreadRequest(bundle_path="nope"), "THREAD_NOT_FOUND"),
        (agent_pb2.ResumeThreadRequest(bundle_path="a\0b"), "INVALID_BUNDLE_PATH"),
    ]
    for request, reason in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await local.stub.ResumeThread(request)
        assert error_reason(refused.value) == reason, request
        assert refused.value.code() != grpc.StatusCode.UNKNOWN
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await local.stub.ForkThread(
            agent_pb2.ForkThreadRequest(count=1, bundle_path="20260101T000000Z-thread_link")
        )
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The closed thread still continues, and listing skips what is no bundle.
    resumed = (
        await local.stub.ResumeThread(agent_pb2.ResumeThreadRequest(thread_id=closed.id))
    ).thread
    assert resumed.fork.resumed
    fresh = await start_agent(provider_url=None, local_word_delay=0.0)
    listed = await fresh.stub.ListThreads(agent_pb2.ListThreadsRequest(include_recorded=True))
    assert {t.id for t in listed.threads} == {open_thread.id, closed.id, resumed.id}
    active = await fresh.stub.ListThreads(
        agent_pb2.ListThreadsRequest(include_recorded=True, status=agent_pb2.THREAD_STATUS_ACTIVE)
    )
    assert not active.threads
    # Without a trace root nothing is recorded, so nothing closed can be continued.
    unrecorded = await start_agent(provider_url=None, local_word_delay=0.0, trace_root=None)
    gone = await unrecorded.start_thread()
    await unrecorded.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=gone.id))
    with pytest.raises(grpc.aio.AioRpcError) as off:
        await unrecorded.stub.ResumeThread(agent_pb2.ResumeThreadRequest(thread_id=gone.id))
    assert error_reason(off.value) == "RECORDING_OFF"


async def test_a_recorded_item_nested_past_what_json_reads_is_unreadable_not_internal(
    local: Harness,
) -> None:
    # Was: RecursionError out of the history's read, an INTERNAL answer.
    assert local.trace_root is not None
    builder = BundleBuilder(local.trace_root, "thread_deep")
    nested = b"[" * 100_000 + b"]" * 100_000
    deep = b'{"content":' + nested + b',"role":"user","type":"message"}'
    pid = builder.writer.put_payload(deep, record_pb2.PAYLOAD_KIND_INPUT_ITEM)
    builder.append(
        turn_started=record_pb2.TurnStarted(
            turn=1, thread=builder.thread, turn_id="turn-1", input_payload_ids=[pid]
        )
    )
    builder.turn_ended(1, COMPLETED)
    builder.thread_ended()
    bundle = builder.close()
    for request in (
        agent_pb2.ResumeThreadRequest(bundle_path=bundle.name),
        agent_pb2.ForkThreadRequest(count=1, bundle_path=bundle.name),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await getattr(local.stub, type(request).__name__.removesuffix("Request"))(request)
        assert error_reason(refused.value) == "RECORDED_THREAD_UNREADABLE", refused.value
        assert "cannot be read: JSON nested too deep" in (refused.value.details() or "")
