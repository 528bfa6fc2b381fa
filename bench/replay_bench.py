"""P11: a recorded run replayed at `--replay-pace fast`, beside the live run it stands in for.

A 1,000-turn thread runs live (the stamped model in its own process, streaming every delta as
its own write), then through `agent-server serve --replay-from` that bundle, in alternating
rounds. Figures: replayed turns per second, and server CPU per delta the model streamed (each
turn's reply is `reply_length` deltas) — the replaying server's (the agent and its replay
provider, one process) beside the live agent's alone and the live agent's plus its model's (the
stream the replay stands in for).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench._harness import agent_server_argv, cpu_seconds, prompt, run_thread, spawn, stubs


@dataclass(frozen=True)
class Replay:
    turns: int
    deltas: int
    replay_turns_per_s: list[float]
    live_turns_per_s: list[float]
    replay_us: list[float]
    live_agent_us: list[float]
    live_total_us: list[float]


async def _run(address: str, turns: int) -> tuple[int, float]:
    """One thread of `turns` turns; (delta events received, wall seconds)."""
    async with stubs(address, 1) as [stub]:
        began = time.perf_counter()
        run = await run_thread(stub, [prompt(i) for i in range(turns)], keep_text=False)
        elapsed = time.perf_counter() - began
    if run.failures:
        raise RuntimeError(f"the run went wrong: {run.failures[:3]}")
    return run.delta_events, elapsed


def measure_replay(
    root: Path, turns: int = 1000, reply_length: int = 20, rounds: int = 3
) -> Replay:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0"]
    model_argv += ["--reply-length", str(reply_length)]
    live_root = root / "p11-live"
    replay_tps: list[float] = []
    live_tps: list[float] = []
    replay_us: list[float] = []
    live_agent_us: list[float] = []
    live_total_us: list[float] = []
    # What the model streams; clients may get fewer, larger events (deltas read together).
    deltas = turns * reply_length
    with (
        spawn(model_argv) as model,
        spawn(agent_server_argv(trace_root=live_root, provider_url=model.address)) as live,
    ):

        def live_round() -> None:
            agent_before = cpu_seconds(live.popen.pid)
            model_before = cpu_seconds(model.popen.pid)
            _, elapsed = asyncio.run(_run(live.address, turns))
            agent = cpu_seconds(live.popen.pid) - agent_before
            both = agent + cpu_seconds(model.popen.pid) - model_before
            live_tps.append(turns / elapsed)
            live_agent_us.append(agent / deltas * 1e6)
            live_total_us.append(both / deltas * 1e6)

        live_round()  # the recording every replay round plays back
        [bundle] = sorted(live_root.iterdir())
        for round_ in range(rounds):
            replay_argv = agent_server_argv(trace_root=root / f"p11-replayed-{round_}")
            replay_argv += ["--replay-from", str(bundle), "--replay-pace", "fast"]
            with spawn(replay_argv) as replaying:
                # From here on: the run, not the bundle's reading at start-up.
                before = cpu_seconds(replaying.popen.pid)
                replayed, elapsed = asyncio.run(_run(replaying.address, turns))
                spent = cpu_seconds(replaying.popen.pid) - before
            if not replayed:
                raise RuntimeError("the replay streamed no delta")
            replay_tps.append(turns / elapsed)
            replay_us.append(spent / deltas * 1e6)
            if round_ < rounds - 1:
                live_round()
    return Replay(turns, deltas, replay_tps, live_tps, replay_us, live_agent_us, live_total_us)
