"""A lever measured end to end: this tree's code against another tree's, in the same run.

`python -m bench.tree_ab --baseline DIR p1 BUNDLE...` times `replay_bundle` (complete, then
compact) of each tree on each bundle beside the lazy JSONL peer (this tree's, for both), in a fresh
interpreter per tree and round, the order alternating; each time is CPU time, the best of three
(with `--repeat N`, the mean of N back to back, as a batch or a service replays). With
`--instructions` it counts each replay's instructions under callgrind instead: the same for the
same code and input whatever else the machine is doing.

`python -m bench.tree_ab --baseline DIR long` runs 4 threads of 300 turns each (`--threads`,
`--turns`; 20-word replies, the whole history re-sent with every request) against each tree's
recording server, reporting server CPU a turn.

`python -m bench.tree_ab --baseline DIR p5` runs P5's load (200 threads x 50 deltas/s on the
stamped model, recording on) against this tree's server, DIR's server (a checkout of the commit
before the lever: `git worktree add DIR main`) and the bare grpc.aio floor, in rounds whose order
rotates; `p3` runs P3's (20 threads x 3 turns of 300-word replies at 5 ms a word) against four
servers, each tree's with recording on and off. `f1` reads the same paced SSE streams
(`bench.provider_floor`: 100 at once, 100 events each) with each tree's agent reader
(`ProviderClient.batches`, on uvloop as the server runs it) beside the aiohttp floor, a fresh
interpreter per reader and round. Both servers run on this interpreter and its installed
dependencies; only the project's own packages come from DIR (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from agent_server.local_model import reply_words
from bench import agent_bench, grpc_floor
from bench._harness import Process, agent_server_argv, cpu_seconds, prompt, rotate, spawn
from bench.jsonl_peer import write_codex_jsonl

# Run with the tree's project first on the path: nothing of bench/ is imported from there, the
# peer is this tree's (loaded by its file), so both trees are set beside the same peer. The
# child says where its trace_reducer came from, for the parent to check.
# Both children's start: the contenders of one bundle (and its JSON lines), by name.
_CHILD_CONTENDERS = """
import functools, gc, importlib.util, json, pathlib, sys, time
import trace_reducer
from trace_reducer import replay_bundle
def contenders(peer_file, bundle, jsonl):
    spec = importlib.util.spec_from_file_location("_peer", peer_file)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return {
        "complete": functools.partial(replay_bundle, bundle),
        "compact": functools.partial(replay_bundle, bundle, compact=True),
        "lazy peer": functools.partial(
            peer.reduce_codex_jsonl, pathlib.Path(jsonl), lazy=True
        ),
    }
"""
_P1_CHILD = (
    _CHILD_CONTENDERS
    + """
peer_file, jsonl_dir, repeat, *bundles = sys.argv[1:]
repeat = int(repeat)
out = {}
for number, bundle in enumerate(bundles):
    work = contenders(peer_file, bundle, pathlib.Path(jsonl_dir, f"{number}.jsonl"))
    for name, run in work.items():
        if repeat:
            # Back to back, as a batch or a service replays: the collector's share counts.
            run()
            started = time.process_time()
            for _ in range(repeat):
                run()
            out[f"{number} {name}"] = (time.process_time() - started) / repeat
            continue
        best = float("inf")
        for _ in range(3):
            gc.collect()
            started = time.process_time()
            run()
            best = min(best, time.process_time() - started)
        out[f"{number} {name}"] = best
out["_from"] = trace_reducer.__file__
print(json.dumps(out))
"""
)
_P1_CONTENDERS = ("complete", "compact", "lazy peer")


@contextlib.contextmanager
def _server_of(tree: Path | None, argv: list[str]) -> Iterator[Process]:
    """argv's server, importing the project from `tree` (None: this one)."""
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree)
    # spawn() reads the environment once, when it starts the process.
    server = spawn(argv)
    try:
        process = server.__enter__()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield process
    finally:
        server.__exit__(None, None, None)


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def p1(baseline: Path, rounds: int, bundles: list[str], repeat: int = 0) -> None:
    trees = {"base": str(baseline), "this": str(Path(__file__).resolve().parents[1])}
    peer_file = str(Path(__file__).with_name("jsonl_peer.py"))
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as jsonl_dir:
        for number, bundle in enumerate(bundles):
            write_codex_jsonl(Path(bundle), Path(jsonl_dir) / f"{number}.jsonl")

        def child(tree: str) -> None:
            out = run_in_tree(
                Path(trees[tree]), _P1_CHILD, peer_file, jsonl_dir, str(repeat), *bundles
            )
            results[tree].append(out)

        rotate([functools.partial(child, tree) for tree in trees], rounds)
    for number, bundle in enumerate(bundles):
        print(bundle)
        for name in _P1_CONTENDERS:
            cells = [
                f"{tree} {_spread([entry[f'{number} {name}'] * 1000 for entry in runs])}"
                for tree, runs in results.items()
            ]
            print(f"  {name:9s} ms (min / median / max)  " + "   ".join(cells))
        for name in _P1_CONTENDERS[:2]:
            cells = []
            for tree, runs in results.items():
                ratios = [
                    entry[f"{number} {name}"] / entry[f"{number} lazy peer"] for entry in runs
                ]
                cells.append(
                    f"{tree} {min(ratios):.2f} / {statistics.median(ratios):.2f} / "
                    f"{max(ratios):.2f}"
                )
            print(f"  {name:9s} / lazy peer  " + "   ".join(cells))


