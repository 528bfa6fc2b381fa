"""ForkThread end to end: N continuations of one prefix, the prefix stored once, GRPO groups,
the parent resolved (or said to be missing), a kill -9 in the middle of forks."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import grpc
import pytest

from agent_server import toy_tokens
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import (
    EventLog,
    Harness,
    StartAgent,
    error_reason,
    reduce_with_cli,
    serve,
)
from trace_reducer import read_bundle, replay_bundle, request_body

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
LONG_CONTEXT = "The shared context of every sample. " * 400


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def run_turn(agent: Harness, thread_id: str, text: str) -> agent_pb2.Turn:
    events = agent.events(thread_id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
    )
    return await events.turn_completed(reply.turn.id)


def before_first_turn(bundle: str) -> int:
    """Bytes of a bundle's records before its first turn_started."""
    size = 0
    with read_bundle(bundle) as reader:
        for record in reader:
            if record.WhichOneof("body") == "turn_started":
                break
            size += record.ByteSize() + 1
    return size


async def fork(agent: Harness, thread_id: str, count: int, **fields: str) -> list[agent_pb2.Thread]:
    reply = await agent.stub.ForkThread(
        agent_pb2.ForkThreadRequest(thread_id=thread_id, count=count, **fields)
    )
    return list(reply.threads)


async def test_grpo_group_of_eight_shares_its_prefix_stored_once(local: Harness) -> None:
    parent = await local.start_thread(
        instructions="Solve it.", capture_logprobs=True, request_token_ids=True, temperature=1.0
    )
    first = await run_turn(local, parent.id, LONG_CONTEXT)
    forks = await fork(local, parent.id, 8, group_id="question-1")
    assert [f.fork.repetition_index for f in forks] == list(range(8))
    assert {f.fork.group_id for f in forks} == {"question-1"}
    assert {f.fork.after_turn_id for f in forks} == {first.id}
    assert all(f.capture_logprobs and f.temperature == 1.0 for f in forks)
    turns = await asyncio.gather(*(run_turn(local, f.id, "Now answer.") for f in forks))
    assert {t.status for t in turns} == {agent_pb2.TURN_STATUS_COMPLETED}
    for thread in [parent, *forks]:
        await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

    parent_bytes = (Path(parent.bundle_path) / "trace.binpb").read_bytes()
    assert LONG_CONTEXT.encode() in parent_bytes
    for thread in forks:
        data = (Path(thread.bundle_path) / "trace.binpb").read_bytes()
        # The prefix (and the instructions) are the parent's: referred to, never copied.
        assert b"The shared context" not in data
        assert b"Solve it." not in data
        # What comes before the fork's own turn is a few ids, whatever the prefix's size...
        assert before_first_turn(thread.bundle_path) < 1024
        # ... so a fork costs its new turn, a fraction of a copy of its parent.
        assert len(data) < len(parent_bytes) / 3

    outputs = set()
    for repetition, thread in enumerate(forks):
        rollout = await reduce_with_cli(Path(thread.bundle_path))
        assert rollout.recording_complete
        assert not rollout.integrity.fork_unresolved
        fork_info = rollout.fork
        assert (fork_info.parent_thread_id, fork_info.group_id) == (parent.id, "question-1")
        assert fork_info.repetition_index == repetition
        assert fork_info.resolved
        assert fork_info.shared_items == 2
        assert rollout.trace_id == replay_bundle(parent.bundle_path).trace_id
        items = [
            rollout.conversation_items[i] for i in rollout.threads[thread.id].conversation_item_ids
        ]
        inherited = [i for i in items if i.HasField("inherited")]
        assert next(i.content[0].text for i in inherited) == LONG_CONTEXT
        assert all(i.inherited.parent_item_id and i.produced_by for i in inherited)
        [call] = rollout.inference_calls.values()
        assert call.request_item_ids[:2] == [i.item_id for i in inherited]
        # The engine saw the whole conversation, rebuilt from the parent's records and the
        # fork's: the exact request body, and the prompt's tokens.
        body = json.loads(request_body(thread.bundle_path, call.inference_call_id))
        assert body["input"][0]["content"][0]["text"] == LONG_CONTEXT
        assert list(call.prompt_token_ids) == toy_tokens.render_prompt("Solve it.", body["input"])
        outputs.add(tuple(call.output_tokens.ids))
    assert len(outputs) == 8, "samples at a temperature differ"


async def test_a_fork_after_an_earlier_turn_shares_only_that(local: Harness) -> None:
    parent = await local.start_thread()
    first = await run_turn(local, parent.id, "first question")
    await run_turn(local, parent.id, "second question")
    [child] = await fork(local, parent.id, 1, after_turn_id=first.id)
    assert child.fork.after_turn_id == first.id
    assert child.fork.group_id.startswith("group_")
    await run_turn(local, child.id, "a different second question")
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=child.id))
    rollout = replay_bundle(child.bundle_path)
    texts = [
        rollout.conversation_items[i].content[0].text
        for i in rollout.threads[child.id].conversation_item_ids
    ]
    assert texts[0] == "first question"
    assert "second question" not in texts
    assert texts[2] == "a different second question"
    assert rollout.fork.shared_items == 2


