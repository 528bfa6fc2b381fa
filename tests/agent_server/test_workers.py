"""`agent-server serve --workers N`: one address, N processes, every call for a thread answered
by the one owning it. Real processes, real gRPC on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_server._router import _CARRIED_HELD
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import AGENT_SERVER, EventLog, clean_env, error_reason, serve
from tests.grpc_common import test_server
from trace_reducer import replay_bundle

TOKEN = "workers-token-0815"
# The self-signed certificate fixture the shared plumbing is tested with.
certificate = test_server.certificate
LOOKUP = agent_pb2.FunctionTool(
    name="lookup",
    description="Look something up.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    ),
)
# Fresh connections tried at most to reach a given worker: the kernel spreads them at random,
# so missing one of two workers this often has odds of 2**-40.
MAX_CHANNELS = 40
# Bounds on waits for a condition (a log line, processes gone), never a synchronisation.
WAIT_SECONDS = 30.0
_STARTED = re.compile(r"thread started thread=(\S+) .* worker=(\d+)$")


@dataclass
class Supervised:
    """A running `serve --workers N` and what it logged so far."""

    process: asyncio.subprocess.Process
    address: str
    pids: dict[int, int]
    lines: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None
    owners: dict[str, int] = field(default_factory=dict)

    async def line(self, predicate: Callable[[str], bool]) -> str:
        """The first log line (seen or to come) matching predicate."""
        checked = 0
        async with asyncio.timeout(WAIT_SECONDS):
            while True:
                for line in self.lines[checked:]:
                    if predicate(line):
                        return line
                checked = len(self.lines)
                assert self.reader is not None
                assert not self.reader.done(), self.stderr()
                self.changed.clear()
                await self.changed.wait()

    async def count(self, predicate: Callable[[str], bool], at_least: int) -> None:
        """Until at least `at_least` log lines match predicate."""
        async with asyncio.timeout(WAIT_SECONDS):
            while sum(1 for line in self.lines if predicate(line)) < at_least:
                assert self.reader is not None
                assert not self.reader.done(), self.stderr()
                self.changed.clear()
                await self.changed.wait()

    async def owner(self, thread_id: str) -> int:
        """The worker that started the thread (its `thread started` line)."""
        line = await self.line(lambda text: f"thread started thread={thread_id} " in text)
        match = _STARTED.search(line)
        assert match is not None, line
        return int(match.group(2))

    def forwarded(self, rpc: str, thread_id: str) -> list[str]:
        return [
            line
            for line in self.lines
            if "forwarded to the owning worker" in line
            and f"rpc={rpc} " in line
            and f"thread_id={thread_id}" in line
        ]

    def stderr(self) -> str:
        return "\n".join(self.lines)


async def _read(supervised: Supervised, stream: asyncio.StreamReader) -> None:
    while line := await stream.readline():
        supervised.lines.append(line.decode().rstrip("\n"))
        supervised.changed.set()
    supervised.changed.set()


@contextlib.asynccontextmanager
async def workers(*args: str, count: int = 2, **env: str) -> AsyncIterator[Supervised]:
    """`agent-server serve --listen 127.0.0.1:0 --workers COUNT ARGS` on the built-in model,
    its log (at debug: forwarded calls are logged) read as it comes; SIGTERM on the way out."""
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        str(count),
        "--log-level",
        "debug",
        *args,
        env=clean_env(**env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    supervised = Supervised(process, "", {})
    supervised.reader = asyncio.create_task(_read(supervised, process.stderr))
    try:
        async with asyncio.timeout(WAIT_SECONDS):
            ready = (await process.stdout.readline()).decode()
        assert ready.startswith("listening on "), (ready, supervised.stderr())
        supervised.address = ready.removeprefix("listening on ").strip()
        for line in supervised.lines:
            found = re.search(r"worker started worker=(\d+) pid=(\d+)", line)
            if found:
                supervised.pids[int(found.group(1))] = int(found.group(2))
        assert sorted(supervised.pids) == list(range(count)), supervised.stderr()
        yield supervised
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(WAIT_SECONDS):
                await process.wait()
                # Ends when every holder of the stderr pipe, each worker too, has exited.
                await supervised.reader
        finally:
            # No worker outlives a test, whatever it found.
            left = [pid for pid in supervised.pids.values() if not _gone(pid)]
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        assert not left, f"workers left running: {left}"


def fresh_channel(
    address: str, credentials: grpc.ChannelCredentials | None = None
) -> grpc.aio.Channel:
    # A subchannel of its own: a new TCP connection, which the kernel gives either worker.
    options = [("grpc.use_local_subchannel_pool", 1)]
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


Metadata = tuple[tuple[str, str], ...]


async def channel_on(
    supervised: Supervised,
    wanted: Callable[[int], bool],
    metadata: Metadata = (),
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[grpc.aio.Channel, int]:
    """A fresh channel whose connection landed on a worker `wanted` accepts, told by where
    a thread started over it is (StartThread is answered where it lands)."""
    for _ in range(MAX_CHANNELS):
        channel = fresh_channel(supervised.address, credentials)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        probe = (await stub.StartThread(agent_pb2.StartThreadRequest(), metadata=metadata)).thread
        worker = await supervised.owner(probe.id)
        supervised.owners[probe.id] = worker
        if wanted(worker):
            return channel, worker
        await channel.close(None)
    raise AssertionError(f"no connection of {MAX_CHANNELS} reached the worker wanted")


def on(worker: int) -> Callable[[int], bool]:
    return lambda landed: landed == worker


async def start_turn(stub: agent_pb2_grpc.AgentServiceAsyncStub, thread_id: str, text: str) -> str:
    reply = await stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
    )
    return reply.turn.id


async def all_events(
    stub: agent_pb2_grpc.AgentServiceAsyncStub, thread_id: str, until_turn: str
) -> list[agent_pb2.ThreadEvent]:
    """The thread's events from the first up to the end of turn until_turn."""
    log = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id)))
    try:
        await log.turn_completed(until_turn)
        last = next(
            i
            for i, e in enumerate(log.events)
            if e.HasField("turn_completed") and e.turn_id == until_turn
        )
        return log.events[: last + 1]
    finally:
        await log.close()


