"""Many bundles reduced on worker processes: chunks kept in flight, a pool rebuilt when a worker
dies, the bundles of a dead worker's chunk retried alone, and results handed on in order.

`reduce-all` (a process pool, this process, or Ray) and `export-rl --jobs N` both run here, each
with its own work function: one loop, so a worker lost to the OOM killer costs either command
the same retry and never its run.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol, TypeVar

from ..bundle._names import counted

__all__ = ["MAX_ATTEMPTS", "Done", "Engine", "Handle", "InlineEngine", "PoolEngine", "run_chunks"]

# A bundle whose worker died this many times (as a lone task) is given up on.
MAX_ATTEMPTS = 2

Handle = Any
# A work function: (chunk, *args) -> one result a task, in the chunk's order. A top-level
# function, so that a process pool or Ray can send it by name.
Work = Callable[..., Sequence[Any]]
Done = Sequence[Any] | BaseException

T = TypeVar("T")
R = TypeVar("R")


class Engine(Protocol):
    """Runs chunks through its work function somewhere: a local process pool, this process,
    or Ray."""

    name: str
    slots: int

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Handle: ...

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]: ...

    def close(self, *, cancel: bool) -> None: ...


_FORKSERVER_PRELOAD = f"{__package__}._forkserver"


def _start_worker(
    driver: int, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]
) -> None:
    # Ctrl-C reaches the whole process group; only the driver decides how the run stops, so a
    # worker finishes the bundle it is on rather than dying halfway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before any thread starts: each inherits the mask, and one that took SIGTERM would die.
    # (Blocked from birth already where the forkserver preloaded reduce/_forkserver.py.)
    _take_sigterm_from(driver)
    _end_with(driver)
    if initializer is not None:
        initializer(*initargs)


def _take_sigterm_from(driver: int) -> None:
    """End this worker at a SIGTERM only from its driver (the pool ends its workers so when it
    breaks); one from anything else, a service manager stopping every process of the service,
    is the driver's to act on (trace_reducer.cli stops the run as at Ctrl-C), so the worker
    finishes the bundle it is on. Was: it died mid-bundle, a `.state.json.<hex>.tmp` left
    behind, and the driver restarted the pool."""
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: left as before
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != driver:
            pass
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait, name="sigterm-from-driver", daemon=True).start()


def _end_with(driver: int) -> None:
    """End this worker as soon as the driver process is gone. A driver killed outright (the OOM
    killer, SIGKILL) can close no pool: its workers waited for good on pipes no one read, with
    its stdout still open, so a pipeline or a caller reading the output never ended. Its
    forkserver is no help: it stays as long as any worker does."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:  # not Linux: left as before
        return
    try:
        gone = pidfd_open(driver)
    except ProcessLookupError:
        os._exit(1)  # gone already
    except OSError:  # a kernel before 5.3
        return

    def watch() -> None:
        readable = select.poll()
        readable.register(gone, select.POLLIN)  # readable once the driver has exited
        readable.poll()
        os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """The forkserver, started with Ctrl-C ignored: the workers it forks inherit that from
    birth. A worker that took Ctrl-C while still starting up would die, and the pool would
    then kill its siblings in the middle of their bundles."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


class PoolEngine:
    """A local process pool; rebuilt if a worker dies (the OOM killer, a crash).
    `initializer(*initargs)` runs once in each worker."""

    name = "pool"

    def __init__(
        self,
        jobs: int,
        work: Work,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        self.slots = jobs
        self.restarts = 0
        self._work = work
        self._initializer = initializer
        self._initargs = initargs
        self._pool = self._new_pool()

    def _new_pool(self) -> futures.ProcessPoolExecutor:
        # forkserver: workers do not inherit the driver's threads (progress bar, fsspec's
        # event loop) the way fork would.
        context = multiprocessing.get_context("forkserver")
        # Taken only by a forkserver this starts; one already running is left as it is.
        context.set_forkserver_preload(["__main__", _FORKSERVER_PRELOAD])
        _start_forkserver_deaf_to_ctrl_c()
        return futures.ProcessPoolExecutor(
            self.slots,
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid(), self._initializer, self._initargs),
        )

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Handle:
        return self._pool.submit(self._work, chunk, *args)

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        done, _ = futures.wait(handles, timeout, futures.FIRST_COMPLETED)
        finished: list[tuple[Handle, Done]] = []
        broken = False
        for future in done:
            try:
                finished.append((future, future.result()))
            except BaseException as error:  # noqa: BLE001 - reported per bundle by the driver
                broken = broken or isinstance(error, BrokenProcessPool)
                finished.append((future, error))
        if broken and not self._pool_is_live():
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            self.restarts += 1
        return finished

    def restarts_said(self) -> str:
        """The line a run's report gives its restarts."""
        return f"a worker process died; the pool was restarted {counted(self.restarts, 'time')}"

    def _pool_is_live(self) -> bool:
        return not getattr(self._pool, "_broken", False)

    def close(self, *, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)


