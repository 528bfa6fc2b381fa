"""S1: how long `agent-server` takes to answer its cheap commands, beside a bare interpreter."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench._harness import AGENT_SERVER, agent_server_argv, spawn

# The floor: the same interpreter starting and exiting, nothing imported.
FLOOR = "python -c pass"
# The probe's own floor: a gRPC call cannot be made without importing grpc (its C core and
# the asyncio it loads), whatever the client does around it.
GRPC_FLOOR = 'python -c "import grpc"'


@dataclass(frozen=True)
class Timing:
    """Wall seconds (lowest, median, highest) and the median CPU seconds of the process."""

    low: float
    median: float
    high: float
    cpu: float


def _run(argv: Sequence[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run of argv, start-up and exit included."""
    began = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    process.returncode = 0  # reaped above
    return wall, usage.ru_utime + usage.ru_stime


def measure(rounds: int = 9) -> dict[str, Timing]:
    """Each command once per round, the commands alternating within a round."""
    with spawn(agent_server_argv(trace_root=None)) as server:
        commands: dict[str, list[str]] = {
            FLOOR: [sys.executable, "-c", "pass"],
            GRPC_FLOOR: [sys.executable, "-c", "import grpc"],
            "agent-server --help": [AGENT_SERVER, "--help"],
            "agent-server --version": [AGENT_SERVER, "--version"],
            "agent-server health": [AGENT_SERVER, "health", "--address", server.address],
            "agent-server chat --help": [AGENT_SERVER, "chat", "--help"],
        }
        walls: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, argv in commands.items():
                wall, cpu = _run(argv)
                walls[name].append(wall)
                cpus[name].append(cpu)
    return {
        name: Timing(
            min(times), statistics.median(times), max(times), statistics.median(cpus[name])
        )
        for name, times in walls.items()
    }
