"""Replaying a recorded run: the same client against its own recording, divergence, branching."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent_server import Settings
from agent_server.config import ConfigError
from agent_server.replay_model import ReplayModel
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import (
    AGENT_SERVER,
    Harness,
    StartAgent,
    clean_env,
    reduce_with_cli,
)
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    created,
    item_added,
    sse,
    text_delta,
)
from tests.agent_server.test_chat_dialect import chunk, stream
from tests.agent_server.test_tools import CONVERT, LOOKUP, requested, submit
from tests.trace_reducer.bundles import BundleBuilder, one_turn_bundle
from trace_reducer import diff_runs, export_rl, read_bundle, read_recorded_thread, replay_bundle

COMPLETED = agent_pb2.TURN_STATUS_COMPLETED
FAILED = agent_pb2.TURN_STATUS_FAILED

ToolCode = Callable[[str, str], str]


def tool_code(name: str, arguments: str) -> str:
    """The client's own tool: what the replay runs again."""
    return f"{name} saw {len(json.loads(arguments))} argument(s)"


async def tool_client(
    agent: Harness, tools: ToolCode = tool_code, **thread_fields: Any
) -> agent_pb2.Thread:
    """A text turn, a turn with two parallel tool calls answered by `tools`, another text
    turn; the thread closed."""
    thread = await agent.start_thread(tools=[LOOKUP, CONVERT], **thread_fields)
    events = agent.events(thread.id)
    first = await agent.start_turn(thread.id, "hello there")
    assert (await events.turn_completed(first.id)).status == COMPLETED
    second = await agent.start_turn(thread.id, "please lookup the rate and convert it")
    calls = await requested(events, 2)
    await submit(
        agent,
        thread.id,
        second.id,
        *((call.call_id, tools(call.name, call.arguments), False) for call in calls),
    )
    assert (await events.turn_completed(second.id)).status == COMPLETED
    third = await agent.start_turn(thread.id, "thanks, that is all")
    assert (await events.turn_completed(third.id)).status == COMPLETED
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return thread


def _items(trace: state_pb2.RolloutTrace) -> list[tuple[Any, ...]]:
    thread = trace.threads[trace.root_thread_id]
    out = []
    for item_id in thread.conversation_item_ids:
        item = trace.conversation_items[item_id]
        text = "".join(part.text for part in item.content)
        out.append((item.kind, item.role, text, item.name, item.arguments, item.output))
    return out


def _turns(trace: state_pb2.RolloutTrace) -> list[tuple[Any, ...]]:
    thread = trace.threads[trace.root_thread_id]
    return [
        (
            trace.turns[turn_id].execution.status,
            [
                (
                    trace.inference_calls[c].attempt,
                    trace.inference_calls[c].execution.status,
                    trace.inference_calls[c].error.code,
                    trace.inference_calls[c].response_id,
                    [d.partial_text for d in trace.inference_calls[c].discarded_outputs],
                )
                for c in trace.turns[turn_id].inference_call_ids
            ],
        )
        for turn_id in thread.turn_ids
    ]


async def assert_same_run(original: Path, replayed: Path) -> None:
    """The replay's reduced state equals the original's apart from ids and times."""
    a, b = replay_bundle(original), replay_bundle(replayed)
    assert _items(a) == _items(b)
    assert _turns(a) == _turns(b)
    assert len(a.tool_calls) == len(b.tool_calls)
    assert a.threads[a.root_thread_id].execution.status == (
        b.threads[b.root_thread_id].execution.status
    )
    difference = diff_runs(original, replayed)
    assert difference.first is None, difference.first
    # A fork's calls start with those it shares with its parent.
    assert difference.same_calls == difference.calls_a == difference.calls_b
    assert difference.calls_b >= len(a.inference_calls)


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_tool_run_replays_to_the_same_state(
    start_agent: StartAgent, tmp_path: Path, api: str
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0, provider_api=api)
    tokens: dict[str, Any] = {
        "capture_logprobs": True,
        "request_token_ids": True,
        "top_logprobs": 2,
    }
    thread = await tool_client(live, **tokens)
    original = Path(thread.bundle_path)
    assert {call.provider_api or "responses" for call in read_recorded_thread(original).calls} == {
        api
    }
    state = await reduce_with_cli(original)
    # The engine's token ids and logprobs were recorded: the replay must give them again.
    assert all(call.output_tokens.ids for call in state.inference_calls.values())
    # Parallel calls really happened: one response asked for both tools.
    assert any(len(call.response_item_ids) == 2 for call in state.inference_calls.values())

    replay = await start_agent(
        provider_url=None, replay_from=original, trace_root=tmp_path / "replayed", provider_api=api
    )
    replayed = await tool_client(replay, **tokens)
    assert replay.server.replay is not None
    assert replay.server.replay.answered == len(state.inference_calls)
    # Every request was byte for byte the recorded one.
    assert replay.server.replay.byte_identical == len(state.inference_calls)
    assert replay.server.replay.diverged == 0
    await assert_same_run(original, Path(replayed.bundle_path))


