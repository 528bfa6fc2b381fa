"""reduce-all: every bundle under a root, reduced by one function in a process pool or on Ray."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from rollout.trace.v1 import state_pb2

from ..bundle._errors import BundleError, CorruptBundleError, ReductionError, os_error_reason
from ..bundle._integrity import integrity_name, require_reducible
from ..bundle._layout import TRACE_FILE_NAME
from ..bundle._liveness import LIVE_WINDOW
from ..bundle._reader import BundleReader
from ..reduce._pass import reduce_reader
from ._rows import Packed, bundle_day, bundle_rows
from ._storage import (
    BundleEntry,
    StorageOptions,
    Store,
    describe_store_error,
    open_store,
    state_mismatch,
    still_written,
)

_CORRUPT = state_pb2.INTEGRITY_STATUS_CORRUPT
# A bundle the writer may still be appending to: no footer (yet), or a frame half written.
_MAYBE_LIVE = (state_pb2.INTEGRITY_STATUS_UNCLOSED, state_pb2.INTEGRITY_STATUS_TRUNCATED)
# A bundle whose worker died this many times (as a lone task) is given up on.
_MAX_ATTEMPTS = 2


class Outcome(StrEnum):
    REDUCED = "reduced"
    SALVAGED = "salvaged"
    CORRUPT = "corrupt"
    LIVE = "live"
    UP_TO_DATE = "up to date"
    FAILED = "failed"


@dataclass(frozen=True)
class BatchOptions:
    """What every worker needs to know; small and picklable (it travels with each task)."""

    root: str
    storage_options: StorageOptions = ()
    force: bool = False
    salvage: bool = False
    tables: bool = False
    live_window: float = LIVE_WINDOW


@dataclass(frozen=True)
class BundleTask:
    index: int
    location: str
    # The listing showed a state.json at least as new as trace.binpb: read it (its integrity
    # alone unless tables are wanted), do not reduce.
    state_is_fresh: bool = False
    attempts: int = 0


@dataclass
class BundleResult:
    """What reducing one bundle gave; rows only when tables were asked for."""

    index: int
    bundle: str
    outcome: Outcome
    integrity: str = ""
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    # CPU the worker spent on it: unlike wall time, not inflated by a busy machine.
    cpu_seconds: float = 0.0
    detail: str = ""
    bad_frame_offset: int | None = None
    bad_frame_seq: int | None = None
    day: str = ""
    rows: Packed | None = None
    # Why a state.json newer than its trace.binpb was not taken as up to date (unreadable,
    # another bundle's), the bundle reduced again; "" when it was, or there was none.
    distrusted_state: str = ""


def replay_from_store(store: Store, location: str) -> state_pb2.RolloutTrace:
    # What `trace-reducer reduce` does, over a file the store opened (a local file or an
    # object): the fork's parent found beside it, the rewards beside it attached.
    with BundleReader(Path(location, TRACE_FILE_NAME), store.open_trace(location)) as reader:
        reduced = reduce_reader(
            reader, forks=store.fork_resolver(location), rewards=store.read_rewards(location)
        )
    return reduced.trace


def reduce_one(task: BundleTask, options: BatchOptions) -> BundleResult:
    """Reduce one bundle and write its state.json: the same function in a pool and on Ray.

    Never raises for a bad bundle: whatever goes wrong is the result's outcome and detail.
    """
    started = time.perf_counter()
    cpu_started = time.process_time()
    store = open_store(options.root, options.storage_options)
    bundle = store.display(task.location)
    result = BundleResult(task.index, bundle, Outcome.FAILED)
    trace: state_pb2.RolloutTrace | None = None
    try:
        if task.state_is_fresh:
            trace, result.distrusted_state = _read_fresh_state(
                store, task.location, whole=options.tables
            )
        if trace is not None:
            outcome = Outcome.UP_TO_DATE
        else:
            trace = replay_from_store(store, task.location)
            outcome = _decide(store, task.location, trace, options)
            if outcome in (Outcome.REDUCED, Outcome.SALVAGED):
                store.write_state(task.location, trace)
        result.outcome = outcome
    except ReductionError as error:
        result.detail = f"records contradict each other: {error}"
    except BundleError as error:
        result.detail = str(error)
    except OSError as error:
        result.detail = describe_store_error(store, error)
    except Exception as error:  # noqa: BLE001 - one bad bundle never stops the batch
        result.detail = f"internal error: {type(error).__name__}: {error}"
    if trace is not None and result.outcome != Outcome.FAILED:
        integrity = trace.integrity
        result.integrity = integrity_name(integrity.status)
        result.records = integrity.records_read
        result.bytes = integrity.bytes_read
        result.detail = integrity.detail
        if integrity.status == _CORRUPT:
            result.bad_frame_offset = integrity.bad_frame_offset
            result.bad_frame_seq = integrity.bad_frame_seq
    if options.tables and result.outcome != Outcome.LIVE:
        try:
            _add_rows(result, store, task.location, trace)
        except Exception as error:  # noqa: BLE001 - as above
            result.outcome = Outcome.FAILED
            result.detail = f"internal error building its table rows: {error}"
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _read_fresh_state(
    store: Store, location: str, *, whole: bool
) -> tuple[state_pb2.RolloutTrace | None, str]:
    """The state.json an earlier run wrote: whole when its table rows are wanted, else only
    its integrity and trace id (all the summary and the exit code need, read without parsing
    the rest); else None and why it is not this bundle's up-to-date state, to be rebuilt."""
    try:
        trace = store.read_state(location) if whole else store.read_head(location)
    except OSError as error:
        return None, f"cannot be read ({os_error_reason(error)})"
    except Exception:  # noqa: BLE001 - an unreadable state.json is rebuilt from the bundle
        return None, "is not one reduce writes"
    try:
        mismatch = state_mismatch(store, location, trace)
    except Exception:  # noqa: BLE001 - rebuilt; the reduce says what is wrong with the bundle
        mismatch = "could not be checked against trace.binpb"
    return (None, mismatch) if mismatch else (trace, "")


