"""The event loop a server runs on: uvloop where it is installed, else asyncio's own."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ._limits import raise_open_file_limit

_T = TypeVar("_T")

# The names `--event-loop` takes. uvloop (libuv under asyncio's interface) does a stream's
# wake-ups, socket reads and callbacks in C: at P5's load the agent server's CPU a delta fell
# by 2-12 % on it (lower in 25 of 28 paired rounds), where the bare grpc.aio floor, whose sends
# grpc does on its own threads, stayed where it was (README, "Levers on the streaming path").
EVENT_LOOPS = ("uvloop", "asyncio")


def default_event_loop() -> str:
    """uvloop when it can be imported (it is a dependency except on Windows), else asyncio."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def event_loop_problem(name: str) -> str | None:
    """Why `name` cannot be the event loop, for a start-up error; None when it can."""
    if name not in EVENT_LOOPS:
        return f"--event-loop must be one of {', '.join(EVENT_LOOPS)}"
    if name == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "--event-loop uvloop: uvloop is not installed (pip install uvloop), or use asyncio"
    return None


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def open_standard_fds() -> frozenset[int]:
    """Open the null device onto whichever of fds 0, 1 and 2 is closed; return those.

    A process started with one closed (`<&-`, `>&-`, a supervisor that closes them) would hand
    that number to the next socket or pipe it opens, and libuv (uvloop) aborts the process when
    it closes such an fd: it asserts that it never owns 0-2 (`uv__close: Assertion
    'fd > STDERR_FILENO'`, exit 134 at SIGTERM, after the bundles were closed). The
    open file is the lowest free number, so opening until a number above 2 comes back fills
    exactly the closed ones. Python's own sys.stdin / sys.stdout stay None (prints do nothing).
    """
    filled: set[int] = set()
    while True:
        fd = os.open(os.devnull, os.O_RDWR)
        if fd > 2:
            os.close(fd)
            return frozenset(filled)
        # os.open makes it close-on-exec; as a standard stream it is passed on to children
        # (the --workers processes) like any other.
        os.set_inheritable(fd, True)
        filled.add(fd)


def discard_stdout() -> None:
    """Point fd 1 at the null device: what is still buffered for a stdout that failed would
    fail again at the interpreter's exit, as an "Exception ignored" traceback."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)


def stdout_failure(error: OSError) -> str:
    """What a failed write to stdout is said as."""
    if error.errno == errno.EBADF:
        return "cannot write to stdout: it is closed"
    return f"cannot write to stdout: {error.strerror or 'failed'}"


def announce(
    line: str, warn: Callable[[str], None], discard: Callable[[], None] = discard_stdout
) -> None:
    """A server's start-up line on stdout. What was asked for is the server, not the line:
    a stdout that is closed, full, or whose reader has gone (`serve | head -1` reading the
    address) leaves it serving (discard then takes what stdout still holds), and warn says
    so unless the reader just left."""
    try:
        print(line, flush=True)
    except OSError as error:
        discard()
        if error.errno != errno.EPIPE:
            warn(f"{stdout_failure(error)}; serving on")


def run_on_loop(main: Coroutine[Any, Any, _T], event_loop: str) -> _T:
    """asyncio.run(main) on the named event loop (one of EVENT_LOOPS, checked beforehand with
    event_loop_problem): the same cancellation of what is left, the same Ctrl-C handling.

    Every server runs through here, so here is where fds 0-2 are made sure of, before the loop
    or any server creates a socket (open_standard_fds), and where the open-file limit is
    raised to what the process is allowed (raise_open_file_limit)."""
    open_standard_fds()
    raise_open_file_limit()
    with asyncio.Runner(loop_factory=_loop_factory(event_loop)) as runner:
        return runner.run(main)


def running_event_loop() -> str:
    """The name (of EVENT_LOOPS) of the loop running the caller, for the start-up log line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.partition(".")[0] == "uvloop" else "asyncio"
