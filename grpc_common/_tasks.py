"""Work a handler starts that must finish even when its caller (a client) gives up."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TypeVar

_T = TypeVar("_T")

log = logging.getLogger(__name__)

# Tasks whose callers have all left, so that each is reported once however many left.
_abandoned: weakref.WeakSet[asyncio.Task[object]] = weakref.WeakSet()


async def outlive_caller(task: asyncio.Task[_T]) -> _T:
    """task's result, awaited shielded: a caller that is cancelled (a client that gave up, or a
    burst's first failure ending the rest) leaves the task to finish, as a bundle half made
    must be.

    When such a task then fails, nobody awaits it, and asyncio would log "Task exception was
    never retrieved" with the exception's traceback at ERROR for what is an ordinary refusal (a
    StartThread past the open-file limit). It is logged once here instead, as one line."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task not in _abandoned:
            _abandoned.add(task)
            task.add_done_callback(_report_left_behind)
        raise


def _report_left_behind(task: asyncio.Task[_T]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.warning(
            "%s failed after its caller left: %s", task.get_name(), error or type(error).__name__
        )