def _decide(
    store: Store, location: str, trace: state_pb2.RolloutTrace, options: BatchOptions
) -> Outcome:
    integrity = trace.integrity
    if (integrity.status in _MAYBE_LIVE or integrity.records_read == 0) and still_written(
        store, location, options.live_window
    ):
        return Outcome.LIVE
    try:
        # The policy `reduce` follows; no header at all raises NotABundleError, a failure.
        require_reducible(integrity, salvage=options.salvage, source=store.display(location))
    except CorruptBundleError:
        return Outcome.CORRUPT
    return Outcome.SALVAGED if integrity.status == _CORRUPT else Outcome.REDUCED


def _add_rows(
    result: BundleResult, store: Store, location: str, trace: state_pb2.RolloutTrace | None
) -> None:
    known = trace if result.outcome != Outcome.FAILED else None
    result.day = bundle_day(known, store.trace_mtime(location) if known is None else None)
    result.rows = bundle_rows(
        result.bundle,
        known,
        # A corrupt bundle's entities are in the tables only when salvaged (its state.json too).
        entities=result.outcome != Outcome.CORRUPT,
        error=result.detail if known is None else None,
    )


def reduce_chunk(tasks: Sequence[BundleTask], options: BatchOptions) -> list[BundleResult]:
    """The unit of work sent to a worker: a few bundles, to spread the cost of a dispatch."""
    return [reduce_one(task, options) for task in tasks]


# -- engines ----------------------------------------------------------------------------------

Chunk = list[BundleTask]
Handle = Any
Done = list[BundleResult] | BaseException


class Engine(Protocol):
    """Runs chunks somewhere: a local process pool, or Ray."""

    name: str
    slots: int

    def submit(self, chunk: Chunk, options: BatchOptions) -> Handle: ...

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]: ...

    def close(self, *, cancel: bool) -> None: ...


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; only the driver decides how the batch stops,
    # so a worker finishes the bundle it is on rather than dying halfway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start the forkserver with SIGINT ignored, so that every worker it forks ignores it from
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
    """A local process pool; rebuilt if a worker dies (the OOM killer, a crash)."""

    name = "pool"

    def __init__(self, jobs: int) -> None:
        self.slots = jobs
        self.restarts = 0
        self._pool = self._new_pool()

    def _new_pool(self) -> futures.ProcessPoolExecutor:
        # forkserver: workers do not inherit the driver's threads (progress bar, fsspec's
        # event loop) the way fork would.
        context = multiprocessing.get_context("forkserver")
        _start_forkserver_deaf_to_ctrl_c()
        return futures.ProcessPoolExecutor(
            self.slots, mp_context=context, initializer=_ignore_sigint
        )

    def submit(self, chunk: Chunk, options: BatchOptions) -> Handle:
        return self._pool.submit(reduce_chunk, chunk, options)

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

    def _pool_is_live(self) -> bool:
        return not getattr(self._pool, "_broken", False)

    def close(self, *, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)


class InlineEngine:
    """Reduces in the driver's own process, for stores no other process can see (memory://)."""

    name = "in-process"
    slots = 1

    def __init__(self) -> None:
        self._done: dict[Handle, Done] = {}

    def submit(self, chunk: Chunk, options: BatchOptions) -> Handle:
        handle = object()
        self._done[handle] = reduce_chunk(chunk, options)
        return handle

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        return [(handle, self._done.pop(handle)) for handle in handles if handle in self._done]

    def close(self, *, cancel: bool) -> None:
        self._done.clear()


