"""What the test process itself spends (bytes it read, the peak of its Python allocations), and
whether another process is still running."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path


def read_bytes_of_process() -> int:
    """Bytes this process has read through read(2) and its kin so far (Linux)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def peak_bytes(work: Callable[[], object]) -> int:
    """The peak of Python allocations while work runs."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def running(pid: int) -> bool:
    """Whether pid is a process that has not ended (a zombie has: only its reaping is due)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped between open and read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
