"""Many bundles reduced on worker processes: chunks kept in flight, a pool rebuilt when a worker
dies, the bundle the dead worker was on retried alone, and results handed on in order.

`reduce-all` (a process pool, this process, or Ray) and `export-rl --jobs N` both run here, each
with its own work function: one loop, so a worker lost to the OOM killer costs either command
the same retry and never its run.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import select
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol, TypeVar

from ..bundle._names import counted

__all__ = [
    "MAX_ATTEMPTS",
    "Done",
    "Engine",
    "Handle",
    "InlineEngine",
    "PoolEngine",
    "WorkerLost",
    "run_chunks",
]

# A bundle whose worker died this many times under it is given up on (the last time, as a
# lone task: see run_chunks).
MAX_ATTEMPTS = 2

Handle = Any
# A work function: (chunk, *args) -> one result a task, in the chunk's order. A top-level
# function, so that a process pool or Ray can send it by name. It goes through its chunk once,
# in order, working on each task as it takes it: a pool worker says which task it is on as the
# task is taken (_Taken), so that the driver knows which one a worker died under.
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

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        """The handles done, each with its results or its error: a WorkerLost for a chunk
        lost with a worker where the engine knows which task that worker was on."""
        ...

    def close(self, *, cancel: bool) -> None: ...


class WorkerLost(BrokenProcessPool):
    """A chunk lost with its pool when a worker died, and what the pool knows of the death:
    `culprit` is the index in the chunk of the task the dead worker was on; None when the chunk
    was lost beside the death, its own worker ended by the pool. (A chunk whose part in the
    death is not known gets the pool's own BrokenProcessPool.)"""

    def __init__(self, message: str, culprit: int | None) -> None:
        super().__init__(message)
        self.culprit = culprit


_FORKSERVER_PRELOAD = f"{__package__}._forkserver"

# A worker's slot while it is on no task.
_IDLE = -1

# A worker can tell who sent it a SIGTERM (Linux).
_SIGTERM_SENDER_KNOWN = hasattr(signal, "sigwaitinfo")


class _Marks:
    """Where a pool worker says which task it is on: a slot of shared memory that the driver
    reads once the pool is broken and all its workers are gone. A worker the pool ends (its
    driver's SIGTERM) empties its slot first, so only a worker that died of its own accord
    (the OOM killer, a crash) leaves a task there."""

    def __init__(self, marks: ctypes.Array[ctypes.c_longlong], slot: int) -> None:
        self._marks = marks
        self._slot = slot
        # Between the worker's main thread and the one that ends it at its driver's SIGTERM: a
        # task marked after the slot was emptied would be blamed for a death not its own.
        self._lock = threading.Lock()

    def on(self, serial: int) -> None:
        with self._lock:
            self._marks[self._slot] = serial

    def end(self) -> None:
        """Empties the slot for good: the worker is ending at its driver's word, or as it was
        asked. The lock is kept: the process exits holding it."""
        self._lock.acquire()
        self._marks[self._slot] = _IDLE


# This worker's slot (in a pool worker only).
_marks: _Marks | None = None


class _Taken(Sequence[Any]):
    """A chunk as a work function sees it in a pool worker: each task, as it is taken, marked
    as the one this worker is on (by its serial, `first` + its index); once the last is done,
    `first` + len (the chunk's result, being sent)."""

    def __init__(self, chunk: Sequence[Any], first: int) -> None:
        self._chunk = chunk
        self._first = first

    def __len__(self) -> int:
        return len(self._chunk)

    def __getitem__(self, index: Any) -> Any:
        return self._chunk[index]

    def __iter__(self) -> Iterator[Any]:
        for offset, task in enumerate(self._chunk):
            if _marks is not None:
                _marks.on(self._first + offset)
            yield task
        if _marks is not None:
            _marks.on(self._first + len(self._chunk))


def _run_taken(work: Work, first: int, chunk: Sequence[Any], *args: Any) -> Sequence[Any]:
    """What a pool worker runs for a chunk whose tasks are numbered from `first`."""
    return work(_Taken(chunk, first), *args)


def _start_worker(
    driver: int,
    marks: ctypes.Array[ctypes.c_longlong] | None,
    taken: Any,
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
) -> None:
    # Ctrl-C reaches the whole process group; only the driver decides how the run stops, so a
    # worker finishes the bundle it is on rather than dying halfway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if marks is not None:
        with taken.get_lock():
            slot = taken.value
            taken.value += 1
        if slot < len(marks):  # always, while a pool starts no more workers than it has slots
            global _marks
            _marks = _Marks(marks, slot)
            # A worker told to stop (the pool's sentinel, sent as it ends) ends of its own
            # accord, with no death to blame on its last chunk: it can beat the SIGTERM that
            # the pool sent just before to the thread that would empty its slot. A finalizer
            # empties it as it ends; where the stdlib has none, that chunk's bundles are
            # retried alone (as where no culprit is known), never blamed.
            finalize = getattr(multiprocessing.util, "Finalize", None)
            if finalize is not None:
                finalize(None, _marks.end, exitpriority=0)
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
    if not _SIGTERM_SENDER_KNOWN:  # not Linux: left as before
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != driver:
            pass
        if _marks is not None:
            _marks.end()  # not this worker's death: the pool's (reduce/_pool.py's _Marks)
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
    `initializer(*initargs)` runs once in each worker.

    The chunks lost with a broken pool come back as WorkerLost, saying which task the dead
    worker was on, where the workers could tell (Linux: a worker ended by the pool empties its
    slot first, see _take_sigterm_from); elsewhere as the pool's BrokenProcessPool."""

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
        # Only where a worker ended by the pool can tell so (and empty its slot).
        self._blames = _SIGTERM_SENDER_KNOWN
        # Every task submitted gets a serial, every chunk one more past its last task (its
        # result, being sent); the chunk's first serial and length, by its future.
        self._serial = 0
        self._spans: dict[futures.Future[Sequence[Any]], tuple[int, int]] = {}
        # What the chunks lost with the last broken pool are told (_blamed), until they are.
        self._lost: dict[futures.Future[Sequence[Any]], BaseException] = {}
        self._pool, self._marks = self._new_pool()

    def _new_pool(
        self,
    ) -> tuple[futures.ProcessPoolExecutor, ctypes.Array[ctypes.c_longlong] | None]:
        # forkserver: workers do not inherit the driver's threads (progress bar, fsspec's
        # event loop) the way fork would.
        context = multiprocessing.get_context("forkserver")
        # Taken only by a forkserver this starts; one already running is left as it is.
        context.set_forkserver_preload(["__main__", _FORKSERVER_PRELOAD])
        _start_forkserver_deaf_to_ctrl_c()
        # A slot a worker: the serial of the task each is on. A pool starts a worker a slot
        # at most, and none again (a worker that dies breaks it), so each claims the next.
        marks = context.RawArray(ctypes.c_longlong, [_IDLE] * self.slots) if self._blames else None
        taken = context.Value(ctypes.c_int, 0) if self._blames else None
        pool = futures.ProcessPoolExecutor(
            self.slots,
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid(), marks, taken, self._initializer, self._initargs),
        )
        return pool, marks

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Handle:
        first = self._serial
        self._serial += len(chunk) + 1
        try:
            future = self._pool.submit(_run_taken, self._work, first, chunk, *args)
        except BrokenProcessPool as error:
            # A worker died since the driver last waited: the chunk is lost with the pool,
            # never sent, and the next wait says so and restarts the pool (was: the error
            # ended the run).
            future = futures.Future()
            future.set_exception(error)
        self._spans[future] = (first, len(chunk))
        return future

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        done, _ = futures.wait(handles, timeout, futures.FIRST_COMPLETED)
        # A chunk of the pool as it is now (not of one broken before) that failed with it.
        if any(future in self._spans and _broke(future) for future in done):
            self._restart()
            # Every chunk of the broken pool failed with it: all are answered now.
            done = {future for future in handles if future.done()}
        finished: list[tuple[Handle, Done]] = []
        for future in done:
            try:
                finished.append((future, future.result()))
            except BaseException as error:  # noqa: BLE001 - reported per bundle by the driver
                finished.append((future, self._lost.pop(future, error)))
            self._spans.pop(future, None)
        return finished

    def _restart(self) -> None:
        """A new pool for the broken one, after telling the chunks lost with it apart: the one
        a dead worker was on, and the others, lost beside it."""
        broken, marks, spans = self._pool, self._marks, self._spans
        # Waits for the broken pool's end: it fails every future it held, then ends its other
        # workers (each emptying its slot as it goes) and waits for them, so what the slots
        # still hold is the tasks that workers died on of their own accord.
        broken.shutdown(wait=True, cancel_futures=True)
        self._lost = _blamed(spans, [] if marks is None else list(marks))
        self._spans = {}
        self._pool, self._marks = self._new_pool()
        self.restarts += 1

    def restarts_said(self) -> str:
        """The line a run's report gives its restarts."""
        return f"a worker process died; the pool was restarted {counted(self.restarts, 'time')}"

    def close(self, *, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)