async def test_every_call_for_a_thread_is_answered_whichever_worker_the_connection_reaches(
    tmp_path: Path,
) -> None:
    async with (
        workers("--trace-root", str(tmp_path / "traces"), "--local-word-delay", "0") as supervised,
        fresh_channel(supervised.address) as channel_a,
    ):
        stub_a = agent_pb2_grpc.AgentServiceStub(channel_a)
        thread = (await stub_a.StartThread(agent_pb2.StartThreadRequest(tools=[LOOKUP]))).thread
        owner = await supervised.owner(thread.id)
        first_turn = await start_turn(stub_a, thread.id, "hello there")
        events_a = await all_events(stub_a, thread.id, first_turn)
        assert events_a[-1].turn_completed.turn.status == agent_pb2.TURN_STATUS_COMPLETED
        got_a = (await stub_a.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))).thread

        # Connections to both workers: the owner and the other one.
        seen: set[int] = set()
        channels: list[tuple[grpc.aio.Channel, int]] = []
        while seen != {0, 1}:
            channel, worker = await channel_on(supervised, lambda w: w not in seen)
            seen.add(worker)
            channels.append((channel, worker))
        try:
            for channel, _ in channels:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                got = await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
                assert got.thread == got_a
                assert await all_events(stub, thread.id, first_turn) == events_a
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.GetThread(agent_pb2.GetThreadRequest(thread_id="thread_none"))
                assert raised.value.code() == grpc.StatusCode.NOT_FOUND
                assert error_reason(raised.value) == "THREAD_NOT_FOUND"
                assert raised.value.details() == "no thread 'thread_none'"
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest()
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            # The owner answered the other worker's calls: they were forwarded.
            assert supervised.forwarded("GetThread", thread.id)
            assert supervised.forwarded("StreamEvents", thread.id)
            assert all(
                f"worker={1 - owner}" in line
                for line in supervised.forwarded("GetThread", thread.id)
            )

            [(other, _)] = [(c, w) for c, w in channels if w != owner]
            stub = agent_pb2_grpc.AgentServiceStub(other)
            # A turn and a function tool round, all through the worker not owning it.
            log = EventLog(
                stub.StreamEvents(
                    agent_pb2.StreamEventsRequest(
                        thread_id=thread.id, after_index=events_a[-1].index
                    )
                )
            )
            tool_turn = await start_turn(stub, thread.id, "please lookup the tallest mountain")
            requested = await log.wait_for(lambda e: e.HasField("tool_call_requested"))
            answered = await stub.SubmitToolOutputs(
                agent_pb2.SubmitToolOutputsRequest(
                    thread_id=thread.id,
                    turn_id=tool_turn,
                    outputs=[
                        agent_pb2.ToolOutput(
                            call_id=requested.tool_call_requested.call_id,
                            output="Mount Everest",
                        )
                    ],
                )
            )
            assert answered.turn.id == tool_turn
            done = await log.turn_completed(tool_turn)
            assert done.status == agent_pb2.TURN_STATUS_COMPLETED
            reply = [
                e.agent_message_delta.delta
                for e in log.events
                if e.turn_id == tool_turn and e.HasField("agent_message_delta")
            ]
            assert "Mount Everest" in "".join(reply)
            # Interrupt a turn waiting for its tool's output.
            waiting = await start_turn(stub, thread.id, "lookup it once more")
            await log.wait_for(lambda e: e.turn_id == waiting and e.HasField("tool_call_requested"))
            stopped = await stub.Interrupt(
                agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=waiting)
            )
            assert stopped.turn.status == agent_pb2.TURN_STATUS_INTERRUPTED
            assert (await log.turn_completed(waiting)).status == (agent_pb2.TURN_STATUS_INTERRUPTED)
            # A refusal comes back with the owner's code and reason.
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Interrupt(
                    agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=waiting)
                )
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error_reason(raised.value) == "TURN_NOT_RUNNING"

            # A client's cancel reaches the owner: its stream to the other worker ends CANCELLED
            # (one of them ended so already, by all_events above).
            def relayed_cancel(line: str) -> bool:
                return (
                    "StreamEvents CANCELLED" in line
                    and "peer=unix:" in line
                    and line.endswith(f"worker={owner}")
                )

            await supervised.count(relayed_cancel, 1)
            # From one before the last event: its first message proves the owner is streaming.
            idle = stub.StreamEvents(
                agent_pb2.StreamEventsRequest(
                    thread_id=thread.id, after_index=log.events[-1].index - 1
                )
            )
            first = await idle.read()
            assert isinstance(first, agent_pb2.StreamEventsResponse)
            assert first.event == log.events[-1]
            idle.cancel()
            await supervised.count(relayed_cancel, 2)
            closed = await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            assert closed.thread.status == agent_pb2.THREAD_STATUS_CLOSED
            # The relayed stream ends when the owner closes the thread, as it would there.
            await log.until_end()
            assert log.error is None
            for rpc in ("StartTurn", "SubmitToolOutputs", "Interrupt", "CloseThread"):
                assert supervised.forwarded(rpc, thread.id), rpc
            again = await stub_a.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
            assert again.thread.status == agent_pb2.THREAD_STATUS_CLOSED
        finally:
            for channel, _ in channels:
                await channel.close(None)
    assert supervised.process.returncode == 0, supervised.stderr()
    rollout = replay_bundle(Path(thread.bundle_path))
    assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert len(rollout.turns) == 3
    assert "Traceback" not in supervised.stderr()


