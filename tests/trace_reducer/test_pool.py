"""The loop reduce-all and export-rl share: a worker that dies costs a retry, never the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

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
