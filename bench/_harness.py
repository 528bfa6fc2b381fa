"""Servers in their own processes on 127.0.0.1, and gRPC clients that drive whole threads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


def cpu_seconds(pid: int, *, main_thread: bool = False) -> float:
    """User + system CPU time of a live process, to the nanosecond (main_thread: of its first
    thread alone, the one a server's event loop runs on).

    Not /proc/PID/stat's clock ticks: a short run that spends under a tick (10 ms) would read as
    none at all. Linux lets any process read another's CPU clock (the id `clock_getcpuclockid`
    gives: the pid's complement shifted, CPUCLOCK_SCHED); a thread's is only for its own
    process, so the first thread's comes from its scheduler statistics, also in nanoseconds.
    """
    if main_thread:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9
    return time.clock_gettime((~pid << 3) | 2)


@dataclass
class Process:
    """A child that printed `listening on ADDRESS`; stopped with SIGTERM like a service."""

    popen: subprocess.Popen[str]
    address: str

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextlib.contextmanager
def spawn(argv: Sequence[str]) -> Iterator[Process]:
    """Start argv, wait for its `listening on` line, stop it on the way out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_TRACE_ROOT", None)
    env.pop("ROLLOUT_PROVIDER_URL", None)
    popen = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert popen.stdout is not None
    line = popen.stdout.readline()
    if not line.startswith("listening on "):
        popen.kill()
        raise RuntimeError(f"{argv[0]} did not start: {line!r}")
    process = Process(popen, line.removeprefix("listening on ").strip())
    try:
        yield process
    finally:
        process.stop()


def rotate(contenders: Sequence[Callable[[], None]], rounds: int) -> None:
    """Run every contender once a round, `rounds` rounds, each round starting one further on,
    so that no contender always runs first or after the same one."""
    for round_number in range(rounds):
        shift = round_number % len(contenders)
        for contender in [*contenders[shift:], *contenders[:shift]]:
            contender()


def prompt(index: int) -> str:
    """The user text of a bench thread's turn `index`."""
    return f"Question {index}: what did the model see when it answered the previous question?"


def agent_server_argv(
    *, trace_root: Path | None, word_delay: float = 0.0, provider_url: str | None = None
) -> list[str]:
    argv = [AGENT_SERVER, "serve", "--listen", "127.0.0.1:0", "--max-retries", "0"]
    argv += ["--local-word-delay", str(word_delay)]
    if trace_root is not None:
        argv += ["--trace-root", str(trace_root)]
    if provider_url is not None:
        argv += ["--provider-url", provider_url]
    return argv


@dataclass
class ThreadRun:
    """What one client thread saw."""

    thread: agent_pb2.Thread | None = None
    turns: int = 0
    delta_events: int = 0
    text: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


OnDelta = Callable[[str, int], None]


async def run_thread(
    stub: agent_pb2_grpc.AgentServiceAsyncStub,
    prompts: Sequence[str],
    *,
    on_delta: OnDelta | None = None,
    keep_text: bool = True,
    start: asyncio.Event | None = None,
    flush_window_ms: int | None = None,
) -> ThreadRun:
    """One thread: each prompt a turn, its events read until turn_completed; then closed.

    on_delta(text, monotonic_ns at receipt) is called for every delta event. flush_window_ms:
    StreamEvents' flush window (None: the server's default).
    """
    run = ThreadRun()
    started = await stub.StartThread(agent_pb2.StartThreadRequest())
    thread_id = started.thread.id
    request = agent_pb2.StreamEventsRequest(thread_id=thread_id)
    if flush_window_ms is not None:
        request.flush_window_ms = flush_window_ms
    call = stub.StreamEvents(request)
    events = aiter(call)
    if start is not None:
        await start.wait()
    try:
        for prompt in prompts:
            turn = (
                await stub.StartTurn(
                    agent_pb2.StartTurnRequest(
                        thread_id=thread_id, input=[agent_pb2.UserInput(text=prompt)]
                    )
                )
            ).turn
            while True:
                response = await anext(events, None)
                if response is None:
                    run.failures.append("event stream ended early")
                    return run
                event = response.event
                kind = event.WhichOneof("kind")
                if kind == "agent_message_delta":
                    run.delta_events += 1
                    delta = event.agent_message_delta.delta
                    if on_delta is not None:
                        on_delta(delta, time.monotonic_ns())
                    if keep_text:
                        run.text.append(delta)
                elif kind == "turn_completed" and event.turn_id == turn.id:
                    status = event.turn_completed.turn.status
                    if status != agent_pb2.TURN_STATUS_COMPLETED:
                        run.failures.append(agent_pb2.TurnStatus.Name(status))
                    run.turns += 1
                    break
    finally:
        run.thread = (
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
        ).thread
        call.cancel()
    return run


@contextlib.asynccontextmanager
async def stubs(
    address: str, channels: int
) -> AsyncIterator[list[agent_pb2_grpc.AgentServiceAsyncStub]]:
    """`channels` independent HTTP/2 connections (one would serialise every stream's frames)."""
    opened = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    try:
        yield [agent_pb2_grpc.AgentServiceStub(channel) for channel in opened]
    finally:
        for channel in opened:
            await channel.close(None)
