"""AgentClient, Thread and Turn: the agent's gRPC API as typed async Python."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar, Unpack

import grpc

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc

from ._channel import HEALTH_CHECK, Connection
from ._defaults import DEFAULT_TIMEOUT, address_from_env, token_from_env
from ._errors import (
    OutOfRangeError,
    RolloutError,
    RpcError,
    StreamEndedError,
    error_from_rpc,
)
from ._options import (
    CallOptions,
    ForkOptions,
    RewardOptions,
    ThreadOptions,
    TurnOptions,
    call_options,
    fork_thread_request,
    record_reward_request,
    start_thread_request,
    start_turn_request,
)
from ._tools import ToolCalls, ToolHandlers

DEFAULT_RECONNECT_TIMEOUT = 30.0
_SERVICE = "rollout.agent.v1.AgentService"
# The calls that change nothing, retried by the channel on UNAVAILABLE.
IDEMPOTENT_CALLS = ((_SERVICE, "GetThread"), (_SERVICE, "ListThreads"), HEALTH_CHECK)
# How often a turn skips ahead to the oldest event the server still holds before giving up.
_MAX_SKIPS = 10
# Pauses between attempts to resume a stream whose connection dropped: doubling, capped.
_RESUME_FIRST_PAUSE = 0.05
_RESUME_MAX_PAUSE = 1.0

_T = TypeVar("_T")
# A unary method of a generated aio stub.
UnaryMethod = Callable[..., Awaitable[_T]]


def _dropped(error: grpc.aio.AioRpcError) -> bool:
    """Whether a failed stream lost its connection (and may resume) rather than being refused.

    A refusal by the server carries an ErrorInfo (a shutting-down server says SHUTTING_DOWN);
    a connection cut under a stream is a bare UNAVAILABLE ("Socket closed"), and a stream the
    transport reset (RST_STREAM) a bare INTERNAL.
    """
    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
        return False
    return not error_from_rpc(error).reason


class AgentClient(Connection):
    """A connection to an agent server: `async with AgentClient(address) as client: ...`.

    `address` defaults to $ROLLOUT_ADDRESS, else 127.0.0.1:50051. `token` (default
    $ROLLOUT_TOKEN) is sent as `authorization: Bearer <token>` on every call. `tls` is False for
    plaintext, True for TLS trusting the system's certificate authorities, or the path of a
    PEM file of the certificates to trust. Every unary call has a deadline of `timeout` seconds
    (None: none), which a call's own `timeout=` or `with_options(timeout=...)` replaces; the
    calls that change nothing (GetThread, ListThreads) are retried with backoff while the
    server is unavailable. A stream whose connection drops is resumed for up to
    `reconnect_timeout` seconds.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: bool | str | Path = False,
        timeout: float | None = DEFAULT_TIMEOUT,
        reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
    ) -> None:
        super().__init__(
            address or address_from_env(),
            tls,
            IDEMPOTENT_CALLS,
            token or token_from_env(),
            timeout,
        )
        self.reconnect_timeout = reconnect_timeout
        self.stub = agent_pb2_grpc.AgentServiceStub(self._channel)

    def with_options(self, *, timeout: float | None) -> AgentClient:
        """This client (the same connection) with another default timeout for its calls."""
        client = copy.copy(self)
        client.timeout = timeout
        return client

    async def unary(self, call: Awaitable[_T]) -> _T:
        """Await a call made on `stub`; a failure comes out as the RpcError of its status."""
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    async def call(
        self, method: UnaryMethod[_T], request: object, **options: Unpack[CallOptions]
    ) -> _T:
        """Call a unary method of `stub` with this client's token and deadline."""
        timeout = options.get("timeout", self.timeout)
        return await self.unary(method(request, metadata=self.metadata, timeout=timeout))

    async def wait_until_reachable(self, seconds: float) -> bool:
        """Wait up to `seconds` for the connection to be (re)established."""
        try:
            async with asyncio.timeout(seconds):
                await self._channel.channel_ready()
        except TimeoutError:
            return False
        return True

    async def start_thread(self, **options: Unpack[ThreadOptions]) -> Thread:
        """Create a thread (see ThreadOptions for what it takes)."""
        request = start_thread_request(options)
        reply = await self.call(self.stub.StartThread, request, **call_options(options))
        return Thread(self, reply.thread)

    async def thread(self, thread_id: str, **options: Unpack[CallOptions]) -> Thread:
        """A thread that already exists (GetThread), to run turns on or follow."""
        info = await self._get_thread(thread_id, options)
        return Thread(self, info)

    async def _get_thread(self, thread_id: str, options: CallOptions) -> agent_pb2.Thread:
        request = agent_pb2.GetThreadRequest(thread_id=thread_id)
        reply = await self.call(self.stub.GetThread, request, **options)
        return reply.thread

    async def list_threads(
        self,
        *,
        status: agent_pb2.ThreadStatus.ValueType = agent_pb2.THREAD_STATUS_UNSPECIFIED,
        page_size: int = 0,
        include_recorded: bool = False,
        **options: Unpack[CallOptions],
    ) -> list[agent_pb2.Thread]:
        """Every thread the server keeps (optionally only those with status), oldest first;
        with include_recorded, then the threads recorded under its trace root that it no
        longer holds (`recorded` set), which fork_thread and resume_thread continue."""
        threads: list[agent_pb2.Thread] = []
        token = ""
        while True:
            request = agent_pb2.ListThreadsRequest(
                page_size=page_size,
                page_token=token,
                status=status,
                include_recorded=include_recorded,
            )
            reply = await self.call(self.stub.ListThreads, request, **options)
            threads.extend(reply.threads)
            token = reply.next_page_token
            if not token:
                return threads

    async def fork_thread(
        self, thread_id: str, count: int = 1, **options: Unpack[ForkOptions]
    ) -> list[Thread]:
        """`count` new threads (1-64) continuing the thread (see ForkOptions), in repetition
        order."""
        request = fork_thread_request(thread_id, count, options)
        reply = await self.call(self.stub.ForkThread, request, **call_options(options))
        return [Thread(self, info) for info in reply.threads]

    async def resume_thread(
        self,
        thread_id: str = "",
        *,
        after_turn_id: str = "",
        bundle_path: str = "",
        **options: Unpack[CallOptions],
    ) -> Thread:
        """A new thread continuing a closed or recorded one (found by its id in memory or
        under the server's trace root, or named by bundle_path) after its last ended turn,
        or after after_turn_id: ResumeThread."""
        request = agent_pb2.ResumeThreadRequest(
            thread_id=thread_id, bundle_path=bundle_path, after_turn_id=after_turn_id
        )
        reply = await self.call(self.stub.ResumeThread, request, **options)
        return Thread(self, reply.thread)

    async def record_reward(
        self, thread_id: str, name: str, value: float, **options: Unpack[RewardOptions]
    ) -> agent_pb2.RecordRewardResponse:
        """Record a reward for a thread (or one of its turns or items: RewardOptions) beside
        its bundle; closed threads too. Returns where it went (the bundle and its seq in
        rewards.binpb)."""
        request = record_reward_request(thread_id, name, value, options)
        return await self.call(self.stub.RecordReward, request, **call_options(options))