async def test_changed_tool_code_diverges_at_the_call_that_sends_its_output(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0)
    original = Path((await tool_client(live)).bundle_path)
    replay = await start_agent(
        provider_url=None, replay_from=original, trace_root=tmp_path / "replayed"
    )
    thread = await replay.start_thread(tools=[LOOKUP, CONVERT])
    events = replay.events(thread.id)
    first = await replay.start_turn(thread.id, "hello there")
    await events.turn_completed(first.id)
    second = await replay.start_turn(thread.id, "please lookup the rate and convert it")
    calls = await requested(events, 2)
    await submit(
        replay,
        thread.id,
        second.id,
        *((call.call_id, "a changed line of tool code", False) for call in calls),
    )
    ended = await events.turn_completed(second.id)
    assert ended.status == FAILED
    assert ended.error.code == "replay_divergence"
    assert ended.error.http_status == 409
    # The message names the recorded call and where the request first differs.
    assert "recorded call 3 of thread" in ended.error.message
    assert "output" in ended.error.message
    await replay.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

    # The first difference is the tool calls of call 2 (their outputs); call 3 is the
    # request that carried them.
    difference = diff_runs(original, Path(thread.bundle_path))
    assert difference.first is not None
    assert difference.first.number == 2
    assert difference.first.aspects == ["tool calls"]
    assert any("a changed line of tool code" in line for line in difference.first.details)


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_retries_and_an_interrupt_replay_as_recorded(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path, api: str
) -> None:
    """A 500 then a reply (two attempts); then a stream interrupted mid-item."""
    provider.queue_error(500, {"error": {"code": "server_error", "message": "boom"}})
    if api == "chat":
        start = {"role": "assistant", "content": "second time "}
        provider.queue(
            stream(chunk(start), chunk({"content": "lucky"}), chunk(finish_reason="stop"))
        )
        half = chunk({"role": "assistant", "content": "half a tho"})
        provider.queue(
            f"data: {json.dumps(half)}\n\n",
            asyncio.Event(),  # never set: the stream stalls until the interrupt closes it
        )
    else:
        provider.queue(answer("second time lucky", item_id="msg-a"))
        provider.queue(
            sse(
                created("resp-2"),
                item_added({"id": "msg-b", "type": "message", "role": "assistant"}),
                text_delta("half a tho", "msg-b"),
            ),
            asyncio.Event(),  # never set: the stream stalls until the interrupt closes it
        )

    async def client(agent: Harness) -> agent_pb2.Thread:
        thread = await agent.start_thread()
        events = agent.events(thread.id)
        first = await agent.start_turn(thread.id, "try")
        assert (await events.turn_completed(first.id)).status == COMPLETED
        second = await agent.start_turn(thread.id, "go on")
        await events.wait_for(lambda e: e.HasField("agent_message_delta"))
        await agent.stub.Interrupt(
            agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=second.id)
        )
        await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        return thread

    live = await start_agent(max_retries=1, provider_api=api)
    original = Path((await client(live)).bundle_path)
    state = await reduce_with_cli(original)
    assert [c.attempt for c in state.inference_calls.values()].count(2) == 1
    assert {c.provider_api or "responses" for c in read_recorded_thread(original).calls} == {api}

    replay = await start_agent(
        max_retries=1,
        provider_url=None,
        replay_from=original,
        trace_root=tmp_path / "replayed",
        provider_api=api,
    )
    replayed = Path((await client(replay)).bundle_path)
    await assert_same_run(original, replayed)
    # The interrupted call streamed what it had, then stayed open until the interrupt.
    again = replay_bundle(replayed)
    cancelled = [
        c
        for c in again.inference_calls.values()
        if c.execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    ]
    assert [d.partial_text for d in cancelled[0].discarded_outputs] == ["half a tho"]


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_forked_run_replays_from_its_bundles(
    start_agent: StartAgent, tmp_path: Path, api: str
) -> None:
    async def client(agent: Harness) -> list[agent_pb2.Thread]:
        thread = await agent.start_thread()
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "the shared start")
        await events.turn_completed(turn.id)
        reply = await agent.stub.ForkThread(
            agent_pb2.ForkThreadRequest(thread_id=thread.id, count=2)
        )
        forks = list(reply.threads)
        for index, fork in enumerate(forks):
            fork_events = agent.events(fork.id)
            fork_turn = await agent.start_turn(fork.id, f"branch number {index}")
            await fork_events.turn_completed(fork_turn.id)
        for each in (thread, *forks):
            await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=each.id))
        return [thread, *forks]

    live = await start_agent(provider_url=None, local_word_delay=0.0, provider_api=api)
    originals = await client(live)
    root = Path(originals[0].bundle_path).parent
    assert {
        call.provider_api or "responses"
        for each in originals
        for call in read_recorded_thread(Path(each.bundle_path)).calls
    } == {api}
    replay = await start_agent(
        provider_url=None, replay_from=root, trace_root=tmp_path / "replayed", provider_api=api
    )
    replayed = await client(replay)
    assert replay.server.replay is not None
    assert replay.server.replay.diverged == 0
    for before, after in zip(originals, replayed, strict=True):
        await assert_same_run(Path(before.bundle_path), Path(after.bundle_path))


