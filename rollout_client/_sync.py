"""The blocking facade for scripts and notebooks: the async client on a loop of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import signal
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, Unpack

from rollout.agent.v1 import agent_pb2

from ._client import DEFAULT_RECONNECT_TIMEOUT, AgentClient, Thread, Turn
from ._defaults import DEFAULT_TIMEOUT
from ._options import CallOptions, ForkOptions, RewardOptions, ThreadOptions, TurnOptions
from ._tools import Tool

_T = TypeVar("_T")
_PROGRAM_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


class _Loop:
    """An event loop running in a daemon thread; coroutines are handed to it and awaited."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rollout-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A signal the program handles (Ctrl-C's SIGINT) must go to the main thread: delivered
        # to another one, it would not interrupt the main thread's blocking call (input(), say)
        # until that returned by itself. Threads started from here (gRPC's, the executor's)
        # inherit the mask.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _PROGRAM_SIGNALS)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return self.submit(coroutine).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncAgentClient:
    """AgentClient for code that does not use asyncio: `with SyncAgentClient(address) as c:`.

    Same arguments and errors as AgentClient; every call blocks until it is done. Ctrl-C
    (KeyboardInterrupt) while a turn's events are read leaves the turn readable: catch it,
    call turn.interrupt(), and keep iterating to its turn_completed.
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
        self._loop = _Loop()

        async def connect() -> AgentClient:
            return AgentClient(
                address,
                token=token,
                tls=tls,
                timeout=timeout,
                reconnect_timeout=reconnect_timeout,
            )

        try:
            self.client = self._loop.run(connect())
        except BaseException:
            self._loop.stop()
            raise

    def __enter__(self) -> SyncAgentClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._loop.run(self.client.close())
        finally:
            self._loop.stop()

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def timeout(self) -> float | None:
        return self.client.timeout

    def with_options(self, *, timeout: float | None) -> SyncAgentClient:
        """This client (the same connection and loop) with another default timeout for its
        calls, as AgentClient.with_options: closing either closes the connection."""
        other = copy.copy(self)
        other.client = self.client.with_options(timeout=timeout)
        return other

    def start_thread(self, **options: Unpack[ThreadOptions]) -> SyncThread:
        return SyncThread(self._loop, self._loop.run(self.client.start_thread(**options)))

    def thread(self, thread_id: str, **options: Unpack[CallOptions]) -> SyncThread:
        return SyncThread(self._loop, self._loop.run(self.client.thread(thread_id, **options)))

    def list_threads(
        self,
        *,
        status: agent_pb2.ThreadStatus.ValueType = agent_pb2.THREAD_STATUS_UNSPECIFIED,
        page_size: int = 0,
        include_recorded: bool = False,
        **options: Unpack[CallOptions],
    ) -> list[agent_pb2.Thread]:
        return self._loop.run(
            self.client.list_threads(
                status=status, page_size=page_size, include_recorded=include_recorded, **options
            )
        )

    def fork_thread(
        self, thread_id: str, count: int = 1, **options: Unpack[ForkOptions]
    ) -> list[SyncThread]:
        forks = self._loop.run(self.client.fork_thread(thread_id, count, **options))
        return [SyncThread(self._loop, thread) for thread in forks]

    def resume_thread(
        self,
        thread_id: str = "",
        *,
        after_turn_id: str = "",
        bundle_path: str = "",
        **options: Unpack[CallOptions],
    ) -> SyncThread:
        resumed = self.client.resume_thread(
            thread_id, after_turn_id=after_turn_id, bundle_path=bundle_path, **options
        )
        return SyncThread(self._loop, self._loop.run(resumed))

    def record_reward(
        self, thread_id: str, name: str, value: float, **options: Unpack[RewardOptions]
    ) -> agent_pb2.RecordRewardResponse:
        return self._loop.run(self.client.record_reward(thread_id, name, value, **options))


class SyncThread:
    """Thread, blocking."""

    def __init__(self, loop: _Loop, thread: Thread) -> None:
        self._loop = loop
        self.thread = thread

    @property
    def id(self) -> str:
        return self.thread.id

    @property
    def model(self) -> str:
        return self.thread.model

    @property
    def info(self) -> agent_pb2.Thread:
        return self.thread.info

    @property
    def bundle_path(self) -> str:
        return self.thread.bundle_path

    def run_turn(
        self,
        *texts: str,
        tools: Mapping[str, Callable[[dict[str, Any]], object]] | Sequence[Tool] | None = None,
        **options: Unpack[TurnOptions],
    ) -> SyncTurn:
        """Thread.run_turn; the tool handlers are plain functions, run in worker threads
        (a `function_tool` of a coroutine function runs on the client's loop)."""
        handlers = None
        if isinstance(tools, Mapping):
            handlers = {name: _in_worker(function) for name, function in tools.items()}
        elif tools is not None:
            handlers = {tool.name: _tool_handler(tool) for tool in tools}
        return SyncTurn(self._loop, self.thread.run_turn(*texts, tools=handlers, **options))

    def refresh(self, **options: Unpack[CallOptions]) -> agent_pb2.Thread:
        return self._loop.run(self.thread.refresh(**options))

    def close(self, **options: Unpack[CallOptions]) -> agent_pb2.Thread:
        return self._loop.run(self.thread.close(**options))

    def fork(self, count: int = 1, **options: Unpack[ForkOptions]) -> list[SyncThread]:
        forks = self._loop.run(self.thread.fork(count, **options))
        return [SyncThread(self._loop, thread) for thread in forks]

    def record_reward(
        self, name: str, value: float, **options: Unpack[RewardOptions]
    ) -> agent_pb2.RecordRewardResponse:
        return self._loop.run(self.thread.record_reward(name, value, **options))


class SyncTurn:
    """Turn, blocking: iterate it for its events; interrupt(); wait()."""

    def __init__(self, loop: _Loop, turn: Turn) -> None:
        self._loop = loop
        self.turn = turn
        self._events: AsyncIterator[agent_pb2.ThreadEvent] | None = None
        # The read in flight: a KeyboardInterrupt abandons the wait, not the read, which the
        # next __next__ picks up again (an async generator takes one read at a time).
        self._pending: concurrent.futures.Future[agent_pb2.ThreadEvent] | None = None

    @property
    def id(self) -> str:
        return self.turn.id

    @property
    def status(self) -> agent_pb2.TurnStatus.ValueType:
        return self.turn.status

    @property
    def status_name(self) -> str:
        return self.turn.status_name

    @property
    def result(self) -> agent_pb2.Turn | None:
        return self.turn.result

    @property
    def text(self) -> str:
        return self.turn.text

    def start(self) -> agent_pb2.Turn:
        return self._loop.run(self.turn.start())

    def __iter__(self) -> Iterator[agent_pb2.ThreadEvent]:
        return self

    def __next__(self) -> agent_pb2.ThreadEvent:
        if self._pending is None:
            if self._events is None:
                self._events = aiter(self.turn)
            self._pending = self._loop.submit(_next(self._events))
        try:
            event = self._pending.result()
        except StopAsyncIteration:
            self._pending = None
            raise StopIteration from None
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._pending = None
            raise
        self._pending = None
        return event

    def interrupt(self) -> agent_pb2.Turn:
        return self._loop.run(self.turn.interrupt())

    def interrupt_nowait(self) -> concurrent.futures.Future[agent_pb2.Turn]:
        """Ask for the interrupt without waiting for it: safe from a signal handler."""
        return self._loop.submit(self.turn.interrupt())

    def submit_tool_output(
        self, call_id: str, output: str, *, is_error: bool = False
    ) -> agent_pb2.Turn:
        return self._loop.run(self.turn.submit_tool_output(call_id, output, is_error=is_error))

    def wait(self) -> agent_pb2.Turn:
        for _ in self:
            pass
        return self._loop.run(self.turn.wait())


async def _next(events: AsyncIterator[agent_pb2.ThreadEvent]) -> agent_pb2.ThreadEvent:
    return await anext(events)


def _in_worker(
    function: Callable[[dict[str, Any]], object],
) -> Callable[[dict[str, Any]], Awaitable[object]]:
    async def handler(arguments: dict[str, Any]) -> object:
        return await asyncio.to_thread(function, arguments)

    return handler


def _tool_handler(tool: Tool) -> Callable[[dict[str, Any]], Awaitable[object]]:
    if inspect.iscoroutinefunction(tool.function):
        return tool.handle
    return _in_worker(lambda arguments: tool.function(**arguments))
