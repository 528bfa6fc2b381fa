"""reduce-all: every bundle under a root, reduced by one function in a process pool or on Ray."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from rollout.trace.v1 import state_pb2

from ..bundle._errors import (
    CorruptBundleError,
    not_reduced_reason,
    os_error_reason,
)
from ..bundle._integrity import bundle_warning, integrity_name, require_reducible
from ..bundle._layout import TRACE_FILE_NAME
from ..bundle._liveness import LIVE_WINDOW
from ..bundle._reader import BundleReader
from ..bundle._rewards import RewardFile
from ..reduce._pass import reduce_reader
from ..reduce._pool import Engine, run_chunks
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
    # What was wrong with its rewards.binpb (a FIFO, a symbolic link, damage), in export-rl's
    # words; "" when nothing was, or the bundle was not read. Else said only in state.json.
    rewards_warning: str = ""


def replay_from_store(store: Store, location: str) -> state_pb2.RolloutTrace:
    return _replay_with_rewards(store, location)[0]


def _replay_with_rewards(store: Store, location: str) -> tuple[state_pb2.RolloutTrace, RewardFile]:
    # What `trace-reducer reduce` does, over a file the store opened (a local file or an
    # object): the fork's parent found beside it, the rewards beside it attached.
    with BundleReader(Path(location, TRACE_FILE_NAME), store.open_trace(location)) as reader:
        rewards = store.read_rewards(location)
        reduced = reduce_reader(reader, forks=store.fork_resolver(location), rewards=rewards)
    return reduced.trace, rewards


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
            trace, rewards = _replay_with_rewards(store, task.location)
            if rewards.problem:
                result.rewards_warning = bundle_warning(
                    trace.integrity.status, bundle, rewards.problem
                )
            outcome = _decide(store, task.location, trace, options)
            if outcome in (Outcome.REDUCED, Outcome.SALVAGED):
                store.write_state(task.location, trace)
        result.outcome = outcome
    except Exception as error:  # noqa: BLE001 - one bad bundle never stops the batch
        result.detail = not_reduced_reason(
            error, lambda os_error: describe_store_error(store, os_error)
        )
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


Chunk = list[BundleTask]


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
    listener.started(len(tasks))
    try:
        run_chunks(
            engine,
            chunked(tasks, engine.slots, options),
            (options,),
            died=lambda task, error: _worker_died(task, error, options),
            emit=emit,
            advanced=listener.advanced,
            tick=listener.tick,
        )
    finally:
        listener.finished()


def _worker_died(task: BundleTask, error: BaseException, options: BatchOptions) -> BundleResult:
    """The result of a bundle that kept killing the worker reducing it."""
    store = open_store(options.root, options.storage_options)
    result = BundleResult(
        task.index,
        store.display(task.location),
        Outcome.FAILED,
        detail=f"the worker died reducing it ({type(error).__name__}: {error})",
    )
    if options.tables:
        _add_rows(result, store, task.location, None)
    return result