def _first_record(bundle: Path) -> str:
    with read_bundle(bundle) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            if body not in {"header", "payload"}:
                return str(body)
    return ""


async def test_a_run_branched_at_call_3_is_a_fork_of_the_original(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path
) -> None:
    texts = ["one", "two", "three", "four"]

    async def client(agent: Harness, model: str) -> tuple[agent_pb2.Thread, list[agent_pb2.Turn]]:
        thread = await agent.start_thread(model=model)
        events = agent.events(thread.id)
        turns = []
        for text in texts:
            turn = await agent.start_turn(thread.id, f"turn {text}")
            turns.append(await events.turn_completed(turn.id))
        # The bundle a branch ends in is the fork's, made after StartThread answered.
        closed = await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        return closed.thread, turns

    live = await start_agent(provider_url=None, local_word_delay=0.0)
    original, _ = await client(live, "local-echo-1")
    root = Path(original.bundle_path).parent
    # The branch is recorded beside its original: elsewhere its parent could not be found.
    with pytest.raises(ConfigError, match="--trace-root must be the directory"):
        await start_agent(
            replay_from=Path(original.bundle_path),
            replay_branch_at=3,
            trace_root=tmp_path / "elsewhere",
        )
    provider.queue(answer("live three", item_id="live-3", response_id="resp-3"))
    provider.queue(answer("live four", item_id="live-4", response_id="resp-4"))
    branched = await start_agent(
        replay_from=Path(original.bundle_path), replay_branch_at=3, trace_root=root
    )
    thread, turns = await client(branched, "another-model")
    assert [turn.status for turn in turns] == [COMPLETED] * 4
    assert branched.server.replay is not None
    assert branched.server.replay.answered == 2
    # Calls 3 and 4 reached the live provider, asking for the other model.
    assert [json.loads(r.body)["model"] for r in provider.requests] == ["another-model"] * 2
    # The replay of turns 1 and 2 gave way to the fork's bundle: two runs, side by side.
    branch = Path(thread.bundle_path)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [Path(original.bundle_path).name, branch.name]
    )
    assert _first_record(branch) == "thread_forked"
    state = await reduce_with_cli(branch)
    before = await reduce_with_cli(Path(original.bundle_path))
    assert state.fork.resolved
    assert state.fork.parent_thread_id == before.root_thread_id
    assert state.fork.after_turn_id == before.threads[before.root_thread_id].turn_ids[1]
    assert state.fork.group_id == before.root_thread_id
    assert state.fork.repetition_index == 1
    assert state.trace_id == before.trace_id
    assistant = state_pb2.CONVERSATION_ROLE_ASSISTANT
    texts_seen = [item[2] for item in _items(state) if item[1] == assistant]
    assert texts_seen[2:] == ["live three", "live four"]
    assert texts_seen[:2] == [item[2] for item in _items(before) if item[1] == assistant][:2]
    # The shared turns are the original's, not recorded again: calls 3 and 4 are its own.
    assert len(state.inference_calls) == 2
    difference = diff_runs(Path(original.bundle_path), branch)
    assert difference.first is not None
    assert difference.first.number == 3
    assert "accepted items" in difference.first.aspects
    # export-rl puts both continuations in one group: the original 0, the branch 1.
    export_rl([root], fmt="jsonl", out_dir=tmp_path / "rl")
    (written,) = (tmp_path / "rl").iterdir()
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert {row["group_id"] for row in rows} == {before.root_thread_id}
    replies = {
        row["repetition_index"]: [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for row in rows
    }
    recorded = [item[2] for item in _items(before) if item[1] == assistant]
    assert replies == {0: recorded, 1: [*recorded[:2], "live three", "live four"]}
    # The original is in its branch's group, not the prompt of another: ART keeps both.
    exported = export_rl([root], fmt="art", out_dir=tmp_path / "art")
    assert exported.group_prompts == []
    [group] = (tmp_path / "art" / "art.jsonl").read_text().splitlines()
    assert len(json.loads(group)["trajectories"]) == 2


async def test_a_close_racing_the_branch_finishes_the_fork_s_bundle(
    start_agent: StartAgent,
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0)
    thread = await live.start_thread(model="local-echo-1")
    events = live.events(thread.id)
    for text in ("one", "two"):
        turn = await live.start_turn(thread.id, text)
        await events.turn_completed(turn.id)
    original = Path(
        (
            await live.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        ).thread.bundle_path
    )
    root = original.parent
    branched = await start_agent(replay_from=original, replay_branch_at=2, trace_root=root)
    thread = await branched.start_thread(model="local-echo-1")
    events = branched.events(thread.id)
    turn = await branched.start_turn(thread.id, "one")
    await events.turn_completed(turn.id)
    # The second turn holds call 2: its StartTurn swaps the bundle for a fork's, and the
    # close comes while it does.
    starting = branched.stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread.id, input=[agent_pb2.UserInput(text="two")])
    )
    closing = branched.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    _, closed = await asyncio.gather(starting, closing, return_exceptions=True)
    assert isinstance(closed, agent_pb2.CloseThreadResponse), closed
    # Was: the thread CLOSED, its recording still ACTIVE, the fork's bundle UNCLOSED and its
    # file held open until the process ended (the close finished the bundle it replaced).
    assert closed.thread.recording_status == agent_pb2.RECORDING_STATUS_CLOSED
    (bundle,) = [path for path in root.iterdir() if path != original]
    assert bundle == Path(closed.thread.bundle_path)
    assert replay_bundle(bundle).integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN


