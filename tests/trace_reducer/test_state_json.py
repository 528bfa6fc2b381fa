"""state.json: canonical proto3 JSON, deterministic, written atomically."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from google.protobuf import json_format

from rollout.trace.v1 import state_pb2
from trace_reducer import replay_bundle, state_to_json, write_state_json

from .bundles import one_turn_bundle


def test_json_is_snake_case_sorted_and_shows_defaults(tmp_path: Path) -> None:
    trace = replay_bundle(one_turn_bundle(tmp_path, close=False))
    text = state_to_json(trace)
    assert text.endswith("}\n")
    parsed = json.loads(text)
    assert list(parsed) == sorted(parsed)
    assert parsed["recording_complete"] is False
    assert parsed["integrity"]["status"] == "INTEGRITY_STATUS_UNCLOSED"
    call = next(iter(parsed["inference_calls"].values()))
    assert call["execution"]["status"] == "EXECUTION_STATUS_COMPLETED"
    assert call["discarded_outputs"] == []
    assert "request_item_ids" in call
    assert text.startswith('{\n  "conversation_items"')


def test_write_is_atomic_private_and_parses_back(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    trace = replay_bundle(bundle)
    target = bundle / "state.json"
    target.write_text("old contents")
    written = write_state_json(trace, target)
    assert written == target
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(p.name for p in bundle.iterdir()) == ["state.json", "trace.binpb"]
    parsed = json_format.Parse(target.read_text(), state_pb2.RolloutTrace())
    assert parsed == trace
    first = target.read_bytes()
    write_state_json(replay_bundle(bundle), target)
    assert target.read_bytes() == first


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    trace = replay_bundle(bundle)
    target = bundle / "state.json"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(OSError, match="Is a directory"):
        write_state_json(trace, target)
    assert sorted(p.name for p in bundle.iterdir()) == ["state.json", "trace.binpb"]
    assert target.is_dir()