async def test_an_interrupt_whose_caller_leaves_still_reaches_the_owning_worker(
    tmp_path: Path,
) -> None:
    async with workers(
        "--trace-root", str(tmp_path / "traces"), "--local-word-delay", "0"
    ) as supervised:
        channel_a, owner = await channel_on(supervised, lambda _: True)
        channel_b, _ = await channel_on(supervised, lambda worker: worker != owner)
        try:
            stub_a = agent_pb2_grpc.AgentServiceStub(channel_a)
            thread = (await stub_a.StartThread(agent_pb2.StartThreadRequest(tools=[LOOKUP]))).thread
            log = EventLog(stub_a.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id)))
            waiting = await start_turn(stub_a, thread.id, "lookup the tallest mountain")
            await log.wait_for(lambda e: e.turn_id == waiting and e.HasField("tool_call_requested"))
            # The owner cannot answer until the caller has given up: its deadline passes while
            # the other worker still holds the call.
            os.kill(supervised.pids[owner], signal.SIGSTOP)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await agent_pb2_grpc.AgentServiceStub(channel_b).Interrupt(
                        agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=waiting),
                        timeout=2,
                    )
                assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                os.kill(supervised.pids[owner], signal.SIGCONT)
            # Was: the other worker dropped it with its caller; the turn waited on for its
            # tool's output, as if nobody had asked.
            async with asyncio.timeout(WAIT_SECONDS):
                ended = await log.turn_completed(waiting)
            assert ended.status == agent_pb2.TURN_STATUS_INTERRUPTED
            await log.close()
            await stub_a.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        finally:
            await channel_a.close(None)
            await channel_b.close(None)
    assert supervised.process.returncode == 0, supervised.stderr()
    assert "Traceback" not in supervised.stderr()
    rollout = replay_bundle(Path(thread.bundle_path))
    assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    # Recorded as asked by the caller the first worker saw, through the owner.
    assert rollout.turns[waiting].execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert rollout.turns[waiting].interrupt.requested_by


