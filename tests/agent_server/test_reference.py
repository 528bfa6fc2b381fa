"""The three reference scenarios (shared/reference), against a real server and provider."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, error_reason, reduce_with_cli
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    completed,
    created,
    failed,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED


def inference_producer(call_id: str) -> list[state_pb2.ProducerRef]:
    return [state_pb2.ProducerRef(inference=state_pb2.InferenceProducer(inference_call_id=call_id))]


async def test_enabled_recording_cannot_silently_fail_to_start(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    trace_root = tmp_path / "traces"
    trace_root.write_text("file")
    agent = await start_agent(trace_root=trace_root)

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await agent.start_thread()
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (raised.value.details() or "").startswith("failed to start rollout recording: ")
    assert error_reason(raised.value) == "RECORDING_START_FAILED"
    assert agent.server.agent.thread_ids() == []

    # The same server records the next thread once the storage is usable.
    trace_root.unlink()
    trace_root.mkdir()
    thread = await agent.start_thread()
    assert thread.recording_status == agent_pb2.RECORDING_STATUS_ACTIVE
    await agent.server.stop()

    bundles = agent.bundles()
    assert len(bundles) == 1
    assert Path(thread.bundle_path) == bundles[0]
    rollout = await reduce_with_cli(bundles[0])
    assert rollout.recording_complete
    assert list(rollout.threads) == [thread.id]


@pytest.mark.parametrize(
    ("source_id", "terminal", "status"),
    [
        ("msg-original", "response.completed", COMPLETED),
        (None, "response.completed", COMPLETED),
        ("msg-original", "response.failed", FAILED),
        (None, "response.failed", FAILED),
    ],
)
async def test_accepted_output_survives_success_and_stream_failure(
    provider: ScriptedProvider,
    agent: Harness,
    source_id: str | None,
    terminal: str,
    status: common_pb2.ExecutionStatus.ValueType,
) -> None:
    item = message("accepted answer", source_id)
    provider.queue(
        sse(
            created("resp-1"),
            item_added(item),
            item_done(item),
            completed("resp-1") if terminal == "response.completed" else failed("resp-1"),
        )
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "answer once")
    assert turn.status == agent_pb2.TURN_STATUS_IN_PROGRESS

    done = await events.turn_completed(turn.id)
    expected_turn = (
        agent_pb2.TURN_STATUS_COMPLETED if status == COMPLETED else agent_pb2.TURN_STATUS_FAILED
    )
    assert done.status == expected_turn
    if status == FAILED:
        assert (done.error.code, done.error.message) == ("server_error", "stream failed")
    await agent.server.stop()

    [bundle] = agent.bundles()
    rollout = await reduce_with_cli(bundle)
    assert rollout.recording_complete
    [call] = rollout.inference_calls.values()
    output_id = call.response_item_ids[0]
    output = rollout.conversation_items[output_id]
    assert list(rollout.threads[thread.id].conversation_item_ids) == [
        *call.request_item_ids,
        output_id,
    ]
    assert rollout.turns[turn.id].execution.status == status
    assert call.execution.status == status
    assert list(output.produced_by) == inference_producer(call.inference_call_id)
    assert output.responses_item_id
    if source_id is not None:
        assert output.responses_item_id == source_id
    # Clients saw the very id the trace reports.
    [completed_event] = events.of_kind("item_completed")
    assert completed_event.item_completed.item.id == output.responses_item_id
    [request] = [r for r in provider.requests if r.path.endswith("/responses")]
    assert request.headers["x-rollout-inference-call-id"] == call.inference_call_id


async def test_accepted_output_survives_interruption_and_shutdown(
    provider: ScriptedProvider, agent: Harness
) -> None:
    release = asyncio.Event()
    finished = message("Keep this answer.", "accepted")
    provider.queue(
        sse(
            created("resp-1"),
            item_done(finished),
            item_added(message("", "unfinished")),
            text_delta("Discard this unfinished text"),
        ),
        # Keep the provider stream open so only the client's interrupt ends it.
        release,
    )
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "answer once")

    # Reaching the second item proves the first one was processed.
    delta = await events.wait_for(lambda e: e.HasField("agent_message_delta"))
    assert delta.agent_message_delta.item_id == "unfinished"
    interrupted = await agent.stub.Interrupt(
        agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id)
    )
    assert interrupted.turn.status == agent_pb2.TURN_STATUS_INTERRUPTED
    done = await events.turn_completed(turn.id)
    assert done.status == agent_pb2.TURN_STATUS_INTERRUPTED
    await agent.server.stop()
    release.set()

    [bundle] = agent.bundles()
    rollout = await reduce_with_cli(bundle)
    assert rollout.recording_complete
    assert len(rollout.inference_calls) == 1
    [call] = rollout.inference_calls.values()
    assert call.execution.status == CANCELLED
    assert rollout.turns[turn.id].execution.status == CANCELLED
    assert rollout.turns[turn.id].interrupt.requested_by.startswith(("ipv4:", "ipv6:"))
    assert len(call.response_item_ids) == 1
    output_id = call.response_item_ids[0]
    output = rollout.conversation_items[output_id]
    assert output.responses_item_id == "accepted"
    assert list(output.produced_by) == inference_producer(call.inference_call_id)
    assistant_items = [
        item_id
        for item_id in rollout.threads[thread.id].conversation_item_ids
        if rollout.conversation_items[item_id].role == state_pb2.CONVERSATION_ROLE_ASSISTANT
    ]
    assert assistant_items == [output_id]
    [discarded] = call.discarded_outputs
    assert discarded.provider_item_id == "unfinished"
    assert discarded.partial_text == "Discard this unfinished text"