def run_in_tree(tree: Path, code: str, *args: str, prefix: Sequence[str] = ()) -> dict[str, float]:
    """Run `code` (which prints a JSON object, its "_from" the trace_reducer file it imported)
    in a fresh interpreter importing the project from `tree`; return the object without
    "_from". Raises RuntimeError when the child fails or imported the project from elsewhere.
    prefix: what the interpreter runs under (valgrind, say).

    `-P`: with `-c`, Python puts the working directory first on the path, before PYTHONPATH,
    so run from a checkout the child would import that checkout instead of `tree`.
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [*prefix, sys.executable, "-P", "-c", code, *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the child in {tree} failed:\n{done.stderr}")
    out: dict[str, float] = json.loads(done.stdout)
    source = Path(str(out.pop("_from")))
    if not source.resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the child meant for {tree} imported trace_reducer from {source}")
    return out


# One contender of one bundle, replayed `extra` times after a first replay of it: under
# callgrind, the instructions of `extra` replays are the difference from the same child run
# with none (the import, the first replay's warm-up and the exit cancel).
_P1_COUNT_CHILD = (
    _CHILD_CONTENDERS
    + """
peer_file, jsonl, bundle, name, extra = sys.argv[1:]
work = contenders(peer_file, bundle, jsonl)[name]
for _ in range(1 + int(extra)):
    work()
print(json.dumps({"_from": trace_reducer.__file__}))
"""
)
_COUNTED_REPLAYS = 3


def _instructions(tree: Path, *args: str) -> int:
    """Instructions callgrind counts for _P1_COUNT_CHILD run in tree with args."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("tree_ab --instructions needs valgrind (Debian's valgrind package)")
    with tempfile.TemporaryDirectory() as scratch:
        out_file = Path(scratch, "callgrind.out")
        prefix = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out_file}", "-q"]
        run_in_tree(tree, _P1_COUNT_CHILD, *args, prefix=prefix)
        for line in out_file.read_text().splitlines():
            # The file's totals line: "summary: N" (older valgrinds) or "totals: N".
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"callgrind wrote no totals for {tree}")


def p1_instructions(baseline: Path, bundles: list[str]) -> None:
    """Instructions a replay of each bundle takes in each tree, and the lazy peer's: unlike
    CPU time, the same for the same code and input whatever else the machine is doing."""
    trees = {"base": baseline, "this": Path(__file__).resolve().parents[1]}
    peer_file = str(Path(__file__).with_name("jsonl_peer.py"))
    with tempfile.TemporaryDirectory() as jsonl_dir:
        for number, bundle in enumerate(bundles):
            jsonl = str(Path(jsonl_dir) / f"{number}.jsonl")
            write_codex_jsonl(Path(bundle), Path(jsonl))
            print(bundle)
            counts: dict[tuple[str, str], float] = {}
            for name in _P1_CONTENDERS:
                for tree_name, tree in trees.items():
                    if name == "lazy peer" and tree_name == "base":
                        continue  # the peer is this tree's for both
                    args = (peer_file, jsonl, bundle, name)
                    # Once outside callgrind first: the tree's bytecode is compiled and
                    # cached then, not in one of the two counted runs.
                    run_in_tree(tree, _P1_COUNT_CHILD, *args, "0")
                    none = _instructions(tree, *args, "0")
                    some = _instructions(tree, *args, str(_COUNTED_REPLAYS))
                    counts[tree_name, name] = (some - none) / _COUNTED_REPLAYS
            peer = counts["this", "lazy peer"]
            print(f"  lazy peer  {peer / 1e6:.1f} M instructions")
            for name in _P1_CONTENDERS[:2]:
                base, this = counts["base", name], counts["this", name]
                print(
                    f"  {name:9s}  base {base / 1e6:.1f} M, this {this / 1e6:.1f} M "
                    f"({(this - base) / base:+.1%}); x lazy peer base {base / peer:.2f}, "
                    f"this {this / peer:.2f}"
                )