async def test_a_fork_without_its_parent_says_so_and_resolves_when_given_it(
    local: Harness, tmp_path: Path
) -> None:
    parent = await local.start_thread(instructions="Be kind.")
    await run_turn(local, parent.id, "shared question")
    [child] = await fork(local, parent.id, 1)
    await run_turn(local, child.id, "follow-up")
    for thread in (parent, child):
        await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved_parent = Path(shutil.move(parent.bundle_path, elsewhere))
    lonely = replay_bundle(child.bundle_path)
    assert lonely.integrity.fork_unresolved
    assert not lonely.fork.resolved
    assert "was not found" in lonely.integrity.detail
    assert lonely.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    # Everything of its own is there; the shared items are placeholders.
    [call] = lonely.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert len(call.request_item_ids) == 3
    resolved = replay_bundle(child.bundle_path, parents=[moved_parent])
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "reduce", child.bundle_path, "--stdout", "--parent", str(moved_parent),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, err
    assert json.loads(out)["fork"]["resolved"] is True
    assert resolved.fork.resolved
    assert not resolved.integrity.fork_unresolved
    first = resolved.conversation_items[resolved.threads[child.id].conversation_item_ids[0]]
    assert first.content[0].text == "shared question"


async def test_fork_thread_refuses_bad_arguments(local: Harness, start_agent: StartAgent) -> None:
    parent = await local.start_thread()
    await run_turn(local, parent.id, "hi")
    cases = [
        (agent_pb2.ForkThreadRequest(thread_id=parent.id, count=0), "INVALID_FORK_COUNT"),
        (agent_pb2.ForkThreadRequest(thread_id=parent.id, count=65), "INVALID_FORK_COUNT"),
        (agent_pb2.ForkThreadRequest(thread_id="", count=1), "MISSING_THREAD_ID"),
        (agent_pb2.ForkThreadRequest(thread_id="thread_nope", count=1), "THREAD_NOT_FOUND"),
        (
            agent_pb2.ForkThreadRequest(thread_id=parent.id, count=1, after_turn_id="turn_x"),
            "TURN_NOT_FOUND",
        ),
        (
            agent_pb2.ForkThreadRequest(thread_id=parent.id, count=1, group_id="g" * 300),
            "INVALID_GROUP_ID",
        ),
    ]
    for request, reason in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await local.stub.ForkThread(request)
        assert error_reason(refused.value) == reason, request
        assert refused.value.code() != grpc.StatusCode.UNKNOWN
    # A model slow enough that the turn is still running when the fork is asked for.
    paced = await start_agent(provider_url=None, local_word_delay=0.2)
    slow = await paced.start_thread()
    events = paced.events(slow.id)
    running = (
        await paced.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=slow.id, input=[agent_pb2.UserInput(text="x")])
        )
    ).turn
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await paced.stub.ForkThread(agent_pb2.ForkThreadRequest(thread_id=slow.id, count=1))
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(busy.value) == "TURN_ALREADY_RUNNING"
    await paced.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=slow.id, turn_id=running.id))
    await events.turn_completed(running.id)


async def test_kill_9_mid_fork_leaves_every_fork_reducible(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with (
        serve("--trace-root", str(traces), "--local-word-delay", "0.05") as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        parent = (
            await stub.StartThread(
                agent_pb2.StartThreadRequest(capture_logprobs=True, request_token_ids=True)
            )
        ).thread
        events = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=parent.id)))
        turn = await stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=parent.id, input=[agent_pb2.UserInput(text="go")])
        )
        await events.turn_completed(turn.turn.id)
        forks = (
            await stub.ForkThread(agent_pb2.ForkThreadRequest(thread_id=parent.id, count=4))
        ).threads
        logs = [
            EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=f.id)))
            for f in forks
        ]
        for thread in forks:
            await stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="continue")]
                )
            )
        await asyncio.gather(
            *(log.wait_for(lambda e: e.HasField("agent_message_delta")) for log in logs)
        )
        served.process.kill()
        await served.process.wait()
        for log in [events, *logs]:
            await log.until_end()
    for thread, log in zip(forks, logs, strict=True):
        rollout = await reduce_with_cli(Path(thread.bundle_path))
        assert rollout.integrity.status in {
            state_pb2.INTEGRITY_STATUS_UNCLOSED,
            state_pb2.INTEGRITY_STATUS_TRUNCATED,
        }
        assert rollout.fork.resolved
        assert rollout.fork.parent_thread_id == parent.id
        [call] = [c for c in rollout.inference_calls.values() if c.turn_id in rollout.turns]
        # Whatever streamed before the kill is there, with its tokens.
        streamed = "".join(e.agent_message_delta.delta for e in log.of_kind("agent_message_delta"))
        partial = "".join(d.partial_text for d in call.discarded_outputs)
        assert partial.startswith(streamed)
        assert call.output_tokens.count >= 1
        with read_bundle(thread.bundle_path) as reader:
            kinds = [r.WhichOneof("body") for r in reader]
        assert kinds[:3] == ["header", "thread_forked", "thread_started"]
