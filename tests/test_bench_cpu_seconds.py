"""bench._harness.cpu_seconds: another process's CPU time, to well under a clock tick."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench._harness import cpu_seconds

# Under one clock tick (10 ms): /proc/PID/stat's tick counts would often read it as nothing.
_SPIN_SECONDS = 0.003

_CHILD = f"""
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.thread_time()
while time.thread_time() - start < {_SPIN_SECONDS}:
    pass
print("spun", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("main_thread", [False, True])
def test_a_few_milliseconds_of_another_process_are_counted(main_thread: bool) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        before = cpu_seconds(child.pid, main_thread=main_thread)
        child.stdin.write("go\n")
        child.stdin.flush()
        # Waiting on its pipe, the child is off the CPU: its clock holds still to be read.
        assert child.stdout.readline() == "spun\n"
        spent = cpu_seconds(child.pid, main_thread=main_thread) - before
    finally:
        child.kill()
        child.wait()
    assert _SPIN_SECONDS <= spent < 1.0
