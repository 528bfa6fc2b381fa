"""P3's fixed part by phase: the agent's Recorder alone, on P3's turn shape, beside its floors.

`python -m bench.recording_bench [DIR]` records `--threads` threads of `--turns` turns into a
fresh trace root under DIR (default: the system's temporary directory), one thread at a time so
that the process's CPU time between two calls belongs to the phase between them: the bundle's
creation with thread_started, each record of a turn (its payloads included), the turn's
`--deltas` text deltas (one record and one `write()` each, as the server writes them), the
fsync at turn end (on recording's own disk threads, as the server does it) and the close. A
turn is P3's: a user question, the whole history as the request's input, one assistant message
of `--deltas` words, the raw `response.completed` event.

Beside the phases, in the same rounds: the bare operations the fixed part cannot do without,
`os.fsync` of a file after the same appends, made in the calling thread, and the round trip to
recording's disk threads with a function that does nothing (as the recorder makes it; and, in
alternate samples, the same trip through the loop's default executor, `asyncio.to_thread`, which
the recorder took until 2026-12-06). Each
figure is CPU time (`time.process_time`, every thread of the process), the median over a round;
the table gives min / median / max over `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from agent_server.recorder import Recorder, _disk
from rollout.trace.v1 import common_pb2

_DONE = common_pb2.EXECUTION_STATUS_COMPLETED
# Phases a thread has once (its share of each turn is the figure over --turns).
PER_THREAD = ("start", "finish")
FSYNC_FLOOR = "floor: os.fsync in the calling thread"
HOP_FLOOR = "floor: a disk thread's round trip"
DEFAULT_EXECUTOR_HOP = "floor: the default executor's round trip (asyncio.to_thread)"


class _Phases:
    """CPU time between consecutive laps, kept by the name of the phase that ended."""

    def __init__(self) -> None:
        self.figures: dict[str, list[float]] = defaultdict(list)
        self._last = time.process_time()

    def reset(self) -> None:
        self._last = time.process_time()

    def lap(self, name: str) -> None:
        now = time.process_time()
        self.figures[name].append(now - self._last)
        self._last = now


async def _record_thread(
    root: Path, thread_id: str, turns: int, deltas: int, clock: _Phases
) -> None:
    clock.reset()
    recorder = await Recorder.start(
        root, thread_id, model="bench-model", instructions="Answer briefly.", metadata={}
    )
    clock.lap("start")
    history: list[dict[str, object]] = []
    for number in range(turns):
        question = f"Question {number}: what did the model see when it answered the last one?"
        user: dict[str, object] = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": question}],
        }
        history.append(user)
        turn = recorder.turn_started(f"turn_{thread_id}_{number}", [user])
        clock.lap("turn_started")
        call = recorder.inference_started(
            turn,
            call_id=f"call_{thread_id}_{number}",
            attempt=1,
            model="bench-model",
            provider_base_url="http://127.0.0.1:8000/v1",
            envelope={"model": "bench-model", "stream": True, "instructions": "Answer briefly."},
            input_items=list(history),
        )
        clock.lap("inference_started")
        response_id = f"resp_{thread_id}_{number}"
        recorder.response_created(call, response_id)
        item = recorder.output_item_added(
            call,
            provider_item_id=f"msg_{number}",
            item_type="message",
            role="assistant",
            output_index=0,
        )
        clock.lap("response_created, output_item_added")
        words = [f"word{index} " for index in range(deltas)]
        for word in words:
            recorder.output_text_delta(call, item, word)
        clock.lap("deltas")
        message: dict[str, object] = {
            "type": "message",
            "role": "assistant",
            "id": f"msg_{number}",
            "status": "completed",
            "content": [{"type": "output_text", "text": "".join(words), "annotations": []}],
        }
        recorder.output_item_done(
            call, item, item_id=f"msg_{number}", assigned=False, payload=message
        )
        clock.lap("output_item_done")
        completed = {
            "type": "response.completed",
            "response": {
                "id": response_id,
                "output": [message],
                "usage": {"input_tokens": 20 * len(history), "output_tokens": deltas},
            },
        }
        recorder.provider_event(call, "response.completed", json.dumps(completed))
        recorder.inference_ended(call, _DONE, reason="", response_id=response_id)
        history.append(message)
        recorder.turn_ended(turn, _DONE)
        clock.lap("provider_event, inference_ended, turn_ended")
        await recorder.sync()
        clock.lap("sync")
    await recorder.finish(_DONE, "")
    clock.lap("finish")


def _nothing() -> None:
    return None


async def _floors(directory: Path, samples: int, appends: int, clock: _Phases) -> None:
    fd, name = tempfile.mkstemp(dir=directory, prefix="recording-floor-")
    try:
        for number in range(samples):
            for _ in range(appends):
                os.write(fd, b"x" * 30)
            clock.reset()
            os.fsync(fd)
            clock.lap(FSYNC_FLOOR)
            # Each trip starts as cold as the server's does: right after an fsync.
            if number % 2:
                await asyncio.to_thread(_nothing)
                clock.lap(DEFAULT_EXECUTOR_HOP)
            else:
                await _disk.run(_nothing)
                clock.lap(HOP_FLOOR)
    finally:
        os.close(fd)
        os.unlink(name)


async def _round(directory: Path, threads: int, turns: int, deltas: int) -> dict[str, float]:
    clock = _Phases()
    root = Path(tempfile.mkdtemp(dir=directory, prefix="recording-bench-"))
    try:
        for number in range(threads):
            await _record_thread(root / "traces", f"thread{number}", turns, deltas, clock)
        await _floors(root, threads * turns, deltas + 10, clock)
    finally:
        shutil.rmtree(root)
    return {name: statistics.median(values) * 1e6 for name, values in clock.figures.items()}


@dataclass(frozen=True)
class Phases:
    """Each phase's CPU µs, one figure (the round's median) per round."""

    rounds: list[dict[str, float]]
    turns: int
    deltas: int

    def spread(self, name: str) -> tuple[float, float, float]:
        figures = [figures[name] for figures in self.rounds]
        return min(figures), statistics.median(figures), max(figures)

    def per_turn(self, name: str) -> float:
        """The phase's median a turn: a thread's start and finish shared by its turns."""
        middle = self.spread(name)[1]
        return middle / self.turns if name in PER_THREAD else middle

    @property
    def fixed_per_turn(self) -> float:
        """Recording's CPU a turn beside its deltas: the phases' medians summed."""
        return sum(
            self.per_turn(name)
            for name in self.rounds[0]
            if name != "deltas" and not name.startswith("floor")
        )

    @property
    def records_per_turn(self) -> float:
        """The fixed part's records and payloads: all of it but the bundle's start and finish
        and the sync at turn end."""
        return self.fixed_per_turn - sum(self.per_turn(name) for name in (*PER_THREAD, "sync"))

    @property
    def per_delta(self) -> float:
        return self.spread("deltas")[1] / self.deltas


def measure_phases(
    directory: Path, *, threads: int = 60, turns: int = 3, deltas: int = 300, rounds: int = 5
) -> Phases:
    figures = [asyncio.run(_round(directory, threads, turns, deltas)) for _ in range(rounds)]
    return Phases(figures, turns, deltas)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--threads", type=int, default=60, help="threads a round (default 60)")
    parser.add_argument("--turns", type=int, default=3, help="turns a thread (default 3)")
    parser.add_argument("--deltas", type=int, default=300, help="deltas a turn (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args(argv)
    phases = measure_phases(
        args.directory,
        threads=args.threads,
        turns=args.turns,
        deltas=args.deltas,
        rounds=args.rounds,
    )
    print(f"phase\tCPU µs, min / median / max over {args.rounds} rounds (medians of each)")
    for name in phases.rounds[0]:
        low, middle, high = phases.spread(name)
        share = ""
        if name in PER_THREAD:
            share = f"\t({phases.per_turn(name):,.0f} a turn)"
        elif name == "deltas":
            share = f"\t({phases.per_delta:.2f} a delta)"
        print(f"{name}\t{low:,.1f} / {middle:,.1f} / {high:,.1f}{share}")
    print(f"fixed part a turn (the medians summed): {phases.fixed_per_turn:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
