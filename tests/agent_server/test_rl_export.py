"""export-rl on real rollouts of the local model: every format read back and checked against
docs/training.md, a tool round trip masked, a GRPO group with its rewards."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_server import toy_tokens
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from tests.agent_server.conftest import Harness, StartAgent
from tests.agent_server.test_tools import LOOKUP, requested, submit
from trace_reducer import replay_bundle

pq = pytest.importorskip("pyarrow.parquet", reason="export-rl's Parquet needs the training extra")

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"
JSON_TYPES = {
    "string": str,
    "integer": int,
    "array": list,
    "object": dict,
    "boolean": bool,
    "null": type(None),
}


def documented(name: str) -> dict[str, str]:
    """The (column or key) -> type table that follows `<!-- schema: name -->` in the docs."""
    text = DOCS.read_text()
    block = text.split(f"<!-- schema: {name} -->", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in block.strip().splitlines()[2:] if line.startswith("|")]
    return {
        re.sub(r"`", "", cells[1].strip()): cells[2].strip()
        for cells in (row.split("|") for row in rows)
    }


def check_json(row: dict[str, Any], schema: dict[str, str]) -> None:
    assert set(row) == set(schema), set(row) ^ set(schema)
    for key, kind in schema.items():
        if kind == "number or null":
            assert row[key] is None or isinstance(row[key], int | float), key
        elif kind == "number":
            assert isinstance(row[key], int | float), key
        else:
            assert isinstance(row[key], JSON_TYPES[kind]), (key, kind, row[key])
            assert kind != "integer" or not isinstance(row[key], bool)


def check_parquet(path: Path, schema: dict[str, str]) -> list[dict[str, Any]]:
    table = pq.read_table(path)
    found = {field.name: re.sub(r"(element|item): ", "", str(field.type)) for field in table.schema}
    assert found == {
        name: kind.replace("list<float>", "list<float>") for name, kind in schema.items()
    }
    return list(table.to_pylist())


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def run_turn(agent: Harness, thread_id: str, text: str) -> agent_pb2.Turn:
    events = agent.events(thread_id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
    )
    return await events.turn_completed(reply.turn.id)


async def export(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        "export-rl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    assert "Traceback" not in err.decode()
    return process.returncode, out.decode(), err.decode()


async def test_every_format_reads_back_against_its_documented_schema(
    local: Harness, tmp_path: Path
) -> None:
    parent = await local.start_thread(
        instructions="Answer well.", capture_logprobs=True, request_token_ids=True, temperature=1
    )
    await run_turn(local, parent.id, "The question.")
    forks = (
        await local.stub.ForkThread(
            agent_pb2.ForkThreadRequest(thread_id=parent.id, count=4, group_id="q1")
        )
    ).threads
    for index, thread in enumerate(forks):
        await run_turn(local, thread.id, "Your answer?")
        await local.stub.RecordReward(
            agent_pb2.RecordRewardRequest(thread_id=thread.id, name="correct", value=index % 2)
        )
    text_only = await local.start_thread()
    await run_turn(local, text_only.id, "no tokens here")
    for thread in [parent, *forks, text_only]:
        await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    root = Path(parent.bundle_path).parent

    code, _, err = await export(str(root), "--format", "jsonl", "--out", str(tmp_path / "j"))
    assert code == 0, err
    lines = (tmp_path / "j" / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) == 6
    for sample in samples:
        check_json(sample, documented("jsonl"))
    by_thread = {s["thread_id"]: s for s in samples}
    assert by_thread[text_only.id]["tokens"] == "absent"
    assert by_thread[text_only.id]["token_ids"] == []
    assert [m["loss_mask"] for m in by_thread[text_only.id]["messages"]] == [0, 1]
    group = sorted(
        (s for s in samples if s["group_id"] == "q1"), key=lambda s: s["repetition_index"]
    )
    assert [s["repetition_index"] for s in group] == [0, 1, 2, 3]
    assert [s["reward"] for s in group] == [0.0, 1.0, 0.0, 1.0]
    assert {s["parent_thread_id"] for s in group} == {parent.id}
    assert by_thread[parent.id]["parent_thread_id"] == ""
    for sample in group:
        assert sample["tokens"] == "exact"
        assert sample["drift"] == "EXACT"
        assert sample["stop_reason"] == "completed"
        ids, mask = sample["token_ids"], sample["loss_mask"]
        assert len(ids) == len(mask) == len(sample["logprobs"])
        # Only the fork's own answer is trained on; the parent's answer is its context.
        [own] = [m for m in sample["messages"] if m["produced_by"] == "model"]
        start, end = own["token_span"]
        assert mask == [0] * start + [1] * (end - start)
        assert all(value is not None for value in sample["logprobs"][start:end])
        assert sample["prompt_length"] == start
        roles = [m["produced_by"] for m in sample["messages"]]
        assert roles == ["instructions", "inherited", "inherited", "user", "model"]

    code, out, err = await export(str(root), "--format", "verl", "--out", str(tmp_path / "v"))
    assert code == 0, err
    assert "1 sample without exact tokens is not in" in err
    # Was: the parent was a row of its own, a group of one (uid its thread id) without a
    # reward, which GRPO scores by its raw reward or not at all. It is the group's prompt: in
    # every fork's row (mask 0), not a row.
    assert "1 thread forked into a group is not in verl.parquet" in err
    assert out.startswith("wrote 4 samples (4 with exact tokens, 0 drifted)")
    rows = check_parquet(tmp_path / "v" / "verl.parquet", documented("verl"))
    assert len(rows) == 4
    grouped = [r for r in rows if r["uid"] == "q1"]
    assert len(grouped) == 4
    for row in grouped:
        assert (
            len(row["response_ids"]) == len(row["response_mask"]) == len(row["response_logprobs"])
        )
        assert set(row["response_mask"]) == {1}
        extra = json.loads(row["extra_info"])
        assert by_thread[extra["thread_id"]]["token_ids"] == row["prompt_ids"] + row["response_ids"]
    assert sorted(r["reward_score"] for r in grouped) == [0.0, 0.0, 1.0, 1.0]

    code, _, err = await export(str(root), "--format", "skyrl", "--out", str(tmp_path / "s"))
    assert code == 0, err
    rows = check_parquet(tmp_path / "s" / "skyrl.parquet", documented("skyrl"))
    trajectories = sorted(
        (r["trajectory_ids"]["repetition_id"], r["rewards"])
        for r in rows
        if r["trajectory_ids"]["instance_id"] == "q1"
    )
    assert trajectories == [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]
    assert len(rows) == 4
    assert all(r["stop_reasons"] == "completed" for r in rows)

    code, _out, err = await export(str(root), "--format", "art", "--out", str(tmp_path / "a"))
    assert code == 0, err
    groups = [json.loads(line) for line in (tmp_path / "a" / "art.jsonl").read_text().splitlines()]
    assert {g["metadata"]["group_id"] for g in groups} == {"q1", text_only.id}
    for group_row in groups:
        check_json(group_row, documented("art"))
        for trajectory in group_row["trajectories"]:
            check_json(trajectory, documented("art-trajectory"))
    [q1] = [g for g in groups if g["metadata"]["group_id"] == "q1"]
    assert [t["reward"] for t in q1["trajectories"]] == [0.0, 1.0, 0.0, 1.0]
    messages = q1["trajectories"][0]["messages_and_choices"]
    assert [m.get("role", "choice") if "message" not in m else "choice" for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "choice",
    ]
    choice = messages[-1]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"][0]["logprob"] <= 0


async def test_a_tool_round_trip_masks_the_tool_output(local: Harness, tmp_path: Path) -> None:
    thread = await local.start_thread(
        instructions="Use tools.", tools=[LOOKUP], capture_logprobs=True, request_token_ids=True
    )
    events = local.events(thread.id)
    turn = (
        await local.stub.StartTurn(
            agent_pb2.StartTurnRequest(
                thread_id=thread.id, input=[agent_pb2.UserInput(text="lookup the moon")]
            )
        )
    ).turn
    [call] = await requested(events, 1)
    await submit(local, thread.id, turn.id, (call.call_id, "It orbits the earth.", False))
    await events.turn_completed(turn.id)
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

    code, _, err = await export(thread.bundle_path, "--format", "jsonl", "--out", str(tmp_path))
    assert code == 0, err
    [sample] = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sample["tokens"] == "exact"
    assert sample["drift"] == "EXACT"
    ids, mask = sample["token_ids"], sample["loss_mask"]
    arguments = next(m for m in sample["messages"] if m["kind"] == "function_call")["arguments"]
    [reply] = [m for m in sample["messages"] if m["role"] == "assistant" and m["kind"] == "message"]
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "lookup the moon"}]},
        {"type": "function_call", "name": "lookup", "arguments": arguments},
        {"type": "function_call_output", "output": "It orbits the earth."},
        {"role": "assistant", "content": [{"type": "output_text", "text": reply["content"]}]},
    ]
    # The whole conversation as the engine's template renders it, prompt header excluded:
    # the sample is the engine's tokens, end to end.
    rendered = toy_tokens.render_prompt("Use tools.", items)
    assert ids == rendered[: -len(toy_tokens.header("assistant"))]
    # Loss on the call and on the answer; none on the tool's output.
    trained = [(m["kind"], m["token_span"]) for m in sample["messages"] if m["loss_mask"]]
    assert [kind for kind, _ in trained] == ["function_call", "message"]
    expected = [0] * len(ids)
    for _, (start, end) in trained:
        expected[start:end] = [1] * (end - start)
    assert mask == expected
    output = next(m for m in sample["messages"] if m["kind"] == "function_call_output")
    start, end = output["token_span"]
    assert set(mask[start:end]) == {0}
    observed = toy_tokens.encode("It orbits the earth.")
    window = ids[start:end]
    assert any(window[i : i + len(observed)] == observed for i in range(len(window)))


async def test_a_sample_says_how_its_rollout_went_in_list_s_words(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    # Was: a rollout whose turn failed waiting for its tool outputs (tool_output_timeout) was
    # a sample with stop_reason `completed` (its last call's) and nothing else saying so,
    # while `list` said `failed`: 184 of 1,728 pipeline rollouts read as fine to a trainer.
    local = await start_agent(provider_url=None, local_word_delay=0.0, tool_output_timeout=0.2)
    unanswered = await local.start_thread(
        tools=[LOOKUP], capture_logprobs=True, request_token_ids=True
    )
    failed = await run_turn(local, unanswered.id, "please lookup the moon")
    assert failed.status == agent_pb2.TURN_STATUS_FAILED
    answered = await local.start_thread(capture_logprobs=True, request_token_ids=True)
    await run_turn(local, answered.id, "hello")
    for thread in (unanswered, answered):
        await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    root = Path(answered.bundle_path).parent

    code, _, err = await export(str(root), "--format", "jsonl", "--out", str(tmp_path / "j"))
    assert code == 0, err
    lines = (tmp_path / "j" / "samples.jsonl").read_text().splitlines()
    samples = {s["thread_id"]: s for s in map(json.loads, lines)}
    for sample in samples.values():
        check_json(sample, documented("jsonl"))
    assert samples[unanswered.id]["stop_reason"] == "completed"
    assert samples[unanswered.id]["status"] == "failed"
    assert samples[answered.id]["status"] == "completed"
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "list", str(root), "--json", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    listed = {run["thread_id"]: run["status"] for run in map(json.loads, out.splitlines())}
    assert listed == {thread: sample["status"] for thread, sample in samples.items()}

    code, _, err = await export(str(root), "--format", "verl", "--out", str(tmp_path / "v"))
    assert code == 0, err
    extras = [
        json.loads(row["extra_info"])
        for row in pq.read_table(tmp_path / "v" / "verl.parquet").to_pylist()
    ]
    assert {extra["thread_id"]: extra["status"] for extra in extras} == listed
    code, _, err = await export(str(root), "--format", "art", "--out", str(tmp_path / "a"))
    assert code == 0, err
    art = (tmp_path / "a" / "art.jsonl").read_text().splitlines()
    metadata = [t["metadata"] for group in map(json.loads, art) for t in group["trajectories"]]
    assert {m["thread_id"]: m["status"] for m in metadata} == listed


async def test_export_rl_refuses_bad_input(tmp_path: Path, local: Harness) -> None:
    code, _, err = await export(
        str(tmp_path / "missing"), "--format", "jsonl", "--out", str(tmp_path)
    )
    assert code == 2
    assert "missing" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = await export(str(empty), "--format", "jsonl", "--out", str(tmp_path))
    assert code == 2
    assert "no trace bundles (directories holding trace.binpb) under" in err
    thread = await local.start_thread()
    await run_turn(local, thread.id, "hi")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = await export(thread.bundle_path, "--format", "jsonl", "--out", str(blocker))
    # A file where the output directory goes is bad input, refused before any work.
    assert code == 2
    assert str(blocker) in err
    code, _, err = await export(thread.bundle_path, "--format", "csv", "--out", str(tmp_path))
    assert code == 2


async def test_an_interrupted_rollout_s_row_holds_the_tokens_it_sampled(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    # Was: the verl and SkyRL rows of an interrupted rollout had an empty response (its last
    # call's output never became an item, so its tokens were left out), a reward given for
    # nothing. The tokens the policy sampled before the cut end the row, mask 1, with their
    # logprobs; stop_reasons and status say it was interrupted.
    paced = await start_agent(provider_url=None, local_word_delay=0.05)
    thread = await paced.start_thread(capture_logprobs=True, request_token_ids=True)
    events = paced.events(thread.id)
    turn = (
        await paced.stub.StartTurn(
            agent_pb2.StartTurnRequest(
                thread_id=thread.id, input=[agent_pb2.UserInput(text="tell me a long story")]
            )
        )
    ).turn
    await events.wait_for(lambda event: event.HasField("agent_message_delta"))
    await paced.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
    await events.turn_completed(turn.id)
    await paced.stub.RecordReward(
        agent_pb2.RecordRewardRequest(thread_id=thread.id, name="score", value=0.0)
    )
    await paced.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    [call] = replay_bundle(thread.bundle_path).inference_calls.values()
    assert call.stop_reason == common_pb2.STOP_REASON_INTERRUPTED
    assert not call.response_item_ids
    sampled = list(call.output_tokens.ids)
    assert sampled
    root = Path(thread.bundle_path).parent

    code, _, err = await export(str(root), "--format", "verl", "--out", str(tmp_path / "v"))
    assert code == 0, err
    [row] = check_parquet(tmp_path / "v" / "verl.parquet", documented("verl"))
    assert row["response_ids"] == sampled
    assert row["response_mask"] == [1] * len(sampled)
    assert row["response_logprobs"] == pytest.approx(list(call.output_tokens.logprobs))
    assert row["reward_score"] == 0.0
    assert json.loads(row["extra_info"])["status"] == "cancelled"
    code, _, err = await export(str(root), "--format", "skyrl", "--out", str(tmp_path / "s"))
    assert code == 0, err
    [row] = check_parquet(tmp_path / "s" / "skyrl.parquet", documented("skyrl"))
    assert row["response_ids"] == sampled
    assert row["loss_masks"] == [1] * len(sampled)
    assert row["stop_reasons"] == "interrupted"
