"""`serve --workers N`: a supervisor starting N server processes that share one address."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent_server.config import WORKER_ENV, Settings, WorkerRole
from grpc_common import install_signal_handlers, listen_error, refuse_address_in_use, split_listen
from trace_reducer._exits import AGENT_SERVER as PROG
from trace_reducer._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["leave_socket_dir", "supervise", "watch_supervisor"]

log = logging.getLogger(__name__)

# The longest path a Unix socket address holds (sun_path, with its NUL), on Linux and macOS.
_MAX_SOCKET_PATH = 103
_READY = b"listening on "


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, never listening: it holds the port
    (port 0: a free one) for the workers, who bind it the same way, until they all have.

    A concrete port is first tried without SO_REUSEPORT, so that one already in use is an
    error here, as it is for one process, rather than shared with whoever holds it."""
    refuse_address_in_use(host, port, _address(host, port))
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    held = socket.socket(family, kind, proto)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(address)
    except BaseException:
        held.close()
        raise
    return held


def _socket_dir(workers: int) -> Path:
    """A new 0700 directory for the workers' sockets: under $XDG_RUNTIME_DIR (the user's own,
    cleared at logout) when usable and short enough, else the temporary directory, else /tmp."""
    name = f"worker-{workers - 1}.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    # mkdtemp makes a fresh 0700 directory of a random name: safe in a shared /tmp.
    for base in (runtime, None, "/tmp"):  # noqa: S108
        if base is not None and not os.access(base, os.W_OK | os.X_OK):
            continue
        made = Path(tempfile.mkdtemp(prefix="agent-server-", dir=base))
        if len(str(made / name)) <= _MAX_SOCKET_PATH:
            return made
        made.rmdir()
    raise OSError("no directory for the workers' sockets has a path short enough")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Worker:
    """One worker process: when it is ready (its `listening on` line), when it ends."""

    def __init__(self, index: int, process: asyncio.subprocess.Process) -> None:
        self.index = index
        self.process = process
        self.exited = asyncio.ensure_future(process.wait())
        self.ready: asyncio.Future[bytes] = asyncio.ensure_future(self._ready())
        self._relay: asyncio.Task[None] | None = None

    async def _ready(self) -> bytes:
        stdout = self.process.stdout
        assert stdout is not None
        line = await stdout.readline()
        if line.startswith(_READY):
            # Anything it prints later goes where the supervisor's stdout goes.
            self._relay = asyncio.create_task(self._copy(stdout))
        return line

    async def _copy(self, stdout: asyncio.StreamReader) -> None:
        while line := await stdout.readline():
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)


async def supervise(settings: Settings, argv: Sequence[str]) -> int:
    """Start settings.workers copies of `serve ARGV` on one address, say `listening on` once
    they all serve, pass SIGTERM / SIGINT on to them; exit 0 when they all stopped cleanly,
    1 when one failed or died (the others are stopped then)."""
    host, port = split_listen(settings.listen)
    try:
        held = _reserve(host, port)
    except OSError as error:
        print(f"{PROG}: {listen_error(settings.listen, error)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        socket_dir = _socket_dir(settings.workers)
    except OSError as error:
        held.close()
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    address = _address(host, held.getsockname()[1])
    workers: list[_Worker] = []
    try:
        return await _run(settings, argv, address, socket_dir, held, workers)
    finally:
        held.close()
        for worker in workers:
            worker.signal(signal.SIGKILL)
        shutil.rmtree(socket_dir, ignore_errors=True)


async def _run(
    settings: Settings,
    argv: Sequence[str],
    address: str,
    socket_dir: Path,
    held: socket.socket,
    workers: list[_Worker],
) -> int:
    stop = asyncio.Event()

    def kill_all() -> None:
        for worker in workers:
            worker.signal(signal.SIGKILL)
        shutil.rmtree(socket_dir, ignore_errors=True)

    install_signal_handlers(stop.set, before_exit=kill_all)
    log.info(
        "starting workers", extra={"fields": {"workers": settings.workers, "address": address}}
    )
    for index in range(settings.workers):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent_server.cli",
            *argv,
            # The last of a flag given twice wins: the concrete port.
            "--listen",
            address,
            env={**os.environ, WORKER_ENV: f"{index}:{socket_dir}"},
            # Its end of this pipe reads EOF when the supervisor is gone, even by SIGKILL.
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # Its own session: a terminal's Ctrl-C reaches the supervisor alone, which
            # passes one signal on (two would make a worker exit at once).
            start_new_session=True,
        )
        workers.append(_Worker(index, process))
        log.info("worker started", extra={"fields": {"worker": index, "pid": process.pid}})
    stopping = asyncio.ensure_future(stop.wait())
    exits = [worker.exited for worker in workers]
    all_ready = asyncio.gather(*(worker.ready for worker in workers))
    first: list[asyncio.Future[Any]] = [all_ready, stopping, *exits]
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done() and not any(e.done() for e in exits):
        lines = all_ready.result()
        if all(line.startswith(_READY) for line in lines):
            # Every worker has bound the port: the reservation is no longer needed.
            held.close()
            log.info("every worker is serving", extra={"fields": {"address": address}})
            print(lines[0].decode().rstrip("\n"), flush=True)
            await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
        else:
            # A worker closed its stdout without serving: it is exiting.
            await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
    if not all_ready.done():
        all_ready.cancel()
    if stopping.done():
        log.info("shutting down")
        return await _stop_all(workers, EXIT_OK)
    stopping.cancel()
    failed = next(worker for worker in workers if worker.exited.done())
    code = failed.exited.result()
    served = failed.ready.done() and failed.ready.result().startswith(_READY)
    log.error(
        f"worker {failed.index} (pid {failed.process.pid}) {_ended(code)}"
        f"{'' if served else ' before it served'}; stopping the other workers",
        extra={"fields": {"worker": failed.index, "code": code}},
    )
    # A worker refusing its settings at start (exit 2) makes the supervisor refuse them too.
    return await _stop_all(workers, code if not served and 0 < code < 128 else EXIT_FAILED)


async def _stop_all(workers: list[_Worker], code: int) -> int:
    """SIGTERM to every worker still running, each drains as one server does; `code` when all
    exit 0, else 1."""
    for worker in workers:
        worker.signal(signal.SIGTERM)
    results = await asyncio.gather(*(worker.exited for worker in workers))
    for worker, result in zip(workers, results, strict=True):
        if result != 0 and code == EXIT_OK:
            log.error(
                f"worker {worker.index} (pid {worker.process.pid}) {_ended(result)}",
                extra={"fields": {"worker": worker.index, "code": result}},
            )
    log.info("stopped")
    if code == EXIT_OK and any(result != 0 for result in results):
        return EXIT_FAILED
    return code


def watch_supervisor(on_gone: Callable[[], None]) -> None:
    """Call on_gone once stdin, the supervisor's pipe, reads EOF: the supervisor is gone (a
    SIGKILL too closes its end), so the worker drains and exits rather than serve orphaned."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, 512)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            log.warning("the supervisor is gone: shutting down")
            on_gone()

    loop.add_reader(fd, readable)


def leave_socket_dir(role: WorkerRole) -> None:
    """The last worker out removes the sockets' directory (the supervisor does, unless it was
    killed); while another worker's socket is in it, it stays."""
    with contextlib.suppress(OSError):
        role.socket_dir.rmdir()
