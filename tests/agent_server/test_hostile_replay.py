"""`--replay-from` over a hostile root: symlinked and FIFO trace files, torn bundles, payloads
nested past any parser's depth. Nothing outside the root is read, nothing waits, and a bundle
that cannot be replayed is one line naming it, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2
from tests.trace_reducer.bundles import BundleBuilder, one_turn_bundle
from trace_reducer import BundleError, bundle_paths, read_recorded

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")
INPUT_ITEM = record_pb2.PAYLOAD_KIND_INPUT_ITEM
ENVELOPE = record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE


def _root_with_planted_files(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    root.mkdir()
    good = one_turn_bundle(root)
    outside = one_turn_bundle(tmp_path / "outside", text="outside words")
    linked = root / "linked-trace"
    linked.mkdir()
    (linked / "trace.binpb").symlink_to(outside / "trace.binpb")
    (root / "linked-dir").symlink_to(outside)
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trace.binpb")
    return root, good


def test_replay_from_a_root_reads_only_regular_bundles_inside_it(tmp_path: Path) -> None:
    root, good = _root_with_planted_files(tmp_path)
    # Was: the bundle behind linked-trace/trace.binpb (outside the root) was replayed too.
    assert bundle_paths(root) == [good]
    threads = list(read_recorded(root))
    assert [t.bundle for t in threads] == [good]
    texts = [str(call.request) for t in threads for call in t.calls]
    assert not any("outside words" in text for text in texts)


def _deep_request_bundle(root: Path, depth: int) -> Path:
    """A call whose one input item is nested `depth` deep (the reducer keeps it opaque)."""
    builder = BundleBuilder(root)
    nested = b"[" * depth + b"]" * depth
    item = builder.writer.put_payload(
        b'{"content":' + nested + b',"role":"user","type":"message"}', INPUT_ITEM
    )
    envelope = builder.writer.put_payload(b'{"model":"m"}', ENVELOPE)
    builder.append(
        turn_started=record_pb2.TurnStarted(
            turn=1, thread=builder.thread, turn_id="turn-1", input_payload_ids=[item]
        )
    )
    builder.append(
        inference_started=record_pb2.InferenceStarted(
            call=1,
            turn=1,
            inference_call_id="call-1",
            attempt=1,
            model="m",
            request_envelope_payload_id=envelope,
            input_payload_ids=[item],
        )
    )
    return builder.close()


def test_a_request_nested_past_the_parser_is_one_line(tmp_path: Path) -> None:
    bundle = _deep_request_bundle(tmp_path / "root", 100_000)
    with pytest.raises(BundleError, match="call-1: a payload is nested too deep"):
        list(read_recorded(bundle))
    # Was: RecursionError out of json.loads, and a traceback from `serve --replay-from`.
    done = subprocess.run(
        [AGENT_SERVER, "serve", "--replay-from", str(bundle), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    assert "internal error" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--replay-from" in done.stderr
