"""The loop reduce-all and export-rl share: a worker that dies costs a retry, never the run."""

from __future__ import annotations

import os
from collections.abc import Sequence

from trace_reducer.reduce._pool import MAX_ATTEMPTS, InlineEngine, PoolEngine, run_chunks


def _tens(chunk: Sequence[int], deadly: frozenset[int]) -> list[int]:
    """Each task times ten; a deadly one kills its worker, as the OOM killer would."""
    for task in chunk:
        if task in deadly:
            os._exit(9)
    return [task * 10 for task in chunk]


def _died(task: int, error: BaseException) -> int:
    assert "terminated abruptly" in str(error)
    return -task


def test_a_dead_workers_chunk_is_retried_task_by_task_and_the_order_kept() -> None:
    engine = PoolEngine(2, _tens)
    emitted: list[int] = []
    heard: list[int] = []
    run_chunks(
        engine,
        [[0, 1, 2], [3, 4, 5], [6, 7], [8]],
        (frozenset({4}),),
        died=_died,
        emit=emitted.append,
        advanced=heard.extend,
    )
    # Was (export-rl's own loop): the run ended `internal error: BrokenProcessPool`.
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
