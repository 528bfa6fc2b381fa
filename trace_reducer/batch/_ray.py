"""reduce-all on Ray: the pool's per-bundle function run as Ray tasks, locally or on a cluster."""

from __future__ import annotations

import logging
import os
import signal
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

from ..bundle._errors import BundleError, RayUnavailableError, os_error_reason
from ..reduce._pool import Done, Handle
from ._batch import reduce_chunk

LOCAL = "local"
AUTO = "auto"
CLIENT = "ray://"
# The port a ray:// address without one means (Ray client's own default).
CLIENT_PORT = 10001
# How long the head's port may take to accept a connection before it is said to be unreachable.
REACH_SECONDS = 3.0


def check_reachable(address: str, timeout: float = REACH_SECONDS) -> None:
    """An explicit HOST:PORT or ray://HOST[:PORT] must accept a TCP connection: ray.init
    otherwise retries the address for ever (and names it by the host's IP, not as given).
    Raises BundleError (exit 2) naming the address as the user gave it."""
    client = address.startswith(CLIENT)
    rest = address[len(CLIENT) :] if client else address
    parts = urllib.parse.urlsplit("//" + rest)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number, or out of range
        host, port = None, None
    if client and host and port is None and not rest.endswith(":"):
        port = CLIENT_PORT
    if not host or not port or parts.path or parts.query or parts.fragment:
        raise BundleError(
            f"--ray {address}: expects auto, HOST:PORT or ray://HOST:PORT (bare --ray starts "
            "a local Ray)"
        )
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else os_error_reason(error)
        raise BundleError(
            f"cannot join Ray at {address}: {reason} (is a Ray head running there? "
            "`ray start --head` prints the address to give)"
        ) from error


class RayEngine:
    """Submits chunks of bundles as Ray tasks; starts a local Ray or joins a running cluster.

    address: LOCAL starts a Ray for this run (and stops it after); "auto" or HOST:PORT or
    ray://HOST:PORT joins one (an explicit address must accept a connection within
    REACH_SECONDS). A Ray already initialised in this process is used as it is.
    """

    name = "ray"

    def __init__(self, address: str, jobs: int | None) -> None:
        if address == LOCAL:
            # A Ray started for one command is this machine's alone: keep it on loopback
            # (Ray otherwise binds the host's address, as a cluster head would) and do not
            # report usage on the user's behalf.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            import ray  # optional, and slow to import
        except ImportError as error:
            raise RayUnavailableError("--ray", "ray", error.name) from error
        self._ray: Any = ray
        self._owns = not ray.is_initialized()
        if self._owns and address not in (LOCAL, AUTO):
            check_reachable(address)
        if self._owns:
            settings: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            # ray.init puts in its own SIGTERM handlers (sys.exit(15), and its core's, which
            # prints a stack): the driver died mid-batch with exit 15, no summary and that
            # stack. The command's is put back: SIGTERM stops it as Ctrl-C does (exit 143).
            on_sigterm = signal.getsignal(signal.SIGTERM)
            if address == LOCAL:
                # "local" makes Ray start its own, never join one it finds on this machine.
                ray.init(address="local", num_cpus=jobs or os.cpu_count() or 1, **settings)
            else:
                ray.init(address=address, **settings)
            if on_sigterm is not None and on_sigterm != signal.getsignal(signal.SIGTERM):
                signal.signal(signal.SIGTERM, on_sigterm)
        cpus = int(self._ray.cluster_resources().get("CPU", 1)) or 1
        self.slots = min(jobs, cpus) if jobs else cpus
        # Ray retries a task whose worker died; the driver retries bundle by bundle after that.
        self._remote = ray.remote(num_cpus=1, max_retries=2)(reduce_chunk)
        self._submitted: set[Handle] = set()

    def submit(self, chunk: Sequence[Any], args: tuple[Any, ...]) -> Handle:
        ref = self._remote.remote(chunk, *args)
        self._submitted.add(ref)
        return ref

    def wait(self, handles: list[Handle], timeout: float) -> list[tuple[Handle, Done]]:
        ray = self._ray
        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        finished: list[tuple[Handle, Done]] = []
        for ref in ready:
            self._submitted.discard(ref)
            try:
                finished.append((ref, ray.get(ref)))
            except Exception as error:  # noqa: BLE001 - reported per bundle by the driver
                finished.append((ref, error))
        return finished

    def close(self, *, cancel: bool) -> None:
        ray = self._ray
        if cancel:
            for ref in self._submitted:
                ray.cancel(ref)
        self._submitted.clear()
        if self._owns:
            ray.shutdown()
