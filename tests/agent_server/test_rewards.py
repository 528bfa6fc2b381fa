"""RecordReward and `trace-reducer reward`: rewards in a CRC-checked sidecar beside the trace,
on live, closed and forgotten threads, listed in the reduced state with their targets."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, StartAgent, error_reason, reduce_with_cli
from trace_reducer import REWARDS_FILE_NAME, read_rewards, replay_bundle, thread_bundles

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


@pytest.fixture
async def local(start_agent: StartAgent) -> Harness:
    return await start_agent(provider_url=None, local_word_delay=0.0)


async def one_turn(agent: Harness, text: str = "hi") -> tuple[agent_pb2.Thread, str, str]:
    """A thread with one completed turn: (thread, turn id, the reply's item id)."""
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = (
        await agent.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=thread.id, input=[agent_pb2.UserInput(text=text)])
        )
    ).turn
    await events.turn_completed(turn.id)
    [done] = events.of_kind("item_completed")
    return thread, turn.id, done.item_completed.item.id


async def reward(agent: Harness, thread_id: str, **fields: Any) -> agent_pb2.RecordRewardResponse:
    return await agent.stub.RecordReward(
        agent_pb2.RecordRewardRequest(thread_id=thread_id, **{"name": "score", **fields})
    )


async def test_rewards_on_a_live_and_a_closed_thread_never_touch_the_trace(
    local: Harness,
) -> None:
    thread, turn_id, item_id = await one_turn(local)
    first = await reward(local, thread.id, value=1.0, source="judge", metadata={"rubric": "v2"})
    assert first.bundle_path == thread.bundle_path
    assert first.seq == 2  # the sidecar's header is seq 1
    await reward(local, thread.id, turn_id=turn_id, name="format", value=0.5, weight=2.0)
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    trace_file = Path(thread.bundle_path) / "trace.binpb"
    before = trace_file.read_bytes()
    third = await reward(local, thread.id, turn_id=turn_id, item_id=item_id, value=-1.0)
    assert third.seq == 4
    assert trace_file.read_bytes() == before
    assert oct((Path(thread.bundle_path) / REWARDS_FILE_NAME).stat().st_mode & 0o777) == "0o600"

    rollout = await reduce_with_cli(Path(thread.bundle_path))
    assert rollout.recording_complete
    listed = [
        (r.name, r.value, r.weight, r.target.turn_id, r.target.item_id, r.seq)
        for r in rollout.rewards
    ]
    assert listed == [
        ("score", 1.0, 0.0, "", "", 2),
        ("format", 0.5, 2.0, turn_id, "", 3),
        ("score", -1.0, 0.0, turn_id, item_id, 4),
    ]
    assert all(r.target.found and r.target.thread_id == thread.id for r in rollout.rewards)
    assert rollout.rewards[0].source == "judge"
    assert dict(rollout.rewards[0].metadata) == {"rubric": "v2"}
    assert rollout.rewards[0].recorded_by.startswith("ipv4:127.0.0.1")
    target = rollout.rewards[2].target.conversation_item_id
    assert rollout.conversation_items[target].responses_item_id == item_id


