"""The benchmark's JSONL peer answers what the reducer answers, lazily or not."""

from __future__ import annotations

from datetime import UTC
from pathlib import Path

import pytest
from google.protobuf import timestamp_pb2

from bench.agent_shapes import AgentBundles, record_agent_bundles
from bench.jsonl_peer import reduce_codex_jsonl, write_codex_jsonl
from bench.reducer_bench import read_split_tag
from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import common_pb2, state_pb2
from trace_reducer import TRACE_FILE_NAME, BundleWriter, RecordBuilder, replay_bundle
from trace_reducer.bundle._tokens import sampling_settings


def test_requests_hold_what_was_sent_and_the_lazy_peer_agrees(tmp_path: Path) -> None:
    bundle = write_conversation(tmp_path / "b", Shape(turns=3, deltas_per_turn=4))
    jsonl = tmp_path / "b.jsonl"
    write_codex_jsonl(bundle, jsonl)
    eager = reduce_codex_jsonl(jsonl)
    assert reduce_codex_jsonl(jsonl, lazy=True) == eager
    trace = replay_bundle(bundle)
    for number, call in enumerate(eager["calls"].values(), start=1):
        # Call n saw n user items and n - 1 replies; its own reply is not in its request.
        assert len(call["request"]) == 2 * number - 1
        assert not set(call["request"]) & set(call["response"])
    assert sum(len(c["request"]) for c in eager["calls"].values()) == sum(
        len(c.request_item_ids) for c in trace.inference_calls.values()
    )
    # The tag floor finds every delta frame without parsing one.
    assert read_split_tag(bundle / TRACE_FILE_NAME) == 3 * 4


def test_the_lazy_peer_parses_the_deltas_of_an_item_that_never_completes(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path / "b", "t", producer_name="test")
    records = RecordBuilder(writer)
    thread = records.thread_started("t", model="m", instructions="", metadata={})
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    turn = records.turn_started(thread, "turn-1", [user])
    call = records.inference_started(
        turn,
        inference_call_id="call-1",
        attempt=1,
        model="m",
        provider_base_url="http://127.0.0.1:1/v1",
        envelope={"model": "m"},
        input_items=[user],
    )
    item = records.output_item_added(
        call, provider_item_id="msg-1", item_type="message", role="assistant"
    )
    for word in ("half ", "a ", "reply"):
        records.output_text_delta(call, item, word)
    records.inference_ended(call, common_pb2.EXECUTION_STATUS_FAILED, reason="stream broke")
    records.turn_ended(turn, common_pb2.EXECUTION_STATUS_FAILED)
    writer.close()
    jsonl = tmp_path / "b.jsonl"
    write_codex_jsonl(writer.bundle_dir, jsonl)
    lazy = reduce_codex_jsonl(jsonl, lazy=True)
    assert lazy == reduce_codex_jsonl(jsonl)
    assert lazy["calls"]["call-1"]["discarded"] == "half a reply"
    trace = replay_bundle(writer.bundle_dir)
    assert trace.inference_calls["call-1"].discarded_outputs[0].partial_text == "half a reply"


@pytest.fixture(scope="module")
def agent_bundles(tmp_path_factory: pytest.TempPathFactory) -> AgentBundles:
    """A thread of ordinary replies and one of tool rounds, recorded by the agent server."""
    return record_agent_bundles(tmp_path_factory.mktemp("shapes"), reply_turns=3, tool_turns=3)


def _ms(stamp: timestamp_pb2.Timestamp) -> str:
    """A state's time as the JSONL lines spell it (milliseconds, UTC offset)."""
    return stamp.ToDatetime(tzinfo=UTC).isoformat(timespec="milliseconds")


def _status(value: int) -> str:
    return common_pb2.ExecutionStatus.Name(value)  # type: ignore[arg-type]


def _producer(ref: state_pb2.ProducerRef) -> str:
    kind = ref.WhichOneof("producer")
    assert kind is not None
    body = getattr(ref, kind)
    return str(body.ListFields()[0][1])


@pytest.mark.parametrize("shape", ["replies", "tools"])
def test_the_peer_builds_the_reducers_answer_as_far_as_the_lines_carry_it(
    agent_bundles: AgentBundles, shape: str, tmp_path: Path
) -> None:
    """The peer is compared with the reducer on the same work: every context the state holds,
    with its fields, not a subset that would flatter it."""
    bundle = getattr(agent_bundles, shape)
    jsonl = tmp_path / "b.jsonl"
    write_codex_jsonl(bundle, jsonl)
    peer = reduce_codex_jsonl(jsonl, lazy=True)
    assert peer == reduce_codex_jsonl(jsonl)
    trace = replay_bundle(bundle)
    (thread,) = trace.threads.values()
    ours = peer["thread"]
    assert (ours["thread_id"], ours["model"]) == (thread.thread_id, thread.model)
    assert ours["status"] == _status(thread.execution.status)
    assert ours["started_at"] == _ms(thread.execution.started_at)
    assert ours["turns"] == list(thread.turn_ids)
    assert ours["items"] == list(thread.conversation_item_ids)
    for turn_id, turn in trace.turns.items():
        mine = peer["turns"][turn_id]
        assert mine["status"] == _status(turn.execution.status)
        assert (mine["started_at"], mine["ended_at"]) == (
            _ms(turn.execution.started_at),
            _ms(turn.execution.ended_at),
        )
        assert mine["inputs"] == list(turn.input_item_ids)
        assert mine["calls"] == list(turn.inference_call_ids)
        assert mine["tool_calls"] == list(turn.tool_call_ids)
    for call_id, call in trace.inference_calls.items():
        mine = peer["calls"][call_id]
        assert mine["request"] == list(call.request_item_ids)
        assert mine["response"] == list(call.response_item_ids)
        assert (mine["model"], mine["attempt"]) == (call.model, call.attempt)
        assert mine["provider_base_url"] == call.provider_base_url
        assert mine["response_id"] == call.response_id
        assert mine["status"] == _status(call.execution.status)
        assert mine["ended_at"] == _ms(call.execution.ended_at)
        assert mine["end_reason"] == call.end_reason
        assert mine["stop_reason"] == common_pb2.StopReason.Name(call.stop_reason)
        assert int(mine["usage"]["output_tokens"]) == call.usage.output_tokens
        assert sampling_settings(mine["sampling"]) == call.sampling
    assert len(peer["tool_calls"]) == len(trace.tool_calls) == (3 if shape == "tools" else 0)
    for tool_call_id, tool_call in trace.tool_calls.items():
        mine = peer["tool_calls"][tool_call_id]
        assert (mine["call_id"], mine["name"]) == (tool_call.call_id, tool_call.name)
        assert mine["requested_by"] == tool_call.requested_by_inference_call_id
        assert mine["call_item_id"] == tool_call.call_item_id != ""
        assert mine["output_item_id"] == tool_call.output_item_id != ""
        assert mine["status"] == _status(tool_call.execution.status)
        assert mine["submitted_by"] == tool_call.submitted_by
    assert set(peer["items"]) == set(trace.conversation_items)
    for item_id, item in trace.conversation_items.items():
        mine = peer["items"][item_id]
        assert item.role == 0 or state_pb2.ConversationRole.Name(item.role).endswith(
            mine["role"].upper()
        )
        assert [part.text for part in item.content] == mine["content"]
        assert mine["responses_item_id"] == item.responses_item_id
        assert mine["turn_id"] == item.turn_id
        assert mine["first_seen_at"] == _ms(item.first_seen_at)
        producers = [_producer(ref) for ref in item.produced_by]
        assert mine["produced_by"] in (producers or ["input"])
