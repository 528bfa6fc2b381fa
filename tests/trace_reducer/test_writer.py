"""BundleWriter: layout, permissions, payload dedup and chunking, failure behaviour."""

from __future__ import annotations

import os
import random
import re
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from trace_reducer import (
    MAX_RECORD_BYTES,
    TRACE_FILE_NAME,
    BundleWriter,
    RecordBuilder,
    RecordingError,
    decode_varint,
    integrity_name,
    payload_id,
    read_bundle,
)
from trace_reducer.bundle import _writer


def _records(bundle: Path) -> list[record_pb2.TraceRecord]:
    with read_bundle(bundle) as reader:
        records = list(reader)
        assert reader.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN, reader.integrity
    return records


def test_layout_permissions_header_and_footer(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path / "traces", "thread-1", producer_name="unit")
    writer.close()
    assert re.fullmatch(r"\d{8}T\d{6}Z-thread-1", writer.bundle_dir.name)
    assert stat.S_IMODE(os.stat(writer.bundle_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(writer.bundle_dir / TRACE_FILE_NAME).st_mode) == 0o600
    header, footer = _records(writer.bundle_dir)
    assert header.header.thread_id == "thread-1"
    assert header.header.trace_id == writer.trace_id
    assert header.header.producer_name == "unit"
    assert header.header.format_version == 1
    assert footer.footer.record_count == 2


def test_payloads_are_written_once(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    first = writer.put_payload(b'{"a":1}', record_pb2.PAYLOAD_KIND_INPUT_ITEM)
    again = writer.put_payload(b'{"a":1}', record_pb2.PAYLOAD_KIND_INPUT_ITEM)
    other = writer.put_payload(b'{"a":2}', record_pb2.PAYLOAD_KIND_INPUT_ITEM)
    writer.close()
    assert first == again == payload_id(b'{"a":1}')
    assert other != first
    payloads = [r.payload for r in _records(writer.bundle_dir) if r.HasField("payload")]
    assert [p.payload_id for p in payloads] == [first, other]


def test_large_payloads_are_chunked_under_the_record_limit(tmp_path: Path) -> None:
    data = os.urandom(MAX_RECORD_BYTES * 2 + 123)
    writer = BundleWriter.create(tmp_path, "t")
    pid = writer.put_payload(data, record_pb2.PAYLOAD_KIND_OUTPUT_ITEM, "application/octet-stream")
    writer.close()
    chunks = [r.payload for r in _records(writer.bundle_dir) if r.HasField("payload")]
    assert len(chunks) == 3
    assert all(c.ByteSize() < MAX_RECORD_BYTES for c in chunks)
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert {c.chunk_count for c in chunks} == {3}
    assert {c.payload_id for c in chunks} == {pid}
    assert b"".join(c.data for c in chunks) == data


def test_seq_and_time_are_filled_in(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    seqs = [
        writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
        for _ in range(3)
    ]
    writer.close()
    records = _records(writer.bundle_dir)
    assert seqs == [2, 3, 4]
    assert [r.seq for r in records] == [1, 2, 3, 4, 5]
    times = [r.time_us for r in records]
    assert times == sorted(times)


def test_trace_root_that_is_a_file_fails_with_the_cause(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    root.write_text("file")
    with pytest.raises(RecordingError, match="not a directory"):
        BundleWriter.create(root, "t")


def test_missing_trace_root_is_created(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path / "a" / "b", "t")
    writer.close()
    assert writer.bundle_dir.parent == tmp_path / "a" / "b"


@pytest.mark.parametrize("thread_id", ["", "..", "a/b", "x\0y"])
def test_thread_ids_that_are_no_directory_name_are_refused(tmp_path: Path, thread_id: str) -> None:
    with pytest.raises(RecordingError, match="invalid thread id"):
        BundleWriter.create(tmp_path, thread_id)
    assert list(tmp_path.iterdir()) == []


def test_root_below_a_file_fails_with_the_cause(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecordingError, match="Not a directory"):
        BundleWriter.create(tmp_path / "file" / "traces", "t")


def test_a_failed_write_fails_the_writer_and_keeps_earlier_records(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
    # Closing the descriptor behind the writer's back makes the next write() fail with EBADF.
    os.close(writer._fd)
    with pytest.raises(RecordingError):
        writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
    assert writer.failed
    with pytest.raises(RecordingError, match="failed"):
        writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
    writer.closed = True  # the descriptor is gone already
    with read_bundle(writer.bundle_dir) as reader:
        assert [r.seq for r in reader] == [1, 2]
        assert integrity_name(reader.integrity.status) == "UNCLOSED"


def test_close_is_idempotent_and_nothing_is_appended_after_it(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    writer.close()
    writer.close()
    with pytest.raises(RecordingError, match="closed"):
        writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
    assert len(_records(writer.bundle_dir)) == 2


def test_a_removed_file_fails_the_writer_at_the_next_sync(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    writer.sync()
    writer.file_path.unlink()
    with pytest.raises(RecordingError, match="removed"):
        writer.sync()
    assert writer.failed
    writer.close()
    assert writer.closed


_KILL_AT_HEADER = """
import os, signal, sys
from trace_reducer import BundleWriter
from trace_reducer.bundle import _writer

real_write = os.write

def write_or_die(fd, data):
    # The header is the first record: die as a kill -9 would, before it is written.
    os.kill(os.getpid(), signal.SIGKILL)

_writer.os.write = write_or_die
BundleWriter.create(sys.argv[1], "thread-killed")
"""


def test_a_writer_killed_before_its_header_leaves_no_bundle(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    root.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _KILL_AT_HEADER, str(root)], capture_output=True, check=False
    )
    assert done.returncode == -signal.SIGKILL
    # What is left is hidden and named for what it is; nothing looks like a bundle.
    left = list(root.iterdir())
    assert [entry.name for entry in left if not entry.name.startswith(".")] == []
    assert all("thread-killed" in entry.name for entry in left)


def test_a_failed_create_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    root.mkdir()
    # The header cannot be written: files may not grow past 8 bytes (EFBIG).
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8, limits[1]))
    try:
        with pytest.raises(RecordingError):
            BundleWriter.create(root, "thread-1")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert list(root.iterdir()) == []


def test_a_bundle_appears_with_its_header(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "thread-1")
    [entry] = tmp_path.iterdir()
    assert entry == writer.bundle_dir
    with read_bundle(entry) as reader:
        [header] = list(reader)
    assert header.HasField("header")
    writer.close()


def test_discard_removes_the_bundle(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "thread-1")
    writer.append(record_pb2.TraceRecord(provider_event=record_pb2.ProviderEvent(call=1)))
    writer.discard()
    assert list(tmp_path.iterdir()) == []
    assert writer.closed


def _frames_after_header(path: Path) -> list[bytes]:
    data = path.read_bytes()
    frames, pos = [], 0
    while pos < len(data):
        decoded = decode_varint(data, pos)
        assert decoded is not None
        size, start = decoded
        frames.append(data[pos : start + size])
        pos = start + size
    return frames[1:]


class _MessageSink:
    """The writer seen only through RecordSink: every record built as a message."""

    def __init__(self, writer: BundleWriter) -> None:
        self.append = writer.append
        self.put_payload = writer.put_payload


# The three ways a text delta reaches the file: framed and written in C (where the extension
# is built), framed by hand in Python, and built as a message like every other record.
_DELTA_WAYS = ("compiled", "python", "message")


def test_text_deltas_framed_by_hand_write_the_same_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same clock for every writer: each reads it once a record.
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "monotonic_ns", lambda: next(ticks) * 997_001)
    rng = random.Random(3)
    kinds = list(record_pb2.DeltaKind.values())
    steps = []
    for _ in range(300):
        call, item = rng.choice([1, 2, 300]), rng.choice([0, 1, 2, 2**32 - 1])
        text = "".join(rng.choice("aé€\U0001f600 ") for _ in range(rng.randrange(0, 50)))
        tokens = common_pb2.DeltaTokens(ids=[7, 8]) if rng.random() < 0.1 else None
        steps.append((rng.random() < 0.05, call, item, text, rng.choice(kinds), tokens))
    compiled = _writer._write_text_delta
    assert compiled is not None, "the C extension was not built"
    bundles = []
    for way in _DELTA_WAYS:
        monkeypatch.setattr(_writer, "_write_text_delta", compiled if way == "compiled" else None)
        writer = BundleWriter.create(tmp_path / way, "t")
        builder = RecordBuilder(_MessageSink(writer) if way == "message" else writer)
        for new_item, call, item, text, kind, tokens in steps:
            if new_item:
                builder.output_item_added(
                    call, provider_item_id="i", item_type="message", role="", output_index=0
                )
            builder.output_text_delta(call, item, text, kind=kind, tokens=tokens)
        writer.append_text_delta(5, 0, "\U0001f600" * 100, 1)
        # A kind this code does not know yet is framed as a message; a call out of range is
        # refused as the message refuses it, with nothing written.
        writer.append_text_delta(1, 1, "unknown kind", 7)
        with pytest.raises(ValueError, match="out of range"):
            writer.append_text_delta(2**32, 1, "x", 0)
        # Past what the C frame takes without a size check: framed in Python.
        writer.append_text_delta(2, 0, "y" * (MAX_RECORD_BYTES // 4), 0)
        bundles.append(writer)
    counts = {writer.record_count for writer in bundles}
    assert counts == {len(steps) + 4 + sum(s[0] for s in steps)}
    assert len({writer.bytes_written for writer in bundles}) == 1
    compiled_frames, *others = (_frames_after_header(w.file_path) for w in bundles)
    assert all(frames == compiled_frames for frames in others)
    for writer in bundles:
        writer.close()
        assert len(_records(writer.bundle_dir)) == writer.record_count


@pytest.fixture(params=_DELTA_WAYS[:2])
def delta_writer(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> BundleWriter:
    """A new bundle's writer whose text deltas are written in C, or framed in Python."""
    if request.param == "python":
        monkeypatch.setattr(_writer, "_write_text_delta", None)
    return BundleWriter.create(tmp_path, "t")


def test_a_short_text_delta_write_fails_the_recording(delta_writer: BundleWriter) -> None:
    writer = delta_writer
    writer.append_text_delta(1, 0, "whole", 0)
    size = writer.bytes_written
    # The file may grow by 4 bytes more (Python ignores SIGXFSZ, so write() stops short).
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 4, limits[1]))
    try:
        with pytest.raises(RecordingError, match=r"short write \(4 of \d+ bytes\)"):
            writer.append_text_delta(1, 0, "torn " * 10, 0)
        with pytest.raises(RecordingError, match="failed"):
            writer.append_text_delta(1, 0, "after", 0)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert writer.failed
    assert writer.record_count == 2
    assert writer.bytes_written == size
    with read_bundle(writer.bundle_dir) as reader:
        assert [r.output_text_delta.delta for r in reader][1:] == ["whole"]
        assert reader.integrity.status == state_pb2.INTEGRITY_STATUS_TRUNCATED


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_text_delta_write_says_why(delta_writer: BundleWriter) -> None:
    writer = delta_writer
    # The descriptor now answers ENOSPC, as a full disk does.
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, writer._fd)
    os.close(full)
    with pytest.raises(RecordingError, match="No space left on device"):
        writer.append_text_delta(1, 0, "lost", 0)
    assert writer.failed
    assert writer.record_count == 1
    writer.abandon()


def test_a_text_delta_after_close_or_failure_is_refused(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    writer.close()
    with pytest.raises(RecordingError, match="closed"):
        writer.append_text_delta(1, 0, "x", 0)