class Thread:
    """A thread of the server: run turns on it, follow its events, close it.

    `info` is the thread as the server last described it (refreshed by close() and refresh()).
    """

    def __init__(self, client: AgentClient, info: agent_pb2.Thread) -> None:
        self.client = client
        self.info = info
        # The highest event index this client has seen: a new turn's events come after it.
        self.last_index = 0

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def model(self) -> str:
        return self.info.model

    @property
    def bundle_path(self) -> str:
        """Where the thread is recorded (an absolute path); empty when the server does not
        record."""
        return self.info.bundle_path

    def run_turn(
        self, *texts: str, tools: ToolHandlers | None = None, **options: Unpack[TurnOptions]
    ) -> Turn:
        """A turn with these texts as the user's input; it starts when first iterated or
        awaited through start() / wait(). `options` override the thread's sampling settings
        for this turn.

        With `tools` (handlers by tool name, or `function_tool` functions), each tool call of
        the turn is answered by the handler of that name (called with the call's arguments;
        what it returns, or the error it raises, is the output), while the events,
        tool_call_requested included, still come out of the turn. Without, answer them
        yourself with submit_tool_output().
        """
        return Turn(self, texts, tools, options)

    async def refresh(self, **options: Unpack[CallOptions]) -> agent_pb2.Thread:
        self.info = await self.client._get_thread(self.id, options)
        return self.info

    async def close(self, **options: Unpack[CallOptions]) -> agent_pb2.Thread:
        """Interrupt a running turn, end the thread and finish its recording."""
        client = self.client
        request = agent_pb2.CloseThreadRequest(thread_id=self.id)
        reply = await client.call(client.stub.CloseThread, request, **options)
        self.info = reply.thread
        return self.info

    async def fork(self, count: int = 1, **options: Unpack[ForkOptions]) -> list[Thread]:
        """AgentClient.fork_thread of this thread."""
        return await self.client.fork_thread(self.id, count, **options)

    async def record_reward(
        self, name: str, value: float, **options: Unpack[RewardOptions]
    ) -> agent_pb2.RecordRewardResponse:
        """AgentClient.record_reward for this thread."""
        return await self.client.record_reward(self.id, name, value, **options)

    async def events(self, after_index: int = 0) -> AsyncGenerator[agent_pb2.ThreadEvent, None]:
        """The thread's events after after_index, live ones included, until the thread ends.

        A dropped connection is resumed after the last event received, so no event is missed
        or repeated; OutOfRangeError when the server no longer holds the events needed.
        """
        client = self.client
        position = after_index
        dropped_at: float | None = None
        pause = _RESUME_FIRST_PAUSE
        while True:
            request = agent_pb2.StreamEventsRequest(thread_id=self.id, after_index=position)
            call = client.stub.StreamEvents(request, metadata=client.metadata)
            try:
                async for response in call:
                    dropped_at = None
                    pause = _RESUME_FIRST_PAUSE
                    event = response.event
                    if event.index <= position:
                        continue
                    position = event.index
                    self.last_index = max(self.last_index, position)
                    yield event
                return
            except grpc.aio.AioRpcError as error:
                if not _dropped(error):
                    raise error_from_rpc(error) from None
                now = time.monotonic()
                dropped_at = dropped_at or now
                remaining = client.reconnect_timeout - (now - dropped_at)
                if remaining <= 0 or not await client.wait_until_reachable(remaining):
                    raise error_from_rpc(error) from None
                # A connection that comes back only to drop again must not be hammered.
                await asyncio.sleep(min(pause, remaining))
                pause = min(pause * 2, _RESUME_MAX_PAUSE)
            finally:
                call.cancel()


