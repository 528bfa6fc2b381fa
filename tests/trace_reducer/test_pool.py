"""The loop reduce-all and export-rl share: a worker that dies costs a retry, never the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from trace_reducer.reduce._pool import MAX_ATTEMPTS, InlineEngine, PoolEngine, run_chunks

from .process import running

# A task that, the first time it runs, is still running when a deadly one kills its worker.
BYSTANDER = 8


def _tens(chunk: Sequence[int], deadly: frozenset[int], marks: str = "") -> list[int]:
    """Each task times ten; a deadly one kills its worker, as the OOM killer would (with
    marks: once the bystander is running beside it)."""
    started = Path(marks, "bystander")
    for task in chunk:
        if task in deadly:
            while marks and not started.exists():
                time.sleep(0.005)
            os._exit(9)
        if marks and task == BYSTANDER and not started.exists():
            started.touch()
            while True:  # in flight until the pool breaks under it and ends this process
                time.sleep(1)
    return [task * 10 for task in chunk]


def _died(task: int, error: BaseException) -> int:
    assert "terminated abruptly" in str(error)
    return -task


def test_a_dead_workers_chunk_is_retried_task_by_task_and_the_order_kept(tmp_path: Path) -> None:
    engine = PoolEngine(2, _tens)
    emitted: list[int] = []
    heard: list[int] = []
    run_chunks(
        engine,
        # One worker takes [3, 4, 5] and waits in 4; the other finishes the rest up to the
        # bystander, which is running when 4 kills its worker.
        [[0, 1, 2], [3, 4, 5], [6, 7], [BYSTANDER]],
        (frozenset({4}), str(tmp_path)),
        died=_died,
        emit=emitted.append,
        advanced=heard.extend,
    )
    # Was (export-rl's own loop): the run ended `internal error: BrokenProcessPool`. And a lone
    # task in flight beside the deadly one was charged for its deaths too, and could be given
    # up (-8) as a bundle that kills its worker.
    assert emitted == [0, 10, 20, 30, -4, 50, 60, 70, 80]
    assert sorted(heard) == sorted(emitted)
    # The chunk's death, then task 4 alone until it was given up on.
    assert engine.restarts >= MAX_ATTEMPTS
    assert "restarted" in engine.restarts_said()


class _Submits(PoolEngine):
    """The pool, noting each chunk it is given: its size, and its handle."""

    def __init__(self, jobs: int, work: Callable[..., list[int]]) -> None:
        super().__init__(jobs, work)
        self.sizes: list[int] = []
        self.handles: list[futures.Future[Any]] = []

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Any:
        self.sizes.append(len(chunk))
        handle = super().submit(chunk, args)
        self.handles.append(handle)
        return handle


def _one_deadly_among_many(work: Callable[..., list[int]]) -> _Submits:
    engine = _Submits(2, work)
    emitted: list[int] = []
    tasks = list(range(1, 201))
    run_chunks(
        engine,
        [tasks[start : start + 4] for start in range(0, len(tasks), 4)],
        (frozenset({50}),),
        died=_died,
        emit=emitted.append,
    )
    assert emitted == [-task if task == 50 else task * 10 for task in tasks]
    return engine


def test_only_the_task_a_worker_died_on_is_retried_alone() -> None:
    engine = _one_deadly_among_many(_tens)
    # Was: every task in flight beside it (up to 2 x jobs chunks) retried alone, one at a
    # time, and 1 + MAX_ATTEMPTS restarts. Now the pool knows which task its dead worker was
    # on: that one alone is retried alone (and its death in the crowd counts), the rest of
    # the chunks lost with the pool are sent again as they were.
    assert engine.restarts == MAX_ATTEMPTS
    assert engine.sizes.count(1) == MAX_ATTEMPTS - 1


def _tens_taken_at_once(chunk: Sequence[int], deadly: frozenset[int]) -> list[int]:
    """_tens, but taking the whole chunk before working on any of it: which task the worker
    dies on cannot be told."""
    return _tens(list(chunk), deadly)


def test_a_death_the_pool_cannot_place_retries_its_chunk_task_by_task() -> None:
    engine = _one_deadly_among_many(_tens_taken_at_once)
    # Only the dead worker's chunk is retried alone, task by task; the deadly task then dies
    # alone MAX_ATTEMPTS times.
    assert engine.restarts == 1 + MAX_ATTEMPTS
    assert engine.sizes.count(1) == 4 + MAX_ATTEMPTS - 1


def _tens_dying_on_cue(chunk: Sequence[int], deadly: frozenset[int], marks: str) -> list[int]:
    """_tens, but a deadly task kills its worker only once the driver says `go`."""
    for task in chunk:
        if task in deadly:
            while not Path(marks, "go").exists():
                time.sleep(0.005)
            os._exit(9)
    return [task * 10 for task in chunk]


def test_a_worker_that_dies_as_the_driver_hands_out_chunks_costs_a_retry(tmp_path: Path) -> None:
    engine = _Submits(1, _tens_dying_on_cue)
    emitted: list[int] = []

    def emit(result: int) -> None:
        emitted.append(result)
        if result == 10:
            # The driver, between the result of [1] and handing out [3]: the worker dies
            # on [50] now, and the pool is broken before [3] is submitted.
            Path(tmp_path, "go").touch()
            futures.wait([engine.handles[1]])

    run_chunks(
        engine,
        [[1], [50], [3], [4]],
        (frozenset({50}), str(tmp_path)),
        died=_died,
        emit=emit,
    )
    # Was: `BrokenProcessPool` out of run_chunks (reduce-all and export-rl: the run ended with
    # an internal error), the pool having broken since the driver last looked at it.
    assert emitted == [10, -50, 30, 40]
    assert engine.restarts == MAX_ATTEMPTS


def test_results_come_in_the_tasks_order_in_process_too() -> None:
    emitted: list[int] = []
    run_chunks(
        InlineEngine(_tens),
        [[5, 6], [7]],
        (frozenset[int](),),
        died=_died,
        emit=emitted.append,
    )
    assert emitted == [50, 60, 70]


def _held(chunk: Sequence[int], marks: str) -> list[int]:
    """Says which worker took the chunk, then holds it for good."""
    Path(marks, str(os.getpid())).touch()
    threading.Event().wait()
    return list(chunk)


def drive_held_chunks(marks: str) -> None:
    """A driver whose two workers each hold a chunk until the driver is killed."""
    run_chunks(PoolEngine(2, _held), [[1], [2]], (marks,), died=_died, emit=lambda _: None)


def test_workers_end_when_their_driver_is_killed(tmp_path: Path) -> None:
    # Was: a driver killed outright (the OOM killer, SIGKILL) left its workers waiting for good
    # on pipes no one read, holding the command's stdout open: a pipeline never ended.
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from {__name__} import drive_held_chunks as d; d({str(tmp_path)!r})",
        ],
        cwd=Path(__file__).parents[2],
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert driver.poll() is None, "the driver ended"
            assert time.monotonic() < deadline, "no workers at work"
            time.sleep(0.02)
            workers = [int(mark.name) for mark in tmp_path.iterdir()]
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [pid for pid in workers if running(pid)] == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in filter(running, workers):
            os.kill(pid, signal.SIGKILL)
