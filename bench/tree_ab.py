"""P1's levers: `replay_bundle` of two source trees beside the lazy JSONL peer, same run.

    python -m bench.tree_ab BASE_TREE NEW_TREE BUNDLE [BUNDLE ...] [--rounds N]

Each round runs one fresh interpreter per tree (their order alternating), with the tree first on
its path; each child times `replay_bundle` (complete, then compact) and the lazy peer on every
bundle as CPU time, best of three. The JSONL twin of each bundle is written once, beside it in a
temporary directory. Prints min / median / max over the rounds, and each tree's time as a
multiple of the lazy peer's timed in the same child.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.jsonl_peer import write_codex_jsonl

_CONTENDERS = ("complete", "compact", "lazy peer")


def _child(bundles: list[str], jsonl_dir: str) -> None:
    # The tree's trace_reducer (first on the path), beside this tree's peer, the same for both.
    from trace_reducer import replay_bundle

    spec = importlib.util.spec_from_file_location(
        "_peer", Path(__file__).with_name("jsonl_peer.py")
    )
    assert spec is not None
    assert spec.loader is not None
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    reduce_codex_jsonl = peer.reduce_codex_jsonl
    out: dict[str, float] = {}
    for number, bundle in enumerate(bundles):
        jsonl = Path(jsonl_dir) / f"{number}.jsonl"
        work: dict[str, Callable[[], object]] = {
            "complete": functools.partial(replay_bundle, bundle),
            "compact": functools.partial(replay_bundle, bundle, compact=True),
            "lazy peer": functools.partial(reduce_codex_jsonl, jsonl, lazy=True),
        }
        for name, run in work.items():
            best = float("inf")
            for _ in range(3):
                gc.collect()
                started = time.process_time()
                run()
                best = min(best, time.process_time() - started)
            out[f"{number} {name}"] = best
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tree_ab")
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.bundles, args.child)
        return
    trees = {"base": args.base, "new": args.new}
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as jsonl_dir:
        for number, bundle in enumerate(args.bundles):
            write_codex_jsonl(Path(bundle), Path(jsonl_dir) / f"{number}.jsonl")
        for round_number in range(args.rounds):
            order = list(trees) if round_number % 2 == 0 else list(trees)[::-1]
            for tree in order:
                env = dict(os.environ, PYTHONPATH=trees[tree])
                argv = [sys.executable, __file__, args.base, args.new]
                argv += [*args.bundles, "--child", jsonl_dir]
                done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
                results[tree].append(json.loads(done.stdout))
    for number, bundle in enumerate(args.bundles):
        print(bundle)
        for name in _CONTENDERS:
            cells = []
            for tree, rounds in results.items():
                ms = [entry[f"{number} {name}"] * 1000 for entry in rounds]
                cells.append(f"{tree} {min(ms):.1f} / {statistics.median(ms):.1f} / {max(ms):.1f}")
            print(f"  {name:9s} ms  " + "   ".join(cells))
        for name in _CONTENDERS[:2]:
            cells = []
            for tree, rounds in results.items():
                ratios = [
                    entry[f"{number} {name}"] / entry[f"{number} lazy peer"] for entry in rounds
                ]
                low, mid, high = min(ratios), statistics.median(ratios), max(ratios)
                cells.append(f"{tree} {low:.2f} / {mid:.2f} / {high:.2f}")
            print(f"  {name:9s} / lazy peer  " + "   ".join(cells))


if __name__ == "__main__":
    main()
