"""A lever measured end to end: this tree's agent server against another tree's, same run.

`python -m bench.tree_ab --baseline DIR p5` runs P5's load (200 threads x 50 deltas/s on the
stamped model, recording on) against this tree's server, DIR's server (a checkout of the commit
before the lever: `git worktree add DIR main`) and the bare grpc.aio floor, in rounds whose order
rotates; `p3` runs P3's (20 threads x 3 turns of 300-word replies at 5 ms a word) against four
servers, each tree's with recording on and off. Both servers run on this interpreter and its
installed dependencies; only the project's own packages come from DIR (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from agent_server.local_model import reply_words
from bench import agent_bench, grpc_floor
from bench._harness import Process, agent_server_argv, spawn


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


def _rotate(contenders: list[Callable[[], None]], rounds: int) -> None:
    for round_number in range(rounds):
        shift = round_number % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            contender()


def p5(baseline: Path, rounds: int, threads: int = 200, window: int = 10, turns: int = 2) -> None:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0.02"]
    per_stream = sum(len(reply_words(agent_bench.prompt(i))) for i in range(turns))
    root = Path(tempfile.mkdtemp(prefix="tree-ab-p5-"))
    # name -> (server CPU µs a delta, p99 ms, deltas a message) per round
    results: dict[str, list[tuple[float, float, float]]] = {"floor": [], "base": [], "this": []}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(spawn(model_argv))
        servers = {
            name: stack.enter_context(
                _server_of(
                    tree,
                    agent_server_argv(trace_root=root / name, provider_url=model.address),
                )
            )
            for name, tree in (("this", None), ("base", baseline))
        }
        bare = stack.enter_context(grpc_floor.serve(0.02))

        def agent(name: str) -> None:
            pid = servers[name].popen.pid
            before = agent_bench.cpu_seconds(pid)
            run = asyncio.run(
                agent_bench._concurrent([servers[name].address], threads, turns, window)
            )
            if run.completed != threads:
                raise RuntimeError(f"{name}: {run.completed} of {threads} threads completed")
            spent = agent_bench.cpu_seconds(pid) - before
            results[name].append(
                (spent / run.deltas * 1e6, run.p99_ms, run.deltas / run.delta_events)
            )

        def floor() -> None:
            run = grpc_floor.drive(bare, threads, per_stream, window)
            results["floor"].append(
                (run.server_cpu_seconds / run.deltas * 1e6, run.p99_ms, run.deltas / run.messages)
            )

        _rotate([floor, lambda: agent("base"), lambda: agent("this")], rounds)
    for name, runs in results.items():
        print(
            f"{name:5s} server CPU µs a delta {_spread([r[0] for r in runs])}; p99 ms "
            f"{_spread([r[1] for r in runs])}; deltas a message "
            f"{statistics.median(r[2] for r in runs):.2f} (min / median / max)"
        )


def p3(baseline: Path, rounds: int, threads: int = 20, turns: int = 3) -> None:
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
                    ),
                )
            )
            for tree_name, on in sorted(names)
        }
        for server in servers.values():
            asyncio.run(agent_bench._paced_threads(server.address, 2, 1))  # warm-up

        def run(name: tuple[str, bool]) -> None:
            pid = servers[name].popen.pid
            before = agent_bench.cpu_seconds(pid)
            deltas = asyncio.run(agent_bench._paced_threads(servers[name].address, threads, turns))
            results[name].append((agent_bench.cpu_seconds(pid) - before) / deltas * 1e6)

        _rotate([functools.partial(run, name) for name in sorted(names)], rounds)
    for tree_name in ("base", "this"):
        on, off = results[(tree_name, True)], results[(tree_name, False)]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        print(
            f"{tree_name:5s} on {_spread(on)} µs a delta, off {_spread(off)}; on / off "
            f"{min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f} "
            "(min / median / max)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bench", choices=("p5", "p3"))
    parser.add_argument("--baseline", type=Path, required=True, help="the other tree")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    (p5 if args.bench == "p5" else p3)(args.baseline.resolve(), args.rounds)


if __name__ == "__main__":
    main()
