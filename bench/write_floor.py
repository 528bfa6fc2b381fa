"""P3's floor: what one small `write()` to a bundle costs, by file system and by spacing.

`python -m bench.write_floor DIR [DIR ...]` appends a 30-byte record-sized write to a file in
each directory, `--writes` a round, with the writes back to back and then spaced by each of
`--spacing` milliseconds (a `time.sleep` before each write, outside the timed call); beside
them the same write to `/dev/null` (a write with no file behind it) and `os.getppid()` (a system
call that does nothing). Rounds alternate the targets and spacings. Each figure is the wall time
of the one call alone, its median over a round; the table gives min / median / max over
`--rounds` rounds.

It separates what a recorded delta's `write()` could be paying for: the file system (a directory
on ext4 against one on tmpfs, such as `/dev/shm`, and against `/dev/null`, at the same spacing)
and the cost of any system call made after the thread has been idle (the spacings against each
other, `getppid` included). The P3 run writes one record a delta every 5 ms per thread.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_RECORD = b"\x1c" + b"x" * 29


NULL = "/dev/null"
SYSCALL = "getppid()"


def _timed(call: Callable[[], object], calls: int, spacing_s: float) -> float:
    """The median wall time of `call` in µs, over `calls` calls `spacing_s` apart."""
    costs: list[int] = []
    for _ in range(calls):
        if spacing_s:
            time.sleep(spacing_s)
        start = time.perf_counter_ns()
        call()
        costs.append(time.perf_counter_ns() - start)
    return statistics.median(costs) / 1000


def one_round(target: str, writes: int, spacing_s: float) -> float:
    """One round's median µs a call: a write into a new file in directory `target`, or to NULL,
    or the SYSCALL."""
    if target == SYSCALL:
        return _timed(os.getppid, writes, spacing_s)
    if target == NULL:
        fd = os.open(NULL, os.O_WRONLY | os.O_CLOEXEC)
        try:
            return _timed(functools.partial(os.write, fd, _RECORD), writes, spacing_s)
        finally:
            os.close(fd)
    with tempfile.NamedTemporaryFile(dir=target, prefix="write-floor-") as handle:
        return _timed(functools.partial(os.write, handle.fileno(), _RECORD), writes, spacing_s)


def file_system(path: str) -> str:
    """The type of the file system holding path (from /proc/self/mounts), or "?"."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "?"
    resolved = os.path.realpath(path)
    best, kind = "", "?"
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def measure_writes(
    targets: list[str], spacings_ms: list[float], *, writes: int = 400, rounds: int = 5
) -> dict[tuple[str, float], list[float]]:
    """Each (target, spacing in ms)'s median µs a call, one figure per round: every directory
    of targets, then NULL and SYSCALL, in rounds whose order alternates."""
    cases = [(target, spacing) for spacing in spacings_ms for target in [*targets, NULL, SYSCALL]]
    results: dict[tuple[str, float], list[float]] = {case: [] for case in cases}
    for index in range(rounds):
        # Alternate the order so that neither case always runs first in a round.
        for case in cases if index % 2 == 0 else reversed(cases):
            target, spacing = case
            results[case].append(one_round(target, writes, spacing / 1000))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", help="where to write, one file each")
    parser.add_argument("--writes", type=int, default=400, help="writes a round (default 400)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument(
        "--spacing",
        type=float,
        nargs="+",
        default=[0.0, 0.25, 5.0],
        help="milliseconds between writes (default 0 0.25 5)",
    )
    args = parser.parse_args(argv)
    results = measure_writes(args.directories, args.spacing, writes=args.writes, rounds=args.rounds)
    print("target\tspacing ms\tµs a call, min / median / max")
    for (target, spacing), figures in results.items():
        low, mid, high = min(figures), statistics.median(figures), max(figures)
        label = target if target in {NULL, SYSCALL} else f"{target} ({file_system(target)})"
        print(f"{label}\t{spacing:g}\t{low:.2f} / {mid:.2f} / {high:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
