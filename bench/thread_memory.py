"""What an open thread costs the agent server in memory, a turn at a time.

`python -m bench.thread_memory [--threads N] [--turns T] [--tree DIR]...` starts `agent-server
serve` on the built-in model (recording on, no word delay), opens N threads, runs T turns on
each while they stay open, then T more, and reports the server's resident memory (VmRSS) grown
a thread-turn in each half, and after every thread closed. Each `--tree` runs the server from
that checkout's packages (PYTHONPATH) in turn, so two trees are compared in one run.

An open thread keeps what its next turn needs (its history, and the history's encoded items) and
the last `--event-buffer` events for StreamEvents' replay, however long ago they were read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench._harness import agent_server_argv, prompt, spawn
from rollout_client import AgentClient, Thread


@dataclass(frozen=True)
class ThreadMemory:
    threads: int
    turns: int
    # KiB of VmRSS grown a thread-turn in the first and the second half, and VmRSS at each end.
    first_kib: float
    second_kib: float
    open_kib: int
    closed_kib: int


def resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _turns(thread: Thread, first: int, count: int) -> None:
    for number in range(first, first + count):
        done = await thread.run_turn(prompt(number)).wait()
        if done.error.message:
            raise RuntimeError(f"a turn failed: {done.error.message}")


async def _measure(address: str, pid: int, threads: int, turns: int) -> ThreadMemory:
    async with AgentClient(address) as client:
        opened = [await client.start_thread() for _ in range(threads)]
        # A few turns first, so that what every thread and the server make once is made.
        await asyncio.gather(*(_turns(thread, 0, 2) for thread in opened))
        start = resident_kib(pid)
        await asyncio.gather(*(_turns(thread, 2, turns) for thread in opened))
        half = resident_kib(pid)
        await asyncio.gather(*(_turns(thread, 2 + turns, turns) for thread in opened))
        end = resident_kib(pid)
        for thread in opened:
            await thread.close()
        closed = resident_kib(pid)
    count = threads * turns
    return ThreadMemory(threads, turns, (half - start) / count, (end - half) / count, end, closed)


def measure(root: Path, threads: int, turns: int) -> ThreadMemory:
    with spawn(agent_server_argv(trace_root=root, word_delay=0.0)) as server:
        return asyncio.run(_measure(server.address, server.popen.pid, threads, turns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--turns", type=int, default=100, help="turns a half (default 100)")
    parser.add_argument("--tree", action="append", type=Path, default=[])
    args = parser.parse_args()
    for tree in args.tree or [None]:
        if tree is not None:
            os.environ["PYTHONPATH"] = str(tree.resolve())
        with tempfile.TemporaryDirectory() as root:
            result = measure(Path(root), args.threads, args.turns)
        print(
            f"{tree or 'this tree'}: {result.threads} threads x 2 x {result.turns} turns: "
            f"{result.first_kib:.1f} / {result.second_kib:.1f} KiB of RSS a thread-turn; "
            f"{result.open_kib / 1024:.1f} MiB open, "
            f"{result.closed_kib / 1024:.1f} MiB after close",
            flush=True,
        )


if __name__ == "__main__":
    main()
