"""What the agent writes into a bundle: order, reconstructible requests, failures, shutdown."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import multiprocessing
import multiprocessing.queues
import os
import threading
from pathlib import Path

import pytest

from agent_server.recorder import Recorder, _disk
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    created,
    item_added,
    message,
    sse,
    text_delta,
)
from trace_reducer import RecordingError, read_bundle, request_body

CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED


def records(
    bundle: Path,
) -> tuple[list[record_pb2.TraceRecord], state_pb2.IntegrityStatus.ValueType]:
    with read_bundle(bundle) as reader:
        found = list(reader)
        return found, reader.integrity.status


def bodies(found: list[record_pb2.TraceRecord]) -> list[str]:
    return [str(r.WhichOneof("body")) for r in found]


def payloads(found: list[record_pb2.TraceRecord]) -> dict[str, bytes]:
    return {r.payload.payload_id: r.payload.data for r in found if r.HasField("payload")}


async def test_requests_are_reconstructible_and_history_is_recorded_once(
    provider: ScriptedProvider, agent: Harness
) -> None:
    provider.queue(answer("first answer", "msg-a"))
    provider.queue(answer("second answer", "msg-b"))
    thread = await agent.start_thread(instructions="be brief", metadata={"run": "7"})
    events = agent.events(thread.id)
    for text in ("one", "two"):
        turn = await agent.start_turn(thread.id, text)
        await events.turn_completed(turn.id)
    await agent.server.stop()

    found, integrity = records(Path(thread.bundle_path))
    assert integrity == state_pb2.INTEGRITY_STATUS_CLEAN
    data = payloads(found)
    started = [r.inference_started for r in found if r.HasField("inference_started")]
    assert len(started) == 2
    for call, request in zip(started, provider.requests, strict=True):
        assert request_body(thread.bundle_path, call.inference_call_id) == request.body
        assert "input" not in json.loads(data[call.request_envelope_payload_id])
        assert call.provider_base_url == provider.url
    # Each distinct item is one payload record, however often it is sent, and the second
    # request refers to the first one's input instead of listing it again.
    ids = [r.payload.payload_id for r in found if r.HasField("payload")]
    assert len(ids) == len(set(ids))
    first_input = json.loads(provider.requests[0].body)["input"]
    second_input = json.loads(provider.requests[1].body)["input"]
    assert second_input[: len(first_input)] == first_input
    assert started[0].input_prefix_count == 0
    assert started[1].input_prefix_count == len(first_input)
    assert len(started[1].input_payload_ids) == len(second_input) - len(first_input)
    [thread_started] = [r.thread_started for r in found if r.HasField("thread_started")]
    assert data[thread_started.instructions_payload_id] == b"be brief"
    assert dict(thread_started.metadata) == {"run": "7"}
    assert bodies(found)[0] == "header"
    assert bodies(found)[-2:] == ["thread_ended", "footer"]


async def test_provider_events_are_recorded_before_clients_hear_of_them(
    provider: ScriptedProvider, agent: Harness
) -> None:
    provider.queue(
        sse(created(), item_added(message("", "msg-1")), text_delta("seen by the client")),
        asyncio.Event(),
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hi")
    await events.wait_for(lambda e: e.HasField("agent_message_delta"))
    found, integrity = records(Path(thread.bundle_path))
    assert integrity == state_pb2.INTEGRITY_STATUS_UNCLOSED
    deltas = [r.output_text_delta.delta for r in found if r.HasField("output_text_delta")]
    assert deltas == ["seen by the client"]

    await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
    found, _ = records(Path(thread.bundle_path))
    tail = bodies(found)[-3:]
    # The request comes first, then the call it cancelled (was: after the call's end).
    assert tail == ["interrupt_requested", "inference_ended", "turn_ended"]
    ended = found[-2].inference_ended
    assert (ended.status, ended.reason) == (CANCELLED, "interrupted")
    assert found[-1].turn_ended.status == CANCELLED


async def test_shutdown_interrupts_running_turns_and_closes_every_bundle(
    provider: ScriptedProvider, agent: Harness
) -> None:
    provider.queue(sse(created(), item_added(message("", "msg-1"))), asyncio.Event())
    busy = await agent.start_thread()
    idle = await agent.start_thread()
    events = agent.events(busy.id)
    turn = await agent.start_turn(busy.id, "hold on")
    await events.wait_for(lambda e: e.HasField("item_started"))
    await agent.server.stop()
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_INTERRUPTED
    await events.until_end()

    assert len(agent.bundles()) == 2
    busy_state = await reduce_with_cli(Path(busy.bundle_path))
    assert busy_state.recording_complete
    assert busy_state.turns[turn.id].execution.status == CANCELLED
    assert busy_state.turns[turn.id].interrupt.requested_by == "shutdown"
    [call] = busy_state.inference_calls.values()
    assert call.execution.status == CANCELLED
    idle_state = await reduce_with_cli(Path(idle.bundle_path))
    assert idle_state.recording_complete
    assert idle_state.threads[idle.id].execution.status == CANCELLED


async def test_recording_off(provider: ScriptedProvider, start_agent: StartAgent) -> None:
    agent = await start_agent(trace_root=None)
    provider.queue(answer("unrecorded"))
    thread = await agent.start_thread()
    assert (thread.bundle_path, thread.recording_status) == ("", agent_pb2.RECORDING_STATUS_OFF)
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hi")
    assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED


def _redirect_to_dev_full(trace_file: Path) -> None:
    """Make the open bundle's descriptor answer ENOSPC, as a full disk does."""
    target = os.path.realpath(trace_file)
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                full = os.open("/dev/full", os.O_WRONLY)
                os.dup2(full, int(fd))
                os.close(full)
                return
        except OSError:
            continue
    raise AssertionError(f"no open descriptor for {target}")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_disk_full_after_start_keeps_the_thread_serving(
    provider: ScriptedProvider, agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    provider.queue(answer("still served"))
    provider.queue(answer("served again"))
    thread = await agent.start_thread()
    _redirect_to_dev_full(Path(thread.bundle_path) / "trace.binpb")
    events = agent.events(thread.id)
    with caplog.at_level(logging.WARNING):
        for text in ("one", "two"):
            turn = await agent.start_turn(thread.id, text)
            assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert reply.thread.recording_status == agent_pb2.RECORDING_STATUS_FAILED
    assert "No space left on device" in reply.thread.recording_error
    warnings = [r for r in caplog.records if "recording of thread" in r.getMessage()]
    assert len(warnings) == 1
    closed = await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    assert closed.thread.recording_status == agent_pb2.RECORDING_STATUS_FAILED

    # What was recorded before the failure stays readable.
    found, integrity = records(Path(thread.bundle_path))
    assert integrity == state_pb2.INTEGRITY_STATUS_UNCLOSED
    assert bodies(found) == ["header", "thread_started"]
    rollout = await reduce_with_cli(Path(thread.bundle_path))
    assert not rollout.recording_complete
    assert list(rollout.threads) == [thread.id]


async def test_removed_bundle_file_is_noticed_and_the_thread_keeps_serving(
    provider: ScriptedProvider, agent: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    provider.queue(answer("first"))
    provider.queue(answer("second"))
    thread = await agent.start_thread()
    (Path(thread.bundle_path) / "trace.binpb").unlink()
    events = agent.events(thread.id)
    with caplog.at_level(logging.WARNING):
        for text in ("one", "two"):
            turn = await agent.start_turn(thread.id, text)
            assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert reply.thread.recording_status == agent_pb2.RECORDING_STATUS_FAILED
    assert "removed" in reply.thread.recording_error
    assert len([r for r in caplog.records if "recording of thread" in r.getMessage()]) == 1


async def test_deltas_that_arrive_together_are_one_record_and_one_event(
    provider: ScriptedProvider, agent: Harness
) -> None:
    item = message("one two three", "msg-1")
    provider.queue(
        # One write: the three deltas reach the agent in the same read.
        sse(
            created(),
            item_added(item),
            text_delta("one", "msg-1"),
            text_delta(" two", "msg-1"),
            text_delta(" three", "msg-1"),
        ),
        asyncio.Event(),
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "count")
    await events.wait_for(lambda e: e.HasField("agent_message_delta"))
    await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
    deltas = [e.agent_message_delta.delta for e in events.of_kind("agent_message_delta")]
    assert deltas == ["one two three"]
    found, _ = records(Path(thread.bundle_path))
    assert [r.output_text_delta.delta for r in found if r.HasField("output_text_delta")] == [
        "one two three"
    ]


async def test_a_thread_that_cannot_be_recorded_leaves_no_bundle(tmp_path: Path) -> None:
    # thread_started cannot be written (its metadata exceeds a record): the bundle created
    # for it goes too, as no thread exists.
    with pytest.raises(RecordingError):
        await Recorder.start(
            tmp_path, "thread-1", model="m", instructions="", metadata={"k": "v" * (5 << 20)}
        )
    assert os.listdir(tmp_path) == []


async def test_recording_s_disk_calls_do_not_queue_behind_the_default_executor(
    tmp_path: Path,
) -> None:
    # Every thread of the loop's default executor busy (DNS lookups waiting on a slow
    # resolver, say): a bundle is still created, synced and closed.
    loop = asyncio.get_running_loop()
    release = threading.Event()
    workers = min(32, (os.cpu_count() or 1) + 4)
    blocked = [loop.run_in_executor(None, release.wait) for _ in range(workers)]
    try:
        async with asyncio.timeout(10):
            recorder = await Recorder.start(
                tmp_path, "thread-1", model="m", instructions="", metadata={}
            )
            await recorder.sync()
            await recorder.finish(common_pb2.EXECUTION_STATUS_COMPLETED, "")
    finally:
        release.set()
        await asyncio.gather(*blocked)
    found, integrity = records(Path(recorder.bundle_path))
    assert integrity == state_pb2.INTEGRITY_STATUS_CLEAN
    assert bodies(found) == ["header", "thread_started", "thread_ended", "footer"]


async def test_a_disk_call_s_failure_and_a_cancelled_wait_leave_the_threads_serving() -> None:
    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        await _disk.run(fail)
    started = threading.Event()
    release = threading.Event()

    def slow() -> str:
        started.set()
        release.wait()
        return "done"

    waiting = asyncio.ensure_future(_disk.run(slow))
    await asyncio.to_thread(started.wait)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    # The call it waited for ran to its end; every thread still takes calls, at once.
    results = await asyncio.gather(*(_disk.run(functools.partial(pow, n, 2)) for n in range(40)))
    assert results == [n * n for n in range(40)]


def _disk_call_in_a_forked_child(results: multiprocessing.queues.Queue[int]) -> None:
    async def call() -> int:
        return await _disk.run(functools.partial(pow, 3, 4))

    results.put(asyncio.run(call()))


async def test_a_forked_child_starts_disk_threads_of_its_own() -> None:
    # Every thread the parent may start is running (none of them exists in a child forked
    # from it): the child's calls must not wait for them.
    squares = await asyncio.gather(*(_disk.run(functools.partial(pow, n, 2)) for n in range(64)))
    assert squares == [n * n for n in range(64)]
    context = multiprocessing.get_context("fork")
    results: multiprocessing.queues.Queue[int] = context.Queue()
    child = context.Process(target=_disk_call_in_a_forked_child, args=(results,))
    child.start()
    try:
        assert await asyncio.to_thread(results.get, timeout=30) == 81
    finally:
        await asyncio.to_thread(child.join, 30)
    assert child.exitcode == 0
