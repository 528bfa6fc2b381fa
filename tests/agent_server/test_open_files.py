"""Many open threads against the process's open-file limit: raised at start, named when met."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.agent_server.conftest import error_reason, serve
from tests.commands import exec_argv
from trace_reducer import replay_bundle

# Each open thread keeps its bundle open: more threads than the soft limit has files.
THREADS = 120
LOW = 64


async def _run_turn(stub: agent_pb2_grpc.AgentServiceAsyncStub, thread_id: str) -> agent_pb2.Turn:
    """One turn of the built-in model, to its end."""
    turn = (
        await stub.StartTurn(
            agent_pb2.StartTurnRequest(
                thread_id=thread_id,
                input=[agent_pb2.UserInput(text="hello from one of many")],
            )
        )
    ).turn
    async for response in stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id)):
        event = response.event
        if event.HasField("turn_completed") and event.turn_completed.turn.id == turn.id:
            return event.turn_completed.turn
    raise AssertionError("the event stream ended before the turn did")


async def test_more_threads_than_the_soft_limit_allows_files_all_record(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with (
        serve(
            "--local-word-delay",
            "0",
            nofile=(LOW, 4096),
            ROLLOUT_TRACE_ROOT=str(traces),
        ) as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        threads = [
            (await stub.StartThread(agent_pb2.StartThreadRequest())).thread.id
            for _ in range(THREADS)
        ]
        for thread_id in threads:
            turn = await _run_turn(stub, thread_id)
            assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn.error.message
        for thread_id in threads:
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
    bundles = sorted(traces.iterdir())
    assert len(bundles) == THREADS
    for bundle in bundles:
        assert replay_bundle(bundle).recording_complete
    assert b"Traceback" not in served.stderr


async def test_the_hard_limit_met_is_named_and_the_server_serves_on(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with (
        serve(
            "--local-word-delay",
            "0",
            nofile=(LOW, LOW),
            ROLLOUT_TRACE_ROOT=str(traces),
        ) as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        threads: list[str] = []
        refused: grpc.aio.AioRpcError | None = None
        for _ in range(THREADS):
            try:
                reply = await stub.StartThread(agent_pb2.StartThreadRequest())
            except grpc.aio.AioRpcError as error:
                refused = error
                break
            threads.append(reply.thread.id)
        assert refused is not None, "every thread started under a limit of 64 files"
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(refused) == "RECORDING_START_FAILED"
        message = refused.details() or ""
        assert f"limit of {LOW} open files" in message, message
        assert "ulimit -n" in message
        assert len(threads) > LOW // 4
        for thread_id in threads:
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
        # Its files given back, the server takes new threads and runs their turns.
        again = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread.id
        turn = await _run_turn(stub, again)
        assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn.error.message
    assert b"Traceback" not in served.stderr


@pytest.mark.parametrize("soft", [LOW, 4096])
def test_raise_open_file_limit_takes_the_soft_limit_to_the_hard(soft: int) -> None:
    import subprocess
    import sys

    script = (
        "import resource; from grpc_common import raise_open_file_limit; "
        "now = raise_open_file_limit(); "
        "print(now, *resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    done = subprocess.run(
        exec_argv([sys.executable, "-c", script], nofile=(soft, 4096)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["4096", "4096", "4096"]
