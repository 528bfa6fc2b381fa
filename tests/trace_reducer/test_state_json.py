"""state.json: canonical proto3 JSON, deterministic, written atomically."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest
from google.protobuf import json_format

from bench.synthetic import Shape, write_conversation
from rollout.trace.v1 import state_pb2
from trace_reducer import (
    FrameDecoder,
    Reducer,
    ReductionError,
    iter_state_json,
    replay_bundle,
    state_to_json,
    write_state_json,
)

from .bundles import one_turn_bundle
from .test_fuzz import hostile_bundle


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


def reference_json(trace: state_pb2.RolloutTrace) -> str:
    """What state.json must hold: json_format's own rendering with the state's options."""
    text = json_format.MessageToJson(
        trace,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        sort_keys=True,
        indent=2,
        ensure_ascii=False,
    )
    return text + "\n"


# Tens of thousands of hostile bundles are made to find 60 that reduce (~8 s of CPU): a hang
# guard for a busy machine (it took over 60 s at load 20), not a speed check.
@pytest.mark.timeout(300)
def test_state_json_is_what_json_format_writes(tmp_path: Path) -> None:
    bundle = write_conversation(tmp_path / "c", Shape(turns=6, deltas_per_turn=3))
    states = [
        state_pb2.RolloutTrace(),
        replay_bundle(one_turn_bundle(tmp_path / "one")),
        replay_bundle(one_turn_bundle(tmp_path / "unclosed", close=False)),
        replay_bundle(bundle),
        replay_bundle(bundle, compact=True),
    ]
    # Every kind of top-level field, repeated messages included.
    with_rewards = replay_bundle(bundle)
    with_rewards.rewards.add(name="score", value=0.5, seq=2)
    states.append(with_rewards)
    rng = random.Random(5)
    while len(states) < 60:
        decoder = FrameDecoder()
        reducer = Reducer()
        try:
            reducer.apply_many(decoder.feed(hostile_bundle(rng)))
            reducer.set_integrity(decoder.finish())
            states.append(reducer.state())
        except ReductionError:
            continue
    for trace in states:
        assert state_to_json(trace) == reference_json(trace)


def test_a_compact_state_is_written_whole_a_call_at_a_time(tmp_path: Path) -> None:
    bundle = write_conversation(tmp_path, Shape(turns=30, deltas_per_turn=3))
    compact = replay_bundle(bundle, compact=True)
    complete = replay_bundle(bundle)
    assert compact != complete
    expected = reference_json(complete)
    assert "".join(iter_state_json(compact, expand=True)) == expected
    written = write_state_json(compact, tmp_path / "state.json", expand=True)
    assert written.read_text(encoding="utf-8") == expected
    # A compact state written as it is parses back to itself.
    write_state_json(compact, tmp_path / "compact.json")
    parsed = json_format.Parse((tmp_path / "compact.json").read_text(), state_pb2.RolloutTrace())
    assert parsed == compact