async def test_calls_carried_after_their_callers_left_are_bounded() -> None:
    async with workers() as supervised:
        channel, landed = await channel_on(supervised, lambda _: True)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        # The other worker, asked who holds each thread, does not answer: every call is held
        # (for the lookup's 10 s) after its caller's deadline.
        stopped = supervised.pids[1 - landed]
        os.kill(stopped, signal.SIGSTOP)
        try:

            async def leaving(number: int) -> None:
                request = agent_pb2.InterruptRequest(thread_id=f"gone-{number}", turn_id="t")
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Interrupt(request, timeout=0.5)
                assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            await asyncio.gather(*map(leaving, range(_CARRIED_HELD + 1)))
            # Was: every one held, ~9 KB each, whatever their number (180 MB for 20,000).
            warned = await supervised.line(lambda line: "are not carried" in line)
            assert f"held={_CARRIED_HELD}" in warned
        finally:
            os.kill(stopped, signal.SIGCONT)
            await channel.close(None)
    assert supervised.process.returncode == 0, supervised.stderr()
    assert "Traceback" not in supervised.stderr()
    dropped = [line for line in supervised.lines if "was not carried" in line]
    assert len(dropped) == 1, dropped
    assert sum("are not carried" in line for line in supervised.lines) == 1


async def test_forks_rewards_and_resumes_find_the_thread_from_either_worker(
    tmp_path: Path,
) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with workers(
        "--trace-root",
        str(tmp_path / "traces"),
        "--local-word-delay",
        "0",
        "--closed-thread-retention",
        "0",
    ) as supervised:
        home, owner = await channel_on(supervised, lambda w: True)
        away, _ = await channel_on(supervised, lambda w: w != owner)
        try:
            stub = agent_pb2_grpc.AgentServiceStub(away)
            thread = (
                await agent_pb2_grpc.AgentServiceStub(home).StartThread(
                    agent_pb2.StartThreadRequest()
                )
            ).thread
            # The caller's traceparent reaches the owner with the forwarded StartTurn.
            turn = (
                await stub.StartTurn(
                    agent_pb2.StartTurnRequest(
                        thread_id=thread.id, input=[agent_pb2.UserInput(text="hi")]
                    ),
                    metadata=(("traceparent", traceparent),),
                )
            ).turn.id
            await all_events(stub, thread.id, turn)
            forks = await stub.ForkThread(
                agent_pb2.ForkThreadRequest(thread_id=thread.id, after_turn_id=turn, count=2)
            )
            assert len(forks.threads) == 2
            for fork in forks.threads:
                # Made by the owner, from its memory: found from the other worker too.
                assert await supervised.owner(fork.id) == owner
                got = await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=fork.id))
                assert got.thread.fork.parent_thread_id == thread.id
            reward = await stub.RecordReward(
                agent_pb2.RecordRewardRequest(thread_id=thread.id, name="score", value=1.0)
            )
            assert reward.bundle_path == thread.bundle_path
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            # Forgotten at once (retention 0): the next calls find it nowhere in memory.
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
            assert error_reason(raised.value) == "THREAD_NOT_FOUND"
            # From its bundle, by the one worker its id hashes to, from either connection.
            second = await stub.RecordReward(
                agent_pb2.RecordRewardRequest(thread_id=thread.id, name="score", value=0.5)
            )
            assert second.seq == reward.seq + 1
            resumed = (
                await agent_pb2_grpc.AgentServiceStub(home).ResumeThread(
                    agent_pb2.ResumeThreadRequest(thread_id=thread.id)
                )
            ).thread
            assert resumed.fork.parent_thread_id == thread.id
            for channel in (home, away):
                got = await agent_pb2_grpc.AgentServiceStub(channel).GetThread(
                    agent_pb2.GetThreadRequest(thread_id=resumed.id)
                )
                assert got.thread.id == resumed.id
        finally:
            await home.close(None)
            await away.close(None)
    assert supervised.process.returncode == 0
    assert supervised.forwarded("ForkThread", thread.id)
    assert supervised.forwarded("RecordReward", thread.id)
    assert supervised.forwarded("StartTurn", thread.id)
    recorded = (Path(thread.bundle_path) / "trace.binpb").read_bytes()
    assert traceparent.encode() in recorded