def _broke(future: futures.Future[Sequence[Any]]) -> bool:
    return not future.cancelled() and isinstance(future.exception(), BrokenProcessPool)


def _blamed(
    spans: dict[futures.Future[Sequence[Any]], tuple[int, int]], marks: list[int]
) -> dict[futures.Future[Sequence[Any]], BaseException]:
    """What each chunk lost with a broken pool is to be told, from the serials of the tasks its
    dead workers were on (`marks`). A chunk a dead worker was on: WorkerLost naming the task;
    the pool's own error if the worker had done every task (it died sending the result, or
    after). Every other chunk: WorkerLost without a culprit. None of them, when no dead worker
    was on a chunk that was lost (it died idle, or could not say): the pool's own errors."""
    lost: dict[futures.Future[Sequence[Any]], BaseException] = {}
    on = {serial for serial in marks if serial != _IDLE}
    for future, (first, length) in spans.items():
        error = future.exception() if future.done() and not future.cancelled() else None
        if not isinstance(error, BrokenProcessPool):
            continue
        culprits = [serial - first for serial in on if first <= serial <= first + length]
        if not culprits:
            lost[future] = WorkerLost(str(error), None)
        elif culprits[0] < length:
            lost[future] = WorkerLost(str(error), culprits[0])
        else:
            lost[future] = error
    if all(isinstance(error, WorkerLost) and error.culprit is None for error in lost.values()):
        return {}
    return lost


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
    `tick` about once a second. When a worker dies, the task it was on (WorkerLost.culprit) is
    retried alone, with nothing else in flight, and every other task lost with it is sent
    again as before; where the engine cannot tell which task that was, every task that was in
    flight is retried alone, one at a time. A task is charged for each death it was the one
    under: given a culprit, or alone. One charged MAX_ATTEMPTS times (the last of them alone,
    so never for a death that running beside others brought on) gets `died(task, error)` as
    its result. Closes the engine; on any exception (Ctrl-C too) cancels what is queued
    first, then raises."""
    # (position in the whole run, deaths charged, task)
    pending: deque[list[tuple[int, int, T]]] = deque()
    position = 0
    for chunk in chunks:
        pending.append([(position + offset, 0, task) for offset, task in enumerate(chunk)])
        position += len(chunk)
    # Tasks a worker may have died under: each runs alone, with nothing else in flight.
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
            # Tasks lost beside a death, sent again (first: the results wait for them).
            again: list[list[tuple[int, int, T]]] = []
            for handle, done in engine.wait(list(in_flight), timeout=1.0):
                entries = in_flight.pop(handle)
                results: list[tuple[int, R]] = []
                if not isinstance(done, BaseException):
                    results = list(zip((spot for spot, _, _ in entries), done, strict=True))
                elif isinstance(done, WorkerLost) or handle is alone:
                    culprit = done.culprit if isinstance(done, WorkerLost) else 0
                    if culprit is not None:
                        spot, deaths, task = entries[culprit]
                        if handle is alone and deaths + 1 >= MAX_ATTEMPTS:
                            # It died alone, again: nothing else was running to blame.
                            results = [(spot, died(task, done))]
                        else:
                            suspects.append((spot, deaths + 1, task))
                    rest = [entry for index, entry in enumerate(entries) if index != culprit]
                    if rest:
                        again.append(rest)
                else:
                    # Which task the worker was on is not known: each is retried alone, and
                    # charged only for a death it is alone under.
                    suspects.extend(entries)
                for spot, result in results:
                    ready[spot] = result
                advanced([result for _, result in results])
                while next_position in ready:
                    emit(ready.pop(next_position))
                    next_position += 1
            pending.extendleft(sorted(again, key=lambda entries: entries[0][0], reverse=True))
            tick()
    except BaseException:
        engine.close(cancel=True)
        raise
    engine.close(cancel=False)