# -- the driver -------------------------------------------------------------------------------


class Listener(Protocol):
    def started(self, total: int) -> None: ...

    def advanced(self, results: list[BundleResult]) -> None: ...

    def tick(self) -> None: ...

    def finished(self) -> None: ...


# Integrities the summary only counts: a CORRUPT bundle's line names its damage, read from its
# state.json.
_COUNTED_ONLY = frozenset({"CLEAN", "UNCLOSED", "TRUNCATED"})


def plan(
    entries: list[BundleEntry],
    options: BatchOptions,
    indexed: Callable[[BundleEntry], str | None] = lambda _: None,
) -> tuple[list[BundleTask], Counter[str]]:
    """Tasks for the bundles that need a worker, and the integrities of the up-to-date ones
    that need none: no tables wanted, and `indexed` (`list`'s index) knows the integrity of
    the state.json as it is now. Every other up-to-date bundle's state.json is read by a
    worker, for its integrity (and with tables, its rows)."""
    tasks: list[BundleTask] = []
    known: Counter[str] = Counter()
    for entry in entries:
        fresh = entry.state_is_fresh and not options.force
        if fresh and not options.tables:
            integrity = indexed(entry)
            if integrity in _COUNTED_ONLY:
                known[integrity] += 1
                continue
        tasks.append(BundleTask(len(tasks), entry.location, state_is_fresh=fresh))
    return tasks, known


# Reading an up-to-date bundle's integrity (no tables wanted) costs about this much of reducing
# a bundle: chunks of them are this much larger, or the dispatch would cost more than the work.
_INTEGRITY_ONLY_WEIGHT = 1 / 16


def chunked(tasks: list[BundleTask], slots: int, options: BatchOptions) -> list[Chunk]:
    def weight(task: BundleTask) -> float:
        light = task.state_is_fresh and not options.tables
        return _INTEGRITY_ONLY_WEIGHT if light else 1.0

    weights = [weight(task) for task in tasks]
    # Enough chunks to keep every slot busy to the end, few enough to spread the dispatch cost.
    size = max(1, min(16, int(sum(weights) // (slots * 8))))
    chunks: list[Chunk] = []
    chunk: Chunk = []
    filled = 0.0
    for task, task_weight in zip(tasks, weights, strict=True):
        chunk.append(task)
        filled += task_weight
        if filled >= size:
            chunks.append(chunk)
            chunk, filled = [], 0.0
    if chunk:
        chunks.append(chunk)
    return chunks


def drive(
    engine: Engine,
    tasks: list[BundleTask],
    options: BatchOptions,
    listener: Listener,
    emit: Callable[[BundleResult], None],
) -> None:
    """Keep the engine busy, collect results, and hand them to emit in bundle order (so the
    tables do not depend on which worker finished first). Ctrl-C propagates after cleanup."""
    pending: deque[Chunk] = deque(chunked(tasks, engine.slots, options))
    in_flight: dict[Handle, Chunk] = {}
    ready: dict[int, BundleResult] = {}
    next_index = 0
    listener.started(len(tasks))
    try:
        while pending or in_flight:
            while pending and len(in_flight) < engine.slots * 2:
                chunk = pending.popleft()
                in_flight[engine.submit(chunk, options)] = chunk
            for handle, done in engine.wait(list(in_flight), timeout=1.0):
                chunk = in_flight.pop(handle)
                if isinstance(done, BaseException):
                    results = _retry_or_fail(chunk, done, pending, options)
                else:
                    results = done
                for result in results:
                    ready[result.index] = result
                listener.advanced(results)
                while next_index in ready:
                    emit(ready.pop(next_index))
                    next_index += 1
            listener.tick()
    except BaseException:
        engine.close(cancel=True)
        raise
    finally:
        listener.finished()
    engine.close(cancel=False)


def _retry_or_fail(
    chunk: Chunk, error: BaseException, pending: deque[Chunk], options: BatchOptions
) -> list[BundleResult]:
    """A worker died under this chunk: retry its bundles one by one, then give up on those
    that keep killing their worker."""
    failed = []
    for task in reversed(chunk):
        attempts = task.attempts + (1 if len(chunk) == 1 else 0)
        if attempts < _MAX_ATTEMPTS:
            pending.appendleft([replace(task, attempts=attempts)])
            continue
        store = open_store(options.root, options.storage_options)
        result = BundleResult(
            task.index,
            store.display(task.location),
            Outcome.FAILED,
            detail=f"the worker died reducing it ({type(error).__name__}: {error})",
        )
        if options.tables:
            _add_rows(result, store, task.location, None)
        failed.append(result)
    return failed
