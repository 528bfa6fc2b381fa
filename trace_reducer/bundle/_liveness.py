"""Whether a bundle without a footer is still being written: its writer's lock, then its age.

A BundleWriter holds an exclusive `flock` on its trace.binpb from the moment the file exists
until it is closed or its recording fails; the kernel drops the lock when the process dies,
`kill -9` included. A held lock is proof of a writer, however long it has been quiet. A free
one is not proof of none (a writer from before the lock, a file system whose locks do not reach
the writer's host, a store without locks), so a file changed within the last `LIVE_WINDOW`
seconds counts as being written whatever its lock says: a dead writer's bundle is taken for
finished once it has been quiet that long.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from ._confine import open_regular_file

# An unfinished bundle modified this recently is being written, whatever its lock says.
LIVE_WINDOW = 10.0


def lock_for_writing(fd: int) -> None:
    """Hold the writer's lock on a trace file just created; where the file system has no
    locks, the recording goes on without (readers then judge by the file's age)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def release_writing_lock(fd: int) -> None:
    """Let readers know no more records come: for a writer whose recording failed."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)


def writer_holds(fd: int) -> bool | None:
    """Whether a writer holds the trace file open through `fd`: None where locks cannot tell."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None  # ENOLCK, EOPNOTSUPP: no locks on this file system
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def writer_holds_file(path: str | os.PathLike[str]) -> bool | None:
    """writer_holds() for a file by name (never through a symbolic link, never a FIFO)."""
    try:
        fd = open_regular_file(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return writer_holds(fd)
    finally:
        os.close(fd)


def being_written(
    writer: bool | None, mtime: float | None, now: float, window: float = LIVE_WINDOW
) -> bool:
    """The one rule for an unfinished bundle: a writer holds it, or it changed within `window`
    seconds of `now` (writer: writer_holds()'s answer; mtime: the trace file's, or None)."""
    return writer is True or (mtime is not None and now - mtime < window)
