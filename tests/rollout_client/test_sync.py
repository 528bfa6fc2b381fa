"""The blocking facade against `agent-server serve` in its own process."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent_server.local_model import reply_words
from rollout.agent.v1 import agent_pb2
from rollout_client import NotFoundError, SyncAgentClient, function_tool
from tests.live_server import LiveServer


def test_a_turn_streams_and_the_thread_closes(live: LiveServer) -> None:
    with SyncAgentClient(live.address) as client:
        thread = client.start_thread(metadata={"from": "sync"})
        turn = thread.run_turn("blocking hello")
        kinds = [event.WhichOneof("kind") for event in turn]
        assert kinds[0] == "turn_started"
        assert kinds[-1] == "turn_completed"
        assert turn.status_name == "COMPLETED"
        assert turn.text == "".join(reply_words("blocking hello"))
        assert thread.id in {t.id for t in client.list_threads()}
        closed = thread.close()
        assert closed.status == agent_pb2.THREAD_STATUS_CLOSED
        assert closed.turn_count == 1


def test_with_options_is_the_same_connection_with_another_timeout(live: LiveServer) -> None:
    # Was: AttributeError, though the README offers `client.with_options(timeout=…)` and
    # docs/clients.md gives the blocking facade the same methods.
    with SyncAgentClient(live.address, timeout=30) as client:
        quick = client.with_options(timeout=5)
        assert (quick.timeout, client.timeout) == (5, 30)
        thread = quick.start_thread()
        assert thread.id in {t.id for t in client.with_options(timeout=2).list_threads()}
        thread.close()


def test_interrupt_and_errors(live: LiveServer) -> None:
    with SyncAgentClient(live.address) as client:
        thread = client.start_thread()
        turn = thread.run_turn("interrupt me")
        for event in turn:
            if event.HasField("agent_message_delta") and turn.result is None:
                assert turn.interrupt().status == agent_pb2.TURN_STATUS_INTERRUPTED
                break
        # wait() reads what is left of the turn, up to its turn_completed.
        assert turn.wait().status == agent_pb2.TURN_STATUS_INTERRUPTED
        with pytest.raises(NotFoundError) as raised:
            client.thread("thread_missing")
        assert raised.value.reason == "THREAD_NOT_FOUND"
        thread.close()


def test_plain_function_tools_run_in_worker_threads(live: LiveServer) -> None:
    ran_in: list[str] = []

    def weather(arguments: dict[str, object]) -> str:
        ran_in.append(threading.current_thread().name)
        return f"sunny in {arguments['city']}"

    tool = function_tool(
        "weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}
    )
    with SyncAgentClient(live.address) as client:
        thread = client.start_thread(tools=[tool])
        turn = thread.run_turn("Ask weather.", tools={"weather": weather})
        assert turn.wait().status == agent_pb2.TURN_STATUS_COMPLETED
        thread.close()
    assert "sunny in Ask weather." in turn.text
    assert len(ran_in) == 1
    assert ran_in[0] != threading.main_thread().name


MASK_PROBE = """
import os, sys
from rollout_client import SyncAgentClient

with SyncAgentClient(sys.argv[1]) as client:
    thread = client.start_thread()
    thread.run_turn("spawn every thread").wait()
    for task in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{task}/status").read()
        blocked = int(status.split("SigBlk:")[1].split()[0], 16)
        print(task == str(os.getpid()), bool(blocked & (1 << 1)))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_only_the_main_thread_takes_ctrl_c(live: LiveServer) -> None:
    # Ctrl-C's SIGINT must wake the main thread, whatever it is blocked in (input(), say):
    # every thread the client starts, and those they start, leave it to the main thread.
    probe = subprocess.run(
        [sys.executable, "-c", MASK_PROBE, live.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    threads = [line.split() for line in probe.stdout.splitlines()]
    assert ["True", "False"] in threads
    others = [blocked for main, blocked in threads if main == "False"]
    assert len(others) >= 2
    assert set(others) == {"True"}