# The statuses of a turn that has not ended.
_NOT_ENDED = frozenset(
    {
        agent_pb2.TURN_STATUS_UNSPECIFIED,
        agent_pb2.TURN_STATUS_IN_PROGRESS,
        agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS,
    }
)


class Turn:
    """One turn: iterate it for its events (ending with turn_completed), interrupt it, wait.

    `async for event in turn` starts the turn, then yields its events (`rollout.agent.v1.
    ThreadEvent`) up to and including its turn_completed, resuming after a dropped connection.
    """

    def __init__(
        self,
        thread: Thread,
        texts: tuple[str, ...],
        tools: ToolHandlers | None = None,
        options: TurnOptions | None = None,
    ) -> None:
        self.thread = thread
        self._texts = texts
        self._options: TurnOptions = options or {}
        self._tools = ToolCalls(tools, self._submit) if tools is not None else None
        self._awaiting = False
        self._started: agent_pb2.Turn | None = None
        self._after = 0
        self._start_lock = asyncio.Lock()
        self._events_read: AsyncGenerator[agent_pb2.ThreadEvent, None] | None = None
        self.result: agent_pb2.Turn | None = None
        # The turn as interrupt() answered once it had stopped: its status holds from then,
        # before the events that say so are read.
        self._stopped: agent_pb2.Turn | None = None
        self._text: list[str] = []
        self._own_events = 0

    @property
    def id(self) -> str:
        if self._started is None:
            raise RolloutError("the turn has not started yet")
        return self._started.id

    @property
    def status(self) -> agent_pb2.TurnStatus.ValueType:
        """As of the last event read: IN_PROGRESS, AWAITING_TOOL_OUTPUTS while the turn waits
        for tool outputs, then how it ended once turn_completed was read, or once interrupt()
        returned (it returns when the turn has stopped)."""
        if self.result is not None:
            return self.result.status
        if self._stopped is not None:
            return self._stopped.status
        if self._started is None:
            return agent_pb2.TURN_STATUS_UNSPECIFIED
        if self._awaiting:
            return agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS
        return agent_pb2.TURN_STATUS_IN_PROGRESS

    @property
    def status_name(self) -> str:
        """The status without its prefix: COMPLETED, INTERRUPTED, FAILED, IN_PROGRESS."""
        return agent_pb2.TurnStatus.Name(self.status).removeprefix("TURN_STATUS_")

    @property
    def text(self) -> str:
        """The reply text streamed so far (refusals left out)."""
        return "".join(self._text)

    async def start(self) -> agent_pb2.Turn:
        """Start the turn (once); returns it IN_PROGRESS."""
        async with self._start_lock:
            if self._started is None:
                thread = self.thread
                client = thread.client
                self._after = thread.last_index
                request = start_turn_request(thread.id, self._texts, self._options)
                reply = await client.call(
                    client.stub.StartTurn, request, **call_options(self._options)
                )
                self._started = reply.turn
            return self._started

    def __aiter__(self) -> AsyncIterator[agent_pb2.ThreadEvent]:
        if self._events_read is not None:
            raise RolloutError("a turn's events can be read once (wait() reads what is left)")
        self._events_read = self._events()
        return self._events_read

    async def _events(self) -> AsyncGenerator[agent_pb2.ThreadEvent, None]:
        await self.start()
        try:
            async with contextlib.aclosing(self._follow(self._after)) as events:
                async for event in events:
                    if self._tools is not None:
                        self._tools.observe(event)
                    yield event
                    if self._tools is not None and self._tools.error is not None:
                        raise self._tools.error
                    if event.HasField("turn_completed"):
                        return
        finally:
            if self._tools is not None:
                await self._tools.aclose()
        raise StreamEndedError(f"the event stream of thread {self.thread.id} ended mid-turn")

    async def _follow(self, after: int) -> AsyncGenerator[agent_pb2.ThreadEvent, None]:
        """This turn's events. A client that never saw the thread's earlier events may start
        after events the server no longer holds: it skips to the oldest one held (those belong
        to earlier turns), and fails only if this turn's own first events are gone too."""
        stream = self.thread.events(after)
        received = False
        skips = 0
        try:
            while True:
                try:
                    event = await anext(stream)
                except StopAsyncIteration:
                    return
                except OutOfRangeError as error:
                    oldest = error.metadata.get("first_index", "")
                    if received or not oldest.isdigit() or skips == _MAX_SKIPS:
                        raise
                    # The window slides with every event published meanwhile: try again.
                    skips += 1
                    stream = self.thread.events(int(oldest) - 1)
                    continue
                received = True
                if event.turn_id != self.id:
                    continue
                if not self._own_events and not event.HasField("turn_started"):
                    raise OutOfRangeError(
                        grpc.StatusCode.OUT_OF_RANGE,
                        f"the first events of turn {self.id} are no longer buffered",
                        reason="EVENT_INDEX_OUT_OF_RANGE",
                    )
                self._own_events += 1
                self._observe(event)
                yield event
        finally:
            await stream.aclose()

    def _observe(self, event: agent_pb2.ThreadEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind != "tool_call_completed":
            self._awaiting = kind == "turn_awaiting_tool_outputs"
        if kind == "agent_message_delta" and not event.agent_message_delta.refusal:
            self._text.append(event.agent_message_delta.delta)
        elif kind == "turn_completed":
            self.result = event.turn_completed.turn

    async def interrupt(self) -> agent_pb2.Turn:
        """Stop the turn; returns once it has stopped (INTERRUPTED), or as it ended when it
        had already ended. Its events still run to turn_completed."""
        started = await self.start()
        thread = self.thread
        client = thread.client
        request = agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=started.id)
        try:
            reply = await client.call(client.stub.Interrupt, request, **call_options(self._options))
        except RpcError as error:
            if error.reason != "TURN_NOT_RUNNING":
                raise
            info = await thread.refresh()
            ended = next(turn for turn in info.turns if turn.id == started.id)
            self._stopped_at(ended)
            return ended
        self._stopped_at(reply.turn)
        return reply.turn

    def _stopped_at(self, turn: agent_pb2.Turn) -> None:
        # Was: status stayed IN_PROGRESS after interrupt() returned INTERRUPTED, until the
        # turn's remaining events were read.
        if turn.status not in _NOT_ENDED:
            self._stopped = turn

    async def submit_tool_output(
        self, call_id: str, output: str, *, is_error: bool = False
    ) -> agent_pb2.Turn:
        """Answer one tool call of this turn (is_error: the output describes a failure)."""
        thread = self.thread
        client = thread.client
        request = agent_pb2.SubmitToolOutputsRequest(
            thread_id=thread.id,
            turn_id=self.id,
            outputs=[agent_pb2.ToolOutput(call_id=call_id, output=output, is_error=is_error)],
        )
        reply = await client.call(
            client.stub.SubmitToolOutputs, request, **call_options(self._options)
        )
        return reply.turn

    async def _submit(self, call_id: str, output: str, is_error: bool) -> object:
        return await self.submit_tool_output(call_id, output, is_error=is_error)

    async def wait(self) -> agent_pb2.Turn:
        """Read what is left of the turn's events (all of them, when none were read yet) and
        return how it ended."""
        events = self._events_read if self._events_read is not None else aiter(self)
        if self.result is None:
            async for _ in events:
                pass
        if self.result is None:
            raise RolloutError("the turn's events ended with an error, before turn_completed")
        return self.result
