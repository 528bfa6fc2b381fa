"""The served viewer on a large root: the server's CPU, a run page's and a poll's time while
list pages poll.

`python -m bench.site_bench ROOT` serves ROOT with `trace-reducer view ROOT --listen` and, for
`--seconds`, has `--tabs` clients poll `/api/runs` as the list page does (its question: the
newest runs first, a page of them, which a tree from before the served list was paged answers
with every run, as its page asked; the tag of the answer they have sent back; the next poll
after the longer of 2 s and four times the last answer's time) while one client opens a run
page every second, the pages spread over the root. Each round reports the server's CPU share
(CPU seconds over the round's wall time, from /proc) and the median and slowest run page and
poll. With `--browser` each round first opens the list page in headless Chromium (the server
warm): the page's bytes, the seconds until it is ready, its script's heap, and the seconds from
typing one run's bundle name into the search box until that run is the only row. With
`--trees A,B` each tree's server takes a turn, the order alternating each round (a tree's
project packages from its directory on PYTHONPATH, as `bench.tree_ab` runs them); `--make N`
first fills ROOT with N hard links of 200 server-made one-turn rollouts, the way `bench p9`
makes its root.
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
from bench.view_bench import headless_chromium

THIS_TREE = Path(__file__).resolve().parents[1]
_ADDRESS = re.compile(r"serving (http://127\.0\.0\.1:\d+/)")
# What the list page waits between polls (_list.js: POLL_MS, POLL_BACKOFF).
_POLL_SECONDS = 2.0
_POLL_BACKOFF = 4
_PAGE_EVERY = 1.0


# The list page's own question (_list.js, _site._PAGE_QUERY).
_PAGE_QUESTION = {"sort": "-started", "limit": "500"}


@dataclass(frozen=True)
class ListPage:
    """The list page in a browser: its document's bytes, the seconds until it is ready, its
    script's heap in bytes once ready, and the seconds a search for one run took."""

    size: int
    ready: float
    heap: float
    search: float


@dataclass(frozen=True)
class SiteRound:
    cpu_share: float
    page_median: float
    page_max: float
    poll_median: float
    pages: int
    polls: int
    list_page: ListPage | None = None


def open_list(address: str, bundle: str) -> ListPage:
    """The list page of the server at address in headless Chromium, searched for `bundle`."""
    # Asked apart: a browser keeps no body as large as a list page of every run was.
    size = len(httpx.get(address, timeout=600).raise_for_status().content)
    with headless_chromium() as browser:
        page = browser.new_page()
        started = time.perf_counter()
        page.goto(address, timeout=600_000)
        page.wait_for_selector("body[data-ready=true]", timeout=600_000)
        ready = time.perf_counter() - started
        metrics = page.context.new_cdp_session(page)
        metrics.send("Performance.enable")
        heap = next(
            metric["value"]
            for metric in metrics.send("Performance.getMetrics")["metrics"]
            if metric["name"] == "JSHeapUsedSize"
        )
        started = time.perf_counter()
        page.fill("#search", bundle.rsplit("/", 1)[-1])
        # The page's policy lets no script of ours run: a selector, then.
        only = f'#runs tbody tr[data-bundle="{bundle}"]:only-child'
        page.wait_for_selector(only, state="attached", timeout=600_000)
        search = time.perf_counter() - started
    return ListPage(size, ready, heap, search)


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


def measure(
    root: Path, tree: Path, *, tabs: int, seconds: float, browser: bool = False
) -> SiteRound:
    """One round against `tree`'s served viewer of root."""
    with _served(root, tree) as (address, pid), httpx.Client(base_url=address, timeout=600) as http:
        runs = http.get("/api/runs").raise_for_status().json()["runs"]  # the index made warm
        if not runs:
            raise RuntimeError(f"no runs under {root}")
        links = [run["href"] for run in runs[:: max(1, len(runs) // 50)]]
        # The run listed last: the newest-first page draws it last, or not at all.
        list_page = open_list(address, runs[-1]["bundle"]) if browser else None
        stop = threading.Event()
        polls: list[float] = []

        def tab() -> None:
            with httpx.Client(base_url=address, timeout=600) as client:
                tag = None
                while not stop.is_set():
                    started = time.perf_counter()
                    answer = client.get(
                        "/api/runs",
                        params=_PAGE_QUESTION,
                        headers={"If-None-Match": tag} if tag else {},
                    )
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
        list_page,
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
    parser.add_argument("--browser", action="store_true", help="the list page in Chromium too")
    args = parser.parse_args()
    if args.make:
        linked_root(args.root, args.root.parent / f"{args.root.name}-templates", args.make)
    trees = [Path(tree).resolve() for tree in args.trees.split(",")]
    results: dict[Path, list[SiteRound]] = {tree: [] for tree in trees}
    for number in range(args.rounds):
        for tree in trees if number % 2 == 0 else trees[::-1]:
            result = measure(
                args.root, tree, tabs=args.tabs, seconds=args.seconds, browser=args.browser
            )
            results[tree].append(result)
            print(f"round {number} {tree}: {result}", flush=True)
    for tree, rounds in results.items():
        print(
            f"{tree}: server CPU share {_spread([r.cpu_share for r in rounds])}; run page "
            f"(median of a round) {_spread([r.page_median for r in rounds], unit=' s')}, slowest "
            f"{_spread([r.page_max for r in rounds], unit=' s')}; poll (median of a round) "
            f"{_spread([r.poll_median for r in rounds], unit=' s')} (min / median / max)"
        )
        opened = [r.list_page for r in rounds if r.list_page is not None]
        if opened:
            print(
                f"{tree}: list page {_spread([o.size for o in opened], 1e-6, ' MB')}, ready in "
                f"{_spread([o.ready for o in opened], unit=' s')}, script heap "
                f"{_spread([o.heap for o in opened], 1e-6, ' MB')}, a search for one run "
                f"{_spread([o.search for o in opened], unit=' s')} (min / median / max)"
            )


if __name__ == "__main__":
    main()