async def test_events_split_over_several_data_lines_replay_whole(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path
) -> None:
    def split(event: dict[str, Any]) -> str:
        """The event's JSON over several `data:` lines, as SSE allows (joined by newlines)."""
        return "".join(f"data: {line}\n" for line in json.dumps(event, indent=1).split("\n"))

    live = await start_agent(provider_api="chat")
    provider.queue(
        split(chunk({"role": "assistant", "content": "hel"}))
        + "\n"
        + split(chunk({"content": "lo"}))
        + "\n"
        + split(chunk(finish_reason="stop"))
        + "\n"
        + "data: [DONE]\n\n"
    )
    thread = await live.start_thread()
    events = live.events(thread.id)
    turn = await live.start_turn(thread.id, "hi")
    assert (await events.turn_completed(turn.id)).status == COMPLETED
    closed = await live.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    replay = await start_agent(
        provider_url=None,
        replay_from=Path(closed.thread.bundle_path),
        trace_root=tmp_path / "replayed",
        provider_api="chat",
    )
    thread = await replay.start_thread()
    events = replay.events(thread.id)
    turn = await replay.start_turn(thread.id, "hi")
    # Was FAILED: each event was sent back on one `data:` line, its other lines no field at
    # all, so the client read '{' alone ("an event that is not a JSON object").
    ended = await events.turn_completed(turn.id)
    assert ended.status == COMPLETED, ended.error
    deltas = events.of_kind("agent_message_delta")
    assert "".join(e.agent_message_delta.delta for e in deltas) == "hello"