async def test_a_forgotten_thread_is_found_by_its_bundle(start_agent: StartAgent) -> None:
    agent = await start_agent(provider_url=None, local_word_delay=0.0, closed_thread_retention=0.0)
    thread, turn_id, item_id = await one_turn(agent)
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    # Not in memory any more: found under the trace root, checked against its bundle.
    answer = await reward(agent, thread.id, turn_id=turn_id, item_id=item_id, value=0.25)
    assert answer.bundle_path == thread.bundle_path
    for fields, reason in (
        ({"turn_id": "turn_nope"}, "TURN_NOT_FOUND"),
        ({"item_id": "msg_nope"}, "ITEM_NOT_FOUND"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await reward(agent, thread.id, value=1.0, **fields)
        assert error_reason(refused.value) == reason
    # A server started later on the same root finds it too.
    later = await start_agent(provider_url=None, local_word_delay=0.0)
    await reward(later, thread.id, value=0.75)
    rewards = replay_bundle(thread.bundle_path).rewards
    assert [(r.value, r.target.found) for r in rewards] == [(0.25, True), (0.75, True)]


def _swap_for_a_link(bundle: Path, outside: Path) -> Path:
    """bundle's directory moved aside and its name made a symbolic link to a copy of it
    outside the root: what someone who may write in the root could do between a bundle's
    being found and its reward's being written. Returns the copy."""
    copy = outside / bundle.name
    shutil.copytree(bundle, copy)
    bundle.rename(bundle.with_name(bundle.name + ".moved"))
    bundle.symlink_to(copy, target_is_directory=True)
    return copy


async def test_a_reward_is_never_written_through_a_directory_swapped_for_a_link(
    start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: the bundle found by a scan (or held) was written to by its path, after: a reward
    # recorded outside the trace root.
    outside = tmp_path / "outside"
    outside.mkdir()
    agent = await start_agent(provider_url=None, local_word_delay=0.0, closed_thread_retention=0.0)
    forgotten, _, _ = await one_turn(agent)
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=forgotten.id))

    def found_then_swapped(root: Path, thread_id: str) -> list[Path]:
        found = thread_bundles(root, thread_id)
        _swap_for_a_link(found[-1], outside)
        return found

    monkeypatch.setattr("agent_server.agent.thread_bundles", found_then_swapped)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await reward(agent, forgotten.id, value=1.0)
    assert error_reason(refused.value) == "THREAD_NOT_FOUND"
    assert not (outside / Path(forgotten.bundle_path).name / REWARDS_FILE_NAME).exists()
    # A thread the server holds: its bundle's directory swapped while it is open.
    held, _, _ = await one_turn(agent)
    copy = _swap_for_a_link(Path(held.bundle_path), outside)
    with pytest.raises(grpc.aio.AioRpcError) as unwritable:
        await reward(agent, held.id, value=1.0)
    assert error_reason(unwritable.value) == "REWARDS_UNWRITABLE"
    assert not (copy / REWARDS_FILE_NAME).exists()


async def test_bad_rewards_get_their_codes(local: Harness, start_agent: StartAgent) -> None:
    thread, _, _ = await one_turn(local)
    cases: list[tuple[dict[str, Any], grpc.StatusCode, str]] = [
        ({"thread_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "MISSING_THREAD_ID"),
        ({"thread_id": "thread_nope"}, grpc.StatusCode.NOT_FOUND, "THREAD_NOT_FOUND"),
        ({"thread_id": "../../etc"}, grpc.StatusCode.NOT_FOUND, "THREAD_NOT_FOUND"),
        ({"name": ""}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REWARD_NAME"),
        ({"value": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REWARD_VALUE"),
        ({"weight": float("inf")}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REWARD_VALUE"),
        ({"turn_id": "turn_nope"}, grpc.StatusCode.NOT_FOUND, "TURN_NOT_FOUND"),
        ({"item_id": "msg_nope"}, grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (
            {"metadata": {f"k{i}": "v" for i in range(65)}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "METADATA_TOO_LARGE",
        ),
    ]
    for fields, code, reason in cases:
        request: dict[str, Any] = {"thread_id": thread.id, "name": "score", **fields}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await local.stub.RecordReward(agent_pb2.RecordRewardRequest(**request))
        assert (refused.value.code(), error_reason(refused.value)) == (code, reason), fields
    assert not (Path(thread.bundle_path) / REWARDS_FILE_NAME).exists()

    unrecorded = await start_agent(provider_url=None, local_word_delay=0.0, trace_root=None)
    quiet = await unrecorded.start_thread()
    with pytest.raises(grpc.aio.AioRpcError) as off:
        await reward(unrecorded, quiet.id, value=1.0)
    assert (off.value.code(), error_reason(off.value)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RECORDING_OFF",
    )

    # A sidecar damaged in the middle is never appended to.
    sidecar = Path(thread.bundle_path) / REWARDS_FILE_NAME
    await reward(local, thread.id, value=1.0)
    await reward(local, thread.id, value=2.0)
    data = bytearray(sidecar.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sidecar.write_bytes(bytes(data))
    with pytest.raises(grpc.aio.AioRpcError) as corrupt:
        await reward(local, thread.id, value=3.0)
    assert (corrupt.value.code(), error_reason(corrupt.value)) == (
        grpc.StatusCode.DATA_LOSS,
        "REWARDS_CORRUPT",
    )
    assert sidecar.read_bytes() == bytes(data)
    damaged = replay_bundle(thread.bundle_path)
    assert REWARDS_FILE_NAME in damaged.integrity.detail


async def test_a_torn_reward_is_cut_before_the_next_is_appended(local: Harness) -> None:
    thread, _, _ = await one_turn(local)
    await reward(local, thread.id, value=1.0)
    sidecar = Path(thread.bundle_path) / REWARDS_FILE_NAME
    whole = sidecar.read_bytes()
    # A writer that died mid-frame left half a record (it never acknowledged it).
    with sidecar.open("ab") as out:
        out.write(b"\x40\x08\x03")
    answer = await reward(local, thread.id, value=2.0)
    assert answer.seq == 3
    assert sidecar.read_bytes().startswith(whole)
    assert [r.value for _, r in read_rewards(Path(thread.bundle_path)).rewards] == [1.0, 2.0]


async def run_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ},
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_trace_reducer_reward_records_offline(local: Harness, tmp_path: Path) -> None:
    thread, turn_id, item_id = await one_turn(local)
    await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    code, out, err = await run_cli(
        "reward", thread.bundle_path, "--name", "pass", "--value", "1", "--turn", turn_id,
        "--item", item_id, "--metadata", "judge=unit-test",
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith("recorded pass=1 for ")
    for bad, message in (
        (["--value", "nan"], "finite"),
        (["--value", "1", "--turn", "turn_nope"], "no turn"),
        (["--value", "1", "--item", "msg_nope"], "no item"),
        (["--value", "1", "--metadata", "novalue"], "KEY=VALUE"),
    ):
        code, _, err = await run_cli("reward", thread.bundle_path, "--name", "x", *bad)
        assert code == 2, (bad, err)
        assert message in err
        assert "Traceback" not in err
    code, _, err = await run_cli("reward", str(tmp_path / "missing"), "--name", "x", "--value", "1")
    assert code == 2
    assert "Traceback" not in err
    [listed] = replay_bundle(thread.bundle_path).rewards
    assert (listed.name, listed.recorded_by, listed.target.found) == (
        "pass",
        "trace-reducer reward",
        True,
    )