class InlineEngine:
    """Runs each chunk in the driver's own process, for stores no other process can see
    (memory://) and for work too small to share."""

    name = "in-process"
    slots = 1

    def __init__(self, work: Work) -> None:
        self._work = work
        self._done: dict[Handle, Done] = {}

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Handle:
        handle = object()
        self._done[handle] = self._work(chunk, *args)
        return handle

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        return [(handle, self._done.pop(handle)) for handle in handles if handle in self._done]

    def close(self, *, cancel: bool) -> None:
        self._done.clear()


def run_chunks(
    engine: Engine,
    chunks: Sequence[Sequence[T]],
    args: tuple[Any, ...],
    *,
    died: Callable[[T, BaseException], R],
    emit: Callable[[R], None],
    advanced: Callable[[list[R]], None] = lambda _: None,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Keep the engine busy with chunks and hand each task's result to emit in the tasks'
    order (whichever worker finished first); `advanced` hears of results as they come,
    `tick` about once a second. When a worker dies, every task that was in flight is retried
    alone, one at a time, so that a death is charged to the task it happened under; a task
    that dies alone MAX_ATTEMPTS times gets `died(task, error)` as its result. Closes the
    engine; on any exception (Ctrl-C too) cancels what is queued first, then raises."""
    # (position in the whole run, lone deaths, task)
    pending: deque[list[tuple[int, int, T]]] = deque()
    position = 0
    for chunk in chunks:
        pending.append([(position + offset, 0, task) for offset, task in enumerate(chunk)])
        position += len(chunk)
    # Tasks in flight when a worker died: each runs alone, with nothing else in flight.
    suspects: deque[tuple[int, int, T]] = deque()
    in_flight: dict[Handle, list[tuple[int, int, T]]] = {}
    # The suspect running with nothing else in flight: a death under it is its own.
    alone: Handle = None
    ready: dict[int, R] = {}
    next_position = 0
    try:
        while pending or suspects or in_flight:
            if suspects:
                if not in_flight:
                    entry = suspects.popleft()
                    alone = engine.submit([entry[2]], args)
                    in_flight[alone] = [entry]
            else:
                while pending and len(in_flight) < engine.slots * 2:
                    entries = pending.popleft()
                    handle = engine.submit([task for _, _, task in entries], args)
                    in_flight[handle] = entries
            for handle, done in engine.wait(list(in_flight), timeout=1.0):
                entries = in_flight.pop(handle)
                results: list[tuple[int, R]] = []
                if not isinstance(done, BaseException):
                    results = list(zip((spot for spot, _, _ in entries), done, strict=True))
                elif handle is alone and entries[0][1] + 1 >= MAX_ATTEMPTS:
                    # It died alone, again: nothing else was running to blame.
                    spot, _, task = entries[0]
                    results = [(spot, died(task, done))]
                else:
                    # A task is charged only for a death it was alone under.
                    charged = 1 if handle is alone else 0
                    suspects.extend(
                        (spot, deaths + charged, task) for spot, deaths, task in entries
                    )
                for spot, result in results:
                    ready[spot] = result
                advanced([result for _, result in results])
                while next_position in ready:
                    emit(ready.pop(next_position))
                    next_position += 1
            tick()
    except BaseException:
        engine.close(cancel=True)
        raise
    engine.close(cancel=False)
