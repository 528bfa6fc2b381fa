"""Loopback ports for a server a test starts on a port of the test's choosing."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral ports (those a bind to port 0 gets) begin."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range.

    Not a bind to port 0: that port comes from the ephemeral range, from which the server
    under test (the built-in local model it starts first, vLLM's own sockets) and every process
    beside it take theirs, and one was handed the port just let go before the server bound it:
    the test then talked to the wrong server. No bind to 0 hands out a port below the range.
    """
    low = _ephemeral_low()
    candidates = range(max(1024, low - 10_000), low)
    for port in random.sample(candidates, 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port from {candidates.start} to {candidates.stop - 1}")