def _paired(name: str, this: list[float], base: list[float]) -> str:
    """How many rounds this tree's figure was below the baseline's in the same round."""
    below = sum(1 for mine, theirs in zip(this, base, strict=True) if mine < theirs)
    return f"{name}: this below base in {below} of {len(this)} rounds"


def p5(
    baseline: Path,
    rounds: int,
    threads: int = 200,
    window: int = 10,
    turns: int = 2,
    base_args: tuple[str, ...] = (),
) -> None:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0.02"]
    per_stream = sum(len(reply_words(prompt(i))) for i in range(turns))
    root = Path(tempfile.mkdtemp(prefix="tree-ab-p5-"))
    # name -> (server CPU µs a delta, p99 ms, deltas a message) per round
    results: dict[str, list[tuple[float, float, float]]] = {"floor": [], "base": [], "this": []}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(spawn(model_argv))
        servers = {
            name: stack.enter_context(
                _server_of(
                    tree,
                    agent_server_argv(trace_root=root / name, provider_url=model.address)
                    + list(extra),
                )
            )
            for name, tree, extra in (("this", None, ()), ("base", baseline, base_args))
        }
        bare = stack.enter_context(grpc_floor.serve(0.02))

        def agent(name: str) -> None:
            pid = servers[name].popen.pid
            before = cpu_seconds(pid)
            run = asyncio.run(
                agent_bench._concurrent([servers[name].address], threads, turns, window)
            )
            if run.completed != threads:
                raise RuntimeError(f"{name}: {run.completed} of {threads} threads completed")
            spent = cpu_seconds(pid) - before
            results[name].append(
                (spent / run.deltas * 1e6, run.p99_ms, run.deltas / run.delta_events)
            )

        def floor() -> None:
            run = grpc_floor.drive(bare, threads, per_stream, window)
            results["floor"].append(
                (run.server_cpu_seconds / run.deltas * 1e6, run.p99_ms, run.deltas / run.messages)
            )

        rotate([floor, lambda: agent("base"), lambda: agent("this")], rounds)
    for name, runs in results.items():
        print(
            f"{name:5s} server CPU µs a delta {_spread([r[0] for r in runs])}; p99 ms "
            f"{_spread([r[1] for r in runs])}; deltas a message "
            f"{statistics.median(r[2] for r in runs):.2f} (min / median / max)"
        )
    for index, figure in ((0, "server CPU a delta"), (1, "p99")):
        this_runs = [r[index] for r in results["this"]]
        print(_paired(figure, this_runs, [r[index] for r in results["base"]]))


# One stack of bench.provider_floor (loaded by its file, this tree's) reading the paced
# streams once, on uvloop; the agent's reader is the child's tree's.
_F1_CHILD = """
import importlib.util, json, sys, uvloop
import trace_reducer
floor_file, address, stack, streams = sys.argv[1:]
spec = importlib.util.spec_from_file_location("_floor", floor_file)
floor = sys.modules["_floor"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floor)
count, cpu = uvloop.run(floor._round(stack, address, int(streams)))
print(json.dumps({"events": count, "cpu_us": cpu / count * 1e6, "_from": trace_reducer.__file__}))
"""


def f1(baseline: Path, rounds: int, streams: int = 100) -> None:
    here = Path(__file__).resolve().parents[1]
    floor_file = str(Path(__file__).with_name("provider_floor.py"))
    argv = [sys.executable, "-m", "bench.provider_floor", "--serve"]
    results: dict[str, list[float]] = {"floor": [], "base": [], "this": []}
    with spawn(argv) as server:

        def read(name: str, tree: Path, stack: str) -> None:
            out = run_in_tree(tree, _F1_CHILD, floor_file, server.address, stack, str(streams))
            results[name].append(out["cpu_us"])

        rotate(
            [
                functools.partial(read, "floor", here, "aiohttp"),
                functools.partial(read, "base", baseline, "agent"),
                functools.partial(read, "this", here, "agent"),
            ],
            rounds,
        )
    for name, runs in results.items():
        print(f"{name:5s} client CPU µs an event {_spread(runs)} (min / median / max)")
    print(_paired("CPU an event", results["this"], results["base"]))


