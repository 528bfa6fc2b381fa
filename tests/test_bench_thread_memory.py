"""bench.thread_memory: every thread runs all its turns, open, and the server's memory is read."""

from __future__ import annotations

from pathlib import Path

from bench import thread_memory
from trace_reducer import replay_bundle


def test_each_thread_runs_every_turn_and_memory_is_read(tmp_path: Path) -> None:
    result = thread_memory.measure(tmp_path, threads=2, turns=3)
    assert (result.threads, result.turns) == (2, 3)
    assert result.open_kib > 0
    assert result.closed_kib > 0
    bundles = sorted(path for path in tmp_path.iterdir() if path.is_dir())
    assert len(bundles) == 2
    for bundle in bundles:
        state = replay_bundle(bundle)
        # The warm-up's two turns and both halves', every one completed, the thread closed.
        assert len(state.turns) == 2 + 2 * 3
        assert state.recording_complete