async def test_a_token_is_asked_of_every_call_on_every_worker(tmp_path: Path) -> None:
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    marker: Metadata = (("x-rollout-forwarded", "1"),)
    unmarked: Metadata = ()
    async with workers("--auth-token-env", "AGENT_TOKEN", AGENT_TOKEN=TOKEN) as supervised:
        opened = [(await channel_on(supervised, on(worker), bearer))[0] for worker in (0, 1)]
        # A thread of each worker: the last probe of each.
        threads = {worker: thread for thread, worker in supervised.owners.items()}
        try:
            for channel in opened:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                for thread_id in threads.values():
                    for metadata in (unmarked, marker):
                        with pytest.raises(grpc.aio.AioRpcError) as raised:
                            await stub.GetThread(
                                agent_pb2.GetThreadRequest(thread_id=thread_id), metadata=metadata
                            )
                        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert error_reason(raised.value) == "MISSING_TOKEN"
                    # With the token, the marker of a forwarded call changes nothing from
                    # outside: the other worker's thread is still found.
                    for metadata in (bearer, (*bearer, *marker)):
                        got = await stub.GetThread(
                            agent_pb2.GetThreadRequest(thread_id=thread_id), metadata=metadata
                        )
                        assert got.thread.id == thread_id
            # The workers' private sockets ask for the token too, marked or not.
            socket_dir = _socket_dir(supervised.pids[0])
            assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
            for worker in (0, 1):
                path = socket_dir / f"worker-{worker}.sock"
                async with grpc.aio.insecure_channel(f"unix:{path}") as private:
                    stub = agent_pb2_grpc.AgentServiceStub(private)
                    for metadata in (unmarked, marker):
                        with pytest.raises(grpc.aio.AioRpcError) as raised:
                            await stub.GetThread(
                                agent_pb2.GetThreadRequest(thread_id=threads[worker]),
                                metadata=metadata,
                            )
                        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert error_reason(raised.value) == "MISSING_TOKEN"
        finally:
            for channel in opened:
                await channel.close(None)
    assert supervised.process.returncode == 0
    assert not socket_dir.exists()