async def test_a_branch_in_the_first_turn_shares_no_turn_and_is_not_a_fork(
    start_agent: StartAgent, provider: ScriptedProvider
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0)
    thread = await live.start_thread()
    events = live.events(thread.id)
    turn = await live.start_turn(thread.id, "only turn")
    await events.turn_completed(turn.id)
    await live.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    root = Path(thread.bundle_path).parent
    provider.queue(answer("live one", item_id="live-1"))
    branched = await start_agent(
        replay_from=Path(thread.bundle_path), replay_branch_at=1, trace_root=root
    )
    again = await branched.start_thread()
    again_events = branched.events(again.id)
    first = await branched.start_turn(again.id, "only turn")
    assert (await again_events.turn_completed(first.id)).status == COMPLETED
    await branched.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=again.id))
    assert _first_record(Path(again.bundle_path)) == "thread_started"


async def test_divergence_goes_live_when_asked(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0)
    thread = await live.start_thread()
    events = live.events(thread.id)
    turn = await live.start_turn(thread.id, "the recorded question")
    await events.turn_completed(turn.id)
    await live.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

    provider.queue(answer("a live answer", item_id="live-1"))
    replay = await start_agent(
        replay_from=Path(thread.bundle_path),
        replay_on_divergence="live",
        trace_root=tmp_path / "replayed",
    )
    other = await replay.start_thread()
    other_events = replay.events(other.id)
    other_turn = await replay.start_turn(other.id, "a question never recorded")
    assert (await other_events.turn_completed(other_turn.id)).status == COMPLETED
    assert replay.server.replay is not None
    assert replay.server.replay.diverged == 1
    assert len(provider.requests) == 1


