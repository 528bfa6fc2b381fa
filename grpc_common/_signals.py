"""Graceful stop on the first SIGTERM or SIGINT, immediate exit on the second."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable


def install_signal_handlers(
    on_first_signal: Callable[[], None], before_exit: Callable[[], None] | None = None
) -> None:
    """SIGTERM/SIGINT call on_first_signal once; a second signal exits the process at once,
    after before_exit (a supervisor kills its workers there)."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def handle(signum: int) -> None:
        if received:
            print("second signal: exiting now", file=sys.stderr, flush=True)
            if before_exit is not None:
                before_exit()
            os._exit(128 + signum)
        received.append(signum)
        on_first_signal()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)