async def test_tls_on_the_address_and_the_token_on_the_private_sockets(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    bearer: Metadata = (("authorization", f"Bearer {TOKEN}"),)
    tls = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with workers(
        "--auth-token-env",
        "AGENT_TOKEN",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        AGENT_TOKEN=TOKEN,
    ) as supervised:
        first, owner = await channel_on(supervised, lambda w: True, bearer, tls)
        second, _ = await channel_on(supervised, lambda w: w != owner, bearer, tls)
        try:
            # The first probe: the thread `first` started, on `owner`.
            thread_id = next(iter(supervised.owners))
            got = await agent_pb2_grpc.AgentServiceStub(second).GetThread(
                agent_pb2.GetThreadRequest(thread_id=thread_id), metadata=bearer
            )
            assert got.thread.id == thread_id
            assert supervised.forwarded("GetThread", thread_id)
        finally:
            await first.close(None)
            await second.close(None)
    assert supervised.process.returncode == 0


def _socket_dir(pid: int) -> Path:
    """The socket directory a worker was started with (its _ROLLOUT_WORKER=INDEX:DIR)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    [role] = [entry for entry in environ if entry.startswith(b"_ROLLOUT_WORKER=")]
    return Path(role.decode().partition(":")[2])


async def test_list_threads_pages_through_every_workers_threads_once(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with workers("--trace-root", str(traces), "--closed-thread-retention", "0") as supervised:
        opened: list[grpc.aio.Channel] = []
        try:
            # Threads on both workers, two of each at least.
            while (
                sorted(set(supervised.owners.values())) != [0, 1]
                or min(list(supervised.owners.values()).count(w) for w in (0, 1)) < 2
            ):
                channel, _ = await channel_on(supervised, lambda w: True)
                opened.append(channel)
                assert len(opened) <= MAX_CHANNELS
            live = set(supervised.owners)
            # One thread of each worker closed and, at once, forgotten: only its bundle is left.
            gone = {next(t for t, w in supervised.owners.items() if w == k) for k in (0, 1)}
            stub = agent_pb2_grpc.AgentServiceStub(opened[0])
            for thread_id in gone:
                await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
            live -= gone
            for channel in opened[:4]:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                assert await _all_pages(stub, 3, include_recorded=False) == sorted(live)
                with_recorded = await _all_pages(stub, 2, include_recorded=True)
                assert with_recorded == sorted(live | gone)
                active = await _all_pages(stub, 1, status=agent_pb2.THREAD_STATUS_ACTIVE)
                assert active == sorted(live)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.ListThreads(agent_pb2.ListThreadsRequest(page_token="bogus"))
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error_reason(raised.value) == "INVALID_PAGE_TOKEN"
                # The listing over every worker checks its filter as one worker does.
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.ListThreads(agent_pb2.ListThreadsRequest(status=99))  # type: ignore[arg-type]
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error_reason(raised.value) == "INVALID_STATUS_FILTER"
        finally:
            for channel in opened:
                await channel.close(None)
    assert supervised.process.returncode == 0


async def _all_pages(
    stub: agent_pb2_grpc.AgentServiceAsyncStub,
    size: int,
    *,
    include_recorded: bool = False,
    status: agent_pb2.ThreadStatus.ValueType = agent_pb2.THREAD_STATUS_UNSPECIFIED,
) -> list[str]:
    """Every thread id of every page, in order; each page at most `size` long. Sorted by the
    caller's comparison, after checking that none came twice."""
    ids: list[str] = []
    token = ""
    while True:
        reply = await stub.ListThreads(
            agent_pb2.ListThreadsRequest(
                page_size=size, page_token=token, include_recorded=include_recorded, status=status
            )
        )
        assert len(reply.threads) <= size
        ids.extend(thread.id for thread in reply.threads)
        token = reply.next_page_token
        if not token:
            break
        assert len(reply.threads) == size
    assert len(ids) == len(set(ids)), ids
    return sorted(ids)


async def test_sigterm_drains_every_worker_and_each_bundle_reduces_clean(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    async with workers("--trace-root", str(traces), "--local-word-delay", "0.05") as supervised:
        opened: list[grpc.aio.Channel] = []
        logs: list[EventLog] = []
        try:
            for worker in (0, 1):
                channel, _ = await channel_on(supervised, on(worker))
                opened.append(channel)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
                log = EventLog(
                    stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id))
                )
                logs.append(log)
                await start_turn(stub, thread.id, "tell me a long story about the sea " * 5)
                # Running: its first words have come.
                await log.wait_for(lambda e: e.HasField("agent_message_delta"))
            supervised.process.send_signal(signal.SIGTERM)
            for log in logs:
                await log.until_end()
        finally:
            for log in logs:
                await log.close()
            for channel in opened:
                await channel.close(None)
        async with asyncio.timeout(WAIT_SECONDS):
            assert await supervised.process.wait() == 0
    bundles = sorted(traces.iterdir())
    assert len(bundles) == len(supervised.owners) + 2
    for bundle in bundles:
        rollout = replay_bundle(bundle)
        assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN, bundle
    # The two running turns were ended by the shutdown, and recorded so.
    turns = [turn for bundle in bundles for turn in replay_bundle(bundle).turns.values()]
    assert len(turns) == 2
    assert "Traceback" not in supervised.stderr()


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (nothing reaps orphans in some containers)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return status.rpartition(")")[2].split()[0] == "Z"


