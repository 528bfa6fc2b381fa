"""The drift check of export-rl on bundles written with the real writer: prompts that extend
the held tokens, re-render the last output (REALIGN) or change the history (FORK)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2
from trace_reducer import BundleWriter, RecordBuilder, build_sample, export_rl, replay_bundle

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED


def write(root: Path, prompts: list[list[int]], outputs: list[list[int]]) -> Path:
    """One thread, a turn per (prompt, output), the engine's ids on every call."""
    writer = BundleWriter.create(root, "drift-thread")
    records = RecordBuilder(writer)
    thread = records.thread_started("drift-thread", model="m", instructions="", metadata={})
    history: list[dict[str, Any]] = []
    for number, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        user = {"role": "user", "content": [{"type": "input_text", "text": f"q{number}"}]}
        history.append(user)
        turn = records.turn_started(thread, f"turn-{number}", [user])
        call = records.inference_started(
            turn,
            inference_call_id=f"call-{number}",
            attempt=1,
            model="m",
            provider_base_url="http://127.0.0.1:1",
            envelope={"model": "m"},
            input_items=history,
        )
        records.prompt_tokens(call, prompt)
        item = records.output_item_added(
            call, provider_item_id=f"msg-{number}", item_type="message", role="assistant"
        )
        text = "x" * len(output)
        tokens = common_pb2.DeltaTokens(ids=output, logprobs=[-0.5] * len(output))
        tokens.text_lengths.extend([1] * len(output))
        records.output_text_delta(call, item, text, tokens=tokens)
        done = {
            "type": "message",
            "id": f"msg-{number}",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
        records.output_item_done(call, item, item_id=f"msg-{number}", assigned=False, payload=done)
        records.inference_ended(
            call,
            COMPLETED,
            reason="response.completed",
            stop_reason=common_pb2.STOP_REASON_COMPLETED,
        )
        history.append(done)
        records.turn_ended(turn, COMPLETED)
    writer.close()
    return writer.bundle_dir


def test_prompts_that_extend_the_held_tokens_are_clean(tmp_path: Path) -> None:
    bundle = write(tmp_path, [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]], [[4, 5], [8, 9]])
    trace = replay_bundle(bundle)
    # Stored once: the second prompt is recorded as 5 held tokens and 2 new ones.
    assert list(trace.inference_calls["call-1"].prompt_token_ids) == [1, 2, 3, 4, 5, 6, 7]
    sample = build_sample(bundle, trace)
    assert sample is not None
    assert sample.drift == "EXACT"
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert sample.logprobs == [None, None, None, -0.5, -0.5, None, None, -0.5, -0.5]
    assert sample.prompt_length == 3


def test_a_re_rendered_output_is_realigned_and_loses_its_loss(tmp_path: Path) -> None:
    # The next prompt renders the first answer as [4, 50]: the engine's tokens win.
    bundle = write(tmp_path, [[1, 2, 3], [1, 2, 3, 4, 50, 6]], [[4, 5], [8]])
    sample = build_sample(bundle, replay_bundle(bundle))
    assert sample is not None
    assert sample.drift == "REALIGN"
    assert sample.token_ids == [1, 2, 3, 4, 50, 6, 8]
    assert sample.loss_mask == [0, 0, 0, 1, 0, 0, 1]
    [event] = sample.drift_events
    assert (event["kind"], event["position"], event["unmasked_tokens"]) == ("REALIGN", 4, 1)


def test_a_changed_history_is_a_fork(tmp_path: Path) -> None:
    bundle = write(tmp_path, [[1, 2, 3], [1, 7, 3, 4, 5, 6]], [[4, 5], [8]])
    sample = build_sample(bundle, replay_bundle(bundle))
    assert sample is not None
    assert sample.drift == "FORK"
    assert sample.token_ids == [1, 7, 3, 4, 5, 6, 8]
    assert sample.loss_mask == [0, 0, 0, 0, 0, 0, 1]
    assert sample.drift_events[0]["unmasked_tokens"] == 2


def _with_alternatives(root: Path, tokens: common_pb2.DeltaTokens) -> Path:
    """One call whose one output carries `tokens` (ids 7 and 8, texts "a" and "b")."""
    writer = BundleWriter.create(root, "alternatives-thread")
    records = RecordBuilder(writer)
    thread = records.thread_started("alternatives-thread", model="m", instructions="", metadata={})
    user = {"role": "user", "content": [{"type": "input_text", "text": "q"}]}
    turn = records.turn_started(thread, "turn-1", [user])
    call = records.inference_started(
        turn,
        inference_call_id="call-1",
        attempt=1,
        model="m",
        provider_base_url="http://127.0.0.1:1",
        envelope={"model": "m"},
        input_items=[user],
    )
    item = records.output_item_added(
        call, provider_item_id="msg-1", item_type="message", role="assistant"
    )
    records.output_text_delta(call, item, "ab", tokens=tokens)
    done: dict[str, Any] = {"type": "message", "id": "msg-1", "role": "assistant"}
    done["content"] = [{"type": "output_text", "text": "ab"}]
    records.output_item_done(call, item, item_id="msg-1", assigned=False, payload=done)
    records.inference_ended(
        call, COMPLETED, reason="response.completed", stop_reason=common_pb2.STOP_REASON_COMPLETED
    )
    records.turn_ended(turn, COMPLETED)
    writer.close()
    return writer.bundle_dir


def test_alternatives_their_counts_disagree_with_are_cut_to_what_the_lists_hold(
    tmp_path: Path,
) -> None:
    # Was: counts of 3 and 2**31 with one alternative each put every later token's
    # alternatives out of step, and the ART export read past their end (IndexError).
    tokens = common_pb2.DeltaTokens(
        ids=[7, 8],
        logprobs=[-0.1, -0.2],
        texts=["a", "b"],
        top_counts=[3, 2**31],
        top_texts=["a", "z"],
        top_logprobs=[-0.1],
    )
    bundle = _with_alternatives(tmp_path / "bad", tokens)
    out = replay_bundle(bundle).inference_calls["call-1"].output_tokens
    assert list(out.top_counts) == [2, 0]
    assert list(out.top_texts) == ["a", "z"]
    assert len(out.top_logprobs) == 2
    exported = export_rl([bundle], fmt="art", out_dir=tmp_path / "art")
    [group] = [json.loads(line) for line in exported.path.read_text().splitlines()]
    [choice] = [
        entry
        for entry in group["trajectories"][0]["messages_and_choices"]
        if "finish_reason" in entry
    ]
    first, second = choice["logprobs"]["content"]
    assert [alt["token"] for alt in first["top_logprobs"]] == ["a", "z"]
    assert second["top_logprobs"] == []


def test_alternatives_that_agree_with_their_counts_are_kept_as_they_came(tmp_path: Path) -> None:
    tokens = common_pb2.DeltaTokens(
        ids=[7, 8],
        logprobs=[-0.1, -0.2],
        texts=["a", "b"],
        top_counts=[2, 1],
        top_texts=["a", "c", "b"],
        top_logprobs=[-0.1, -2.0, -0.2],
        top_ids=[7, 9, 8],
    )
    out = replay_bundle(_with_alternatives(tmp_path, tokens)).inference_calls["call-1"]
    assert list(out.output_tokens.top_counts) == [2, 1]
    assert list(out.output_tokens.top_texts) == ["a", "c", "b"]
    assert list(out.output_tokens.top_ids) == [7, 9, 8]
