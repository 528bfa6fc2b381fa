"""outlive_caller: work that finishes when its caller gives up, its failure then one log line."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from grpc_common import outlive_caller


async def _refused(gate: asyncio.Event, started: asyncio.Event | None = None) -> str:
    if started is not None:
        started.set()
    await gate.wait()
    raise RuntimeError("too many open files")


def _left(task: asyncio.Task[str]) -> None:
    """Await task through outlive_caller and give up at once, as a cancelled RPC does."""
    waiting = outlive_caller(task)
    shielded = waiting.send(None)  # runs to the shielded wait, and gives what it waits on
    shielded.cancel()  # what cancelling the caller's task does to the future it waits on
    with pytest.raises(asyncio.CancelledError):
        waiting.send(None)


async def test_a_failure_after_the_caller_left_is_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
    gate, started = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_refused(gate, started), name="StartThread")
    # Underway when its caller leaves, as a bundle being made is.
    await started.wait()
    _left(task)
    _left(task)  # a second caller leaving reports nothing more
    with caplog.at_level(logging.WARNING, logger="grpc_common"):
        gate.set()
        await asyncio.wait([task])
    del task
    gc.collect()
    assert unretrieved == []
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("grpc_common")]
    assert warnings == ["StartThread failed after its caller left: too many open files"]


async def test_a_caller_that_waits_gets_the_result_or_the_error() -> None:
    gate = asyncio.Event()
    gate.set()
    with pytest.raises(RuntimeError, match="too many open files"):
        await outlive_caller(asyncio.create_task(_refused(gate)))

    async def done() -> str:
        return "thread_1"

    assert await outlive_caller(asyncio.create_task(done())) == "thread_1"


async def test_the_work_goes_on_when_its_caller_leaves() -> None:
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "made"

    task = asyncio.create_task(work())
    _left(task)
    gate.set()
    assert await task == "made"