async def _until_gone(pids: list[int]) -> None:
    """Wait, bounded, until each process has ended: its pidfd turns readable then."""
    loop = asyncio.get_running_loop()
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        ended = asyncio.Event()
        loop.add_reader(fd, ended.set)
        try:
            async with asyncio.timeout(WAIT_SECONDS):
                await ended.wait()
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        assert _gone(pid)


async def test_the_workers_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    async with workers("--trace-root", str(tmp_path / "traces")) as supervised:
        pids = list(supervised.pids.values())
        assert not any(_gone(pid) for pid in pids)
        socket_dir = _socket_dir(pids[0])
        supervised.process.kill()
        await _until_gone(pids)
    assert supervised.process.returncode == -signal.SIGKILL
    # Each drained as on SIGTERM.
    assert supervised.stderr().count("the supervisor is gone: shutting down") == 2
    # The last worker out removed the socket directory the supervisor could not.
    assert not socket_dir.exists()


async def test_a_dead_worker_stops_the_supervisor_naming_it(tmp_path: Path) -> None:
    async with workers("--trace-root", str(tmp_path / "traces")) as supervised:
        victim = supervised.pids[1]
        survivor = supervised.pids[0]
        socket_dir = _socket_dir(victim)
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(WAIT_SECONDS):
            code = await supervised.process.wait()
        await _until_gone([survivor])
    assert code == 1
    assert f"worker 1 (pid {victim}) was killed by SIGKILL; stopping the other workers" in (
        supervised.stderr()
    )
    assert not socket_dir.exists()
    assert "Traceback" not in supervised.stderr()


@pytest.mark.parametrize(
    ("args", "env", "config", "message"),
    [
        (["--workers", "2", "--replay-from", "x"], {}, None, "--replay-from"),
        (["--workers", "2", "--metrics-listen", "127.0.0.1:0"], {}, None, "--metrics-listen"),
        (
            [],
            {"ROLLOUT_WORKERS": "2", "ROLLOUT_METRICS_LISTEN": "127.0.0.1:0"},
            None,
            "--metrics-listen",
        ),
        ([], {}, 'workers = 3\nmetrics-listen = "127.0.0.1:0"\n', "--metrics-listen"),
        (["--workers", "0"], {}, None, "1 or more"),
        ([], {"ROLLOUT_WORKERS": "two"}, None, "an integer"),
    ],
)
async def test_what_workers_cannot_share_is_refused(
    tmp_path: Path, args: list[str], env: dict[str, str], config: str | None, message: str
) -> None:
    if config is not None:
        (tmp_path / "agent.toml").write_text(config)
        args = [*args, "--config", str(tmp_path / "agent.toml")]
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--listen",
        "127.0.0.1:0",
        *args,
        env=clean_env(**env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 2
    text = stderr.decode()
    assert text.startswith("agent-server: --workers"), text
    assert message in text
    assert "Traceback" not in text
    assert stdout == b""


async def test_one_worker_is_the_one_process_server() -> None:
    async with (
        serve("--workers", "1") as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
        got = await stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread.id))
        assert got.thread.id == thread.id
    assert served.process.returncode == 0
    stderr = served.stderr.decode()
    # No supervisor, no worker field, no private socket.
    assert "agent_server.workers" not in stderr
    assert "worker=" not in stderr


async def test_a_worker_role_not_made_by_a_supervisor_is_refused() -> None:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "serve",
        "--listen",
        "127.0.0.1:0",
        env=clean_env(_ROLLOUT_WORKER="seven"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    assert process.returncode == 2
    assert stderr.decode().startswith("agent-server: _ROLLOUT_WORKER is set by `serve --workers N`")
