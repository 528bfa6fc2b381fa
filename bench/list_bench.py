"""`trace-reducer list` over a large root: cold (every bundle reduced once), warm (the index
only), one bundle changed; beside the floor of finding the bundles at all (walk and stat)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.batch_bench import make_bundles

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
# The floor: the same interpreter finding every bundle and its files' times and nothing else,
# written bare (no package code): list the root, list each directory in it, lstat the files
# a listing compares (trace.binpb, state.json, rewards.binpb).
FLOOR = """
import os, sys
found = 0
for entry in os.scandir(sys.argv[1]):
    if not entry.is_dir(follow_symlinks=False):
        continue
    with os.scandir(entry.path) as inside:
        for file in inside:
            if file.name in ("trace.binpb", "state.json", "rewards.binpb"):
                file.stat(follow_symlinks=False)
                found += file.name == "trace.binpb"
print(found)
"""


@dataclass
class ListResult:
    bundles: int
    templates: int
    cold_seconds: float
    warm: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)


def _timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f} s"


def linked_root(runs: Path, templates: Path, bundles: int, made: int = 200) -> None:
    """Fill `runs` with `bundles` bundles, each a hard link of one of `made` one-turn
    rollouts recorded by the agent server into `templates` (recorded once, kept after): each
    is a real bundle to reduce, made in seconds. Those already there are kept."""
    if not templates.is_dir():
        make_bundles(templates, made)
    sources = sorted(templates.glob("*/trace.binpb"))
    runs.mkdir(parents=True, exist_ok=True)
    for index in range(bundles):
        bundle = runs / f"20260101T000000Z-thread_{index:032x}"
        bundle.mkdir(exist_ok=True)
        if not (bundle / "trace.binpb").exists():
            os.link(sources[index % len(sources)], bundle / "trace.binpb")


def measure_list(root: Path, bundles: int, templates: int = 200, rounds: int = 5) -> ListResult:
    runs = root / "list-root"
    linked_root(runs, root / "list-templates", bundles, templates)
    listing = [TRACE_REDUCER, "list", str(runs), "--json"]
    result = ListResult(bundles, templates, _timed(listing))
    # Alternating rounds, the floor first in every other one: neither always runs second.
    for round_ in range(rounds):
        pair = [("warm", listing), ("floor", [sys.executable, "-c", FLOOR, str(runs)])]
        for name, argv in pair if round_ % 2 == 0 else reversed(pair):
            getattr(result, name).append(_timed(argv))
    changed = runs / "20260101T000000Z-thread_00000000000000000000000000000000" / "trace.binpb"
    for _ in range(rounds):
        os.utime(changed)
        result.changed.append(_timed(listing))
    return result
