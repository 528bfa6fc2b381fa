"""Running the installed commands: many short runs at once, one per core (a test that checks
dozens, each mostly an interpreter starting, waits for them side by side); and a command started
with what a test changes before it runs (closed standard streams, a file limit, a terminal).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_each(
    argvs: Sequence[Sequence[str]], timeout: float = 60
) -> list[subprocess.CompletedProcess[str]]:
    """subprocess.run of every argv (output captured as text), in the order given."""

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(run, argvs))


def exec_argv(
    argv: Sequence[str | Path],
    *,
    closed: Sequence[int] = (),
    nofile: tuple[int, int] | None = None,
    terminal: bool = False,
) -> list[str]:
    """argv, started by small programs that each make one change and exec the next, so the
    command runs as the very process started (its pid is the one signalled): `closed` fds
    closed (`<&-`, `>&-`), RLIMIT_NOFILE set to (soft, hard), or a new session whose
    controlling terminal is its standard input.

    Not a preexec_fn: with one, subprocess forks where it otherwise vforks, which runs gRPC's
    fork handlers in the child; since grpcio 1.81 they restart its poller there, and the poller
    dies on the epoll fd that close_fds closes before the exec ("epoll_wait error: Bad file
    descriptor", grpc/grpc#43055), so now and then the command never started.
    """
    command = [str(part) for part in argv]
    if closed:
        command = ["sh", "-c", 'exec "$0" "$@" ' + " ".join(f"{fd}>&-" for fd in closed), *command]
    if nofile is not None:
        command = ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--", *command]
    if terminal:
        command = ["setsid", "--ctty", *command]
    return command