async def test_bundles_without_an_inference_call_are_refused(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    # A thread started and closed before any turn: a bundle, but nothing to answer from.
    builder = BundleBuilder(tmp_path / "root")
    builder.thread_ended()
    bundle = builder.close()
    # Was: the server started, and every request got 409 "every recorded call was answered".
    for source in (bundle, bundle.parent):
        with pytest.raises(ConfigError, match=r"^--replay-from: no inference call to replay in"):
            await start_agent(replay_from=source, trace_root=tmp_path / "replayed")


async def test_a_branch_call_past_every_recorded_call_is_refused(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    bundle = one_turn_bundle(root)  # one call
    settings: dict[str, Any] = {"provider_url": "http://127.0.0.1:9/v1", "trace_root": root}
    # Was: the server started, replayed the whole run and never branched, without a word.
    for source in (bundle, root):
        with pytest.raises(
            ConfigError,
            match=r"^--replay-branch-at 2: the recorded threads made at most 1 inference call, ",
        ):
            await start_agent(replay_from=source, replay_branch_at=2, **settings)
    # The last recorded call is one a branch can start at.
    assert (await start_agent(replay_from=root, replay_branch_at=1, **settings)).server.replay


async def test_a_second_branch_of_a_run_takes_the_next_place_in_its_group(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path
) -> None:
    async def client(agent: Harness) -> Path:
        thread = await agent.start_thread(model="local-echo-1")
        events = agent.events(thread.id)
        for text in ("one", "two"):
            turn = await agent.start_turn(thread.id, text)
            assert (await events.turn_completed(turn.id)).status == COMPLETED
        closed = await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        return Path(closed.thread.bundle_path)

    live = await start_agent(provider_url=None, local_word_delay=0.0)
    original = await client(live)
    root = original.parent
    branches = []
    for attempt in ("first", "second"):
        # A server a branch: the second reads the first's fork beside the original.
        provider.queue(answer(f"live two, {attempt}", item_id=f"live-{attempt}"))
        branched = await start_agent(replay_from=root, replay_branch_at=2, trace_root=root)
        branches.append(await client(branched))
    group = replay_bundle(original).root_thread_id
    forks = [replay_bundle(branch).fork for branch in branches]
    assert [(fork.group_id, fork.repetition_index) for fork in forks] == [(group, 1), (group, 2)]
    # Was: both branches at repetition 1, two samples at one place of the group.
    export_rl([root], fmt="jsonl", out_dir=tmp_path / "rl")
    (written,) = (tmp_path / "rl").iterdir()
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert sorted((row["group_id"], row["repetition_index"]) for row in rows) == [
        (group, 0),
        (group, 1),
        (group, 2),
    ]


async def test_a_request_in_the_other_api_is_told_so(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path / "root")  # recorded in the Responses API
    model = await ReplayModel.from_settings(Settings(replay_from=bundle))
    chat = {"model": "m", "messages": [{"role": "user", "content": "answer once"}], "stream": True}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{model.url}/chat/completions", json=chat) as answer,
        ):
            assert answer.status == 409
            error = (await answer.json())["error"]
    finally:
        await model.stop()
    # Was: 'the request differs from recorded call 1 …: input: [{"content": …} vs absent'.
    assert error["code"] == "replay_divergence"
    assert error["message"] == (
        "the request is a Chat Completions one, and recorded call 1 of thread thread-1 (call-1) "
        "was a Responses API one: replay in the API it was recorded in "
        "(serve --provider-api responses)"
    )


@pytest.mark.parametrize(
    ("made", "said"),
    [
        # Was: "--replay-from: no such file or directory: PATH" for a FIFO that is there.
        ("fifo", "not a trace bundle ({path} is a FIFO, not a regular file)"),
        ("fifo bundle", "not a trace bundle ({path}/trace.binpb is a FIFO, not a regular file)"),
        (
            "dangling",
            "not a trace bundle ({path} is a symbolic link to nothing, not a regular file)",
        ),
        ("missing", "no such file or directory: {path}"),
        ("empty dir", "no trace bundles (directories holding trace.binpb) under {path}"),
    ],
)
def test_replay_from_says_what_its_path_is_and_never_waits_on_a_fifo(
    tmp_path: Path, made: str, said: str
) -> None:
    path = tmp_path / "recorded"
    if made == "fifo":
        os.mkfifo(path)
    elif made == "fifo bundle":
        path.mkdir()
        os.mkfifo(path / "trace.binpb")
    elif made == "dangling":
        path.symlink_to(tmp_path / "nothing")
    elif made == "empty dir":
        path.mkdir()
    done = subprocess.run(
        [AGENT_SERVER, "serve", "--listen", "127.0.0.1:0", "--replay-from", str(path)],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"agent-server: --replay-from: {said.format(path=path)}\n"


# A model's pace between two words (a slow one): the replay keeps a held call's gaps.
_WORD_GAP = 0.2


async def test_a_client_that_interrupts_after_counting_deltas_replays_at_fast(
    start_agent: StartAgent, provider: ScriptedProvider, tmp_path: Path
) -> None:
    # The demo's client: it interrupts the turn after its fifth delta. Recorded live, each delta
    # came in a read of its own; replayed at fast, the interrupted call's chunks came together,
    # the agent passed them on as one delta, the client waited for a fifth that never came and
    # the call's stream stayed open (as recorded: until the interrupt): the turn never ended.
    shown = [asyncio.Event() for _ in range(6)]
    words = ["one ", "two ", "three ", "four ", "five ", "six "]
    steps: list[Any] = [
        sse(
            created("resp-1"),
            item_added({"id": "msg-a", "type": "message", "role": "assistant"}),
            text_delta(words[0], "msg-a"),
        )
    ]
    for index, word in enumerate(words[1:]):
        steps += [shown[index], sse(text_delta(word, "msg-a"))]
    provider.queue(*steps, shown[-1])  # the last never set: open until the interrupt

    async def client(agent: Harness, live: bool) -> agent_pb2.Thread:
        thread = await agent.start_thread()
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "count with me")

        def deltas_at_least(count: int) -> Callable[[agent_pb2.ThreadEvent], bool]:
            return lambda _: len(events.of_kind("agent_message_delta")) >= count

        for seen in range(1, 6):
            await events.wait_for(deltas_at_least(seen))
            # The sixth word is never let go: had it been, it raced the interrupt, and the run
            # recorded live and its replay could each end either side of it. Live, each word
            # follows the last by a model's pace (the gap recorded, which the replay keeps):
            # not a wait for anything, the run's data.
            if live and seen < 5:
                await asyncio.sleep(_WORD_GAP)
                shown[seen - 1].set()
        await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
        await events.turn_completed(turn.id)
        await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        return thread

    live = await start_agent()
    original = Path((await client(live, live=True)).bundle_path)
    replay = await start_agent(
        provider_url=None, replay_from=original, trace_root=tmp_path / "replayed"
    )
    assert replay.server.settings.replay_pace == "fast"
    async with asyncio.timeout(60):
        replayed = Path((await client(replay, live=False)).bundle_path)
    await assert_same_run(original, replayed)
