"""The served viewer on a large root: the server's CPU, a run page's and a poll's time while
list pages poll.

`python -m bench.site_bench ROOT` serves ROOT with `trace-reducer view ROOT --listen` and, for
`--seconds`, has `--tabs` clients poll `/api/runs` as the list page does (the tag of the list
they have sent back, the next poll after the longer of 2 s and four times the last answer's
time) while one client opens a run page every second, the pages spread over the root. Each
round reports the server's CPU share (CPU seconds over the round's wall time, from /proc) and
the median and slowest run page and poll. With `--trees A,B` each tree's server takes a turn,
the order alternating each round (a tree's project packages from its directory on
PYTHONPATH, as `bench.tree_ab` runs them); `--make N` first fills ROOT with N hard links of 200
server-made one-turn rollouts, the way `bench p9` makes its root.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench._harness import cpu_seconds
from bench.list_bench import linked_root

THIS_TREE = Path(__file__).resolve().parents[1]
_ADDRESS = re.compile(r"serving (http://127\.0\.0\.1:\d+/)")
# What the list page waits between polls (_list.js: POLL_MS, POLL_BACKOFF).
_POLL_SECONDS = 2.0
_POLL_BACKOFF = 4
_PAGE_EVERY = 1.0


@dataclass(frozen=True)
class SiteRound:
    cpu_share: float
    page_median: float
    page_max: float
    poll_median: float
    pages: int
    polls: int


@contextmanager
def _served(root: Path, tree: Path) -> Iterator[tuple[str, int]]:
    """`trace-reducer view ROOT` of `tree` on a loopback port; its address and process id."""
    argv = [sys.executable, "-m", "trace_reducer.cli", "view", str(root), "--listen", "127.0.0.1:0"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    popen = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert popen.stdout is not None
    try:
        address = None
        for line in popen.stdout:
            if found := _ADDRESS.search(line):
                address = found.group(1)
                break
        if address is None:
            raise RuntimeError(f"trace-reducer view did not start in {tree}")
        # Its later lines (warnings) are read and dropped, so a full pipe never stalls it.
        threading.Thread(target=popen.stdout.read, daemon=True).start()
        yield address, popen.pid
    finally:
        popen.terminate()
        popen.wait()


def measure(root: Path, tree: Path, *, tabs: int, seconds: float) -> SiteRound:
    """One round against `tree`'s served viewer of root."""
    with _served(root, tree) as (address, pid), httpx.Client(base_url=address, timeout=600) as http:
        runs = http.get("/api/runs").raise_for_status().json()["runs"]  # the index made warm
        if not runs:
            raise RuntimeError(f"no runs under {root}")
        links = [run["href"] for run in runs[:: max(1, len(runs) // 50)]]
        stop = threading.Event()
        polls: list[float] = []

        def tab() -> None:
            with httpx.Client(base_url=address, timeout=600) as client:
                tag = None
                while not stop.is_set():
                    started = time.perf_counter()
                    answer = client.get("/api/runs", headers={"If-None-Match": tag} if tag else {})
                    took = time.perf_counter() - started
                    polls.append(took)
                    tag = answer.headers["ETag"]
                    stop.wait(max(_POLL_SECONDS, _POLL_BACKOFF * took))

        cpu_before = cpu_seconds(pid)
        began = time.perf_counter()
        tab_threads = [threading.Thread(target=tab) for _ in range(tabs)]
        for thread in tab_threads:
            thread.start()
        pages: list[float] = []
        try:
            while time.perf_counter() - began < seconds:
                started = time.perf_counter()
                http.get(links[len(pages) % len(links)]).raise_for_status()
                pages.append(time.perf_counter() - started)
                stop.wait(_PAGE_EVERY)
        finally:
            stop.set()
            for thread in tab_threads:
                thread.join()
        wall = time.perf_counter() - began
        cpu = cpu_seconds(pid) - cpu_before
    return SiteRound(
        cpu / wall,
        statistics.median(pages),
        max(pages),
        statistics.median(polls) if polls else float("nan"),
        len(pages),
        len(polls),
    )


def _spread(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    ordered = sorted(value * scale for value in values)
    return f"{ordered[0]:.2f} / {statistics.median(ordered):.2f} / {ordered[-1]:.2f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--trees", default=str(THIS_TREE), help="comma-separated checkouts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tabs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--make", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.make:
        linked_root(args.root, args.root.parent / f"{args.root.name}-templates", args.make)
    trees = [Path(tree).resolve() for tree in args.trees.split(",")]
    results: dict[Path, list[SiteRound]] = {tree: [] for tree in trees}
    for number in range(args.rounds):
        for tree in trees if number % 2 == 0 else trees[::-1]:
            result = measure(args.root, tree, tabs=args.tabs, seconds=args.seconds)
            results[tree].append(result)
            print(f"round {number} {tree}: {result}", flush=True)
    for tree, rounds in results.items():
        print(
            f"{tree}: server CPU share {_spread([r.cpu_share for r in rounds])}; run page "
            f"(median of a round) {_spread([r.page_median for r in rounds], unit=' s')}, slowest "
            f"{_spread([r.page_max for r in rounds], unit=' s')}; poll (median of a round) "
            f"{_spread([r.poll_median for r in rounds], unit=' s')} (min / median / max)"
        )


if __name__ == "__main__":
    main()
