"""What the test process itself spends: bytes it read, and the peak of its Python allocations."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable


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
