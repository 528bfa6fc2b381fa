"""bench.gateway_memory: the gateway, in its own process, answers the bodies and its memory is
read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import gateway_memory
from bench._harness import spawn
from trace_reducer import replay_bundle


def test_the_bodies_are_answered_and_memory_is_read(tmp_path: Path) -> None:
    body = gateway_memory.many_messages_body(1_000, 40_000)
    assert len(json.loads(body)["messages"]) == 1_000
    assert 39_000 < len(body) < 41_000
    argv = [sys.executable, "-m", "bench.gateway_memory", "--serve-upstream"]
    with spawn(argv) as upstream:
        result = gateway_memory.measure(tmp_path, upstream.address, body, 2, [])
    assert result.statuses == [200, 200]
    assert 0 < result.before_kib <= result.peak_kib
    assert result.after_kib > 0
    # The warm-up call and the two measured ones, each a session of its own, recorded.
    bundles = sorted(path for path in tmp_path.iterdir() if path.is_dir())
    assert len(bundles) == 3
    assert all(replay_bundle(bundle).recording_complete for bundle in bundles)
