"""The `trace-reducer` command: one module per command group, `main` the entry point."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType

from .._exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so that every command stops
    the way it stops at Ctrl-C: its pool's workers finish their bundles and exit, its
    half-written files are removed, and what it did is said."""


_terminated = False


def _stop_as_at_ctrl_c(signum: int, frame: FrameType | None) -> None:
    global _terminated
    if _terminated:
        return  # a second SIGTERM must not cut the first one's clean stop short
    _terminated = True
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; never lets a traceback out, not even a Ctrl-C's while it loads."""
    global _terminated
    _terminated = False
    # SIGTERM (`kill`, a job scheduler, `timeout`) is what stops a batch job; left to its
    # default it killed this process alone, and the pool's workers waited for good on pipes
    # nobody read, holding the command's stdout open (a pipeline never ended). A command that
    # serves installs its own handler over this one. Signals reach the main thread only.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _stop_as_at_ctrl_c)
    # The command loads here, not when this package is imported: the console script imports
    # it before calling main, where nothing could catch a Ctrl-C pressed as the command starts.
    try:
        from ._main import main as run

        code = run(argv)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_TERMINATED if _terminated and code == EXIT_INTERRUPTED else code


__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE", "main"]
