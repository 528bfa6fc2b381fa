"""The benchmark's JSONL peer answers what the reducer answers, lazily or not."""

from __future__ import annotations

from pathlib import Path

from bench.jsonl_peer import reduce_codex_jsonl, write_codex_jsonl
from bench.reducer_bench import read_split_tag
from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import common_pb2
from trace_reducer import TRACE_FILE_NAME, BundleWriter, RecordBuilder, replay_bundle


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
