"""Running the installed commands: many short runs at once, one per core (a test that checks
dozens, each mostly an interpreter starting, waits for them side by side); and a command started
with what a test changes before it runs (closed standard streams, a file limit, a terminal).
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import termios
from collections.abc import Callable, Sequence
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


def run_on_terminal(
    *argv: str | Path,
    interrupt_when: Callable[[str], bool] | None = None,
    interrupt_with: signal.Signals = signal.SIGINT,
) -> tuple[int, str, str]:
    """The command with its stderr on a pseudo-terminal (what a person at a terminal sees),
    stdout on a pipe (what a script reads): its exit code, stdout and what the terminal got.
    With `interrupt_when`, a SIGINT (Ctrl-C; or `interrupt_with`) is sent once what the
    terminal got so far satisfies it: a person pressing Ctrl-C on seeing the progress."""
    controller, terminal = pty.openpty()
    # A terminal of 120 columns, as a person's would be (a new pty has none).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process: subprocess.Popen[bytes] | None = None
    try:
        process = subprocess.Popen(
            [str(part) for part in argv],
            stdout=subprocess.PIPE,
            stderr=terminal,
            stdin=subprocess.DEVNULL,
        )
        os.close(terminal)
        terminal = -1
        seen = bytearray()
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            seen += chunk
            if interrupt_when is not None and interrupt_when(seen.decode(errors="replace")):
                process.send_signal(interrupt_with)
                interrupt_when = None
        out = process.stdout.read() if process.stdout is not None else b""
        code = process.wait(timeout=60)
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
        # Its stdout pipe too (was left to the garbage collector: a ResourceWarning each).
        if process is not None and process.stdout is not None:
            process.stdout.close()
    return code, out.decode(), seen.decode(errors="replace")


PAUSE_IMPORT_DIR = Path(__file__).with_name("import_pause")


def interrupt_while_importing(
    argv: Sequence[str | Path], module: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """argv run with the first import of `module` held (tests/import_pause/sitecustomize.py)
    and a SIGINT sent to it there, as a Ctrl-C pressed while the command loads: its exit code
    and output. Fails the test if the command ends without importing `module`."""
    ready_read, ready_write = os.pipe()
    wait_read, wait_write = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(PAUSE_IMPORT_DIR), env.get("PYTHONPATH", "")) if part
    )
    env["ROLLOUT_TEST_PAUSE_IMPORT"] = module
    env["ROLLOUT_TEST_PAUSE_FDS"] = f"{ready_write},{wait_read}"
    try:
        process = subprocess.Popen(
            [str(part) for part in argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(ready_write, wait_read),
        )
    finally:
        os.close(ready_write)
        os.close(wait_read)
    try:
        # EOF instead of the byte: the command ended (its fds closed) without importing module.
        paused = os.read(ready_read, 1)
        if paused:
            process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=timeout)
    finally:
        os.close(wait_write)
        os.close(ready_read)
        if process.poll() is None:
            process.kill()
            process.wait()
    assert paused, f"{argv} ended without importing {module}: {err}"
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