def p3(
    baseline: Path, rounds: int, threads: int = 20, turns: int = 3, base_args: tuple[str, ...] = ()
) -> None:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0.005"]
    model_argv += ["--reply-length", "300"]
    root = Path(tempfile.mkdtemp(prefix="tree-ab-p3-"))
    names = {("this", True), ("this", False), ("base", True), ("base", False)}
    results: dict[tuple[str, bool], list[float]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(spawn(model_argv))
        servers = {
            (tree_name, on): stack.enter_context(
                _server_of(
                    None if tree_name == "this" else baseline,
                    agent_server_argv(
                        trace_root=root / f"{tree_name}-{on}" if on else None,
                        provider_url=model.address,
                    )
                    + (list(base_args) if tree_name == "base" else []),
                )
            )
            for tree_name, on in sorted(names)
        }
        for server in servers.values():
            asyncio.run(agent_bench._paced_threads(server.address, 2, 1))  # warm-up

        def run(name: tuple[str, bool]) -> None:
            pid = servers[name].popen.pid
            before = cpu_seconds(pid)
            deltas = asyncio.run(agent_bench._paced_threads(servers[name].address, threads, turns))
            results[name].append((cpu_seconds(pid) - before) / deltas * 1e6)

        rotate([functools.partial(run, name) for name in sorted(names)], rounds)
    for tree_name in ("base", "this"):
        on, off = results[(tree_name, True)], results[(tree_name, False)]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        print(
            f"{tree_name:5s} on {_spread(on)} µs a delta, off {_spread(off)}; on / off "
            f"{min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f} "
            "(min / median / max)"
        )


def long(baseline: Path, rounds: int, threads: int = 4, turns: int = 300) -> None:
    """Long threads: server CPU a turn over `turns` turns of 20-word replies a thread (the
    whole history re-sent with every request), recording on, each tree's server in turn."""
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0"]
    model_argv += ["--reply-length", "20"]
    root = Path(tempfile.mkdtemp(prefix="tree-ab-long-"))
    results: dict[str, list[float]] = {"base": [], "this": []}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(spawn(model_argv))
        servers = {
            name: stack.enter_context(
                _server_of(
                    tree, agent_server_argv(trace_root=root / name, provider_url=model.address)
                )
            )
            for name, tree in (("this", None), ("base", baseline))
        }

        def run(name: str) -> None:
            pid = servers[name].popen.pid
            before = cpu_seconds(pid)
            asyncio.run(agent_bench._paced_threads(servers[name].address, threads, turns))
            results[name].append((cpu_seconds(pid) - before) / (threads * turns) * 1e6)

        rotate([functools.partial(run, "base"), functools.partial(run, "this")], rounds)
    for name, runs in results.items():
        print(f"{name:5s} server CPU µs a turn {_spread(runs)} (min / median / max)")
    print(_paired("CPU a turn", results["this"], results["base"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bench", choices=("p1", "p5", "p3", "f1", "long"))
    parser.add_argument("bundles", nargs="*", help="p1: the bundles to replay")
    parser.add_argument("--baseline", type=Path, required=True, help="the other tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="p5: default 200; p3: default 20; long: 4")
    parser.add_argument("--turns", type=int, default=300, help="long: turns a thread")
    parser.add_argument(
        "--base-args", default="", help="p5, p3: flags added to the baseline's servers"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="p1: count each replay's instructions under callgrind instead of timing it",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="p1: the mean of this many replays back to back in one interpreter (the cycle "
        "collector's share included), instead of the best of three each after a collection",
    )
    args = parser.parse_args()
    baseline = args.baseline.resolve()
    base_args = tuple(shlex.split(args.base_args))
    if args.bench == "p1":
        if not args.bundles:
            parser.error("p1 needs the bundles to replay")
        if args.instructions:
            p1_instructions(baseline, args.bundles)
        else:
            p1(baseline, args.rounds, args.bundles, repeat=args.repeat)
    elif args.bench == "p5":
        p5(baseline, args.rounds, threads=args.threads or 200, base_args=base_args)
    elif args.bench == "f1":
        f1(baseline, args.rounds)
    elif args.bench == "long":
        long(baseline, args.rounds, threads=args.threads or 4, turns=args.turns)
    else:
        p3(baseline, args.rounds, threads=args.threads or 20, base_args=base_args)


if __name__ == "__main__":
    main()
