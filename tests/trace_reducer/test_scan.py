"""The C extension's own parts: the frame scanner (what it reads is compared with Python's
reads in test_bulk) and the writer's text-delta frame (its frames in test_framing, its bundles
in test_writer)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import pytest

from rollout.trace.v1 import record_pb2
from trace_reducer import FrameDecoder, encode_record
from trace_reducer.bundle import _scan as scan
from trace_reducer.bundle._framing import encode_text_delta


def test_both_crc_paths_are_crc32c() -> None:
    rng = random.Random(5)
    for size in [*range(0, 40), 63, 64, 65, 1000, 4097]:
        data = rng.randbytes(size)
        assert scan.crc32c(data) == google_crc32c.value(data)
        assert scan.crc32c(data, True) == google_crc32c.value(data)


def test_count_deltas_counts_delta_bodies() -> None:
    frames = []
    kinds = []
    for seq in range(1, 300):
        record = record_pb2.TraceRecord(seq=seq, time_us=seq * 7 if seq % 3 else 0)
        if seq % 4:
            record.output_text_delta.call = 1
            record.output_text_delta.delta = "x" * (seq % 200)
        else:
            record.payload.payload_id = f"p{seq}"
        frames.append(encode_record(record))
        kinds.append(record.WhichOneof("body"))
    data = b"".join(frames)
    assert scan.count_deltas(data) == kinds.count("output_text_delta")
    # A frame cut short ends the count before it.
    assert scan.count_deltas(data[:-1]) == kinds[:-1].count("output_text_delta")


def test_scan_stops_where_python_must_read() -> None:
    header = record_pb2.TraceRecord(seq=1)
    header.header.trace_id = "t"
    delta = record_pb2.TraceRecord(seq=2, time_us=5)
    delta.output_text_delta.call = 3
    delta.output_text_delta.delta = "hi"
    data = encode_record(header) + encode_record(delta)
    # The header is Python's to read.
    pieces, pos, next_seq, stopped = scan.scan(data, 0, 1)
    assert (pieces, pos, next_seq, stopped) == ([], 0, 1, True)
    start = len(encode_record(header))
    pieces, pos, next_seq, stopped = scan.scan(data, start, 2)
    assert pieces == [(3, 2, 1, 5, b"\n" + data[start:])]
    assert (pos, next_seq, stopped) == (len(data), 3, False)
    # A frame still coming: the scan ends before it, quietly.
    assert scan.scan(data[:-2], start, 2) == ([], start, 2, False)
    # A seq out of order: stopped at its frame.
    assert scan.scan(data, start, 9) == ([], start, 9, True)


def _bundle() -> bytes:
    """A small bundle of every kind of frame the scan sorts: the header, payloads, a run of
    deltas, a delta naming its item, the footer."""
    records = [record_pb2.TraceRecord(seq=1)]
    records[0].header.trace_id = "t"
    for seq in range(2, 4):
        record = record_pb2.TraceRecord(seq=seq, time_us=seq)
        record.payload.payload_id = f"p{seq}"
        record.payload.data = b'{"role":"user"}'
        records.append(record)
    for seq in range(4, 14):
        record = record_pb2.TraceRecord(seq=seq, time_us=100 * seq)
        record.output_text_delta.call = 1
        record.output_text_delta.delta = "w\u00e9 "
        if seq == 9:
            record.output_text_delta.item = 2
        records.append(record)
    footer = record_pb2.TraceRecord(seq=14, time_us=2000)
    footer.footer.record_count = 14
    records.append(footer)
    return b"".join(map(encode_record, records))


def _read(decoder: FrameDecoder, data: bytes, piece: int) -> tuple[list[bytes], bytes]:
    records = []
    for start in range(0, len(data), piece):
        records += [r.SerializeToString() for r in decoder.feed(data[start : start + piece])]
    return records, decoder.finish().SerializeToString()


def test_every_bit_flip_reads_as_python_reads_it() -> None:
    # The scan against the Python bulk path and a frame-by-frame read: the same records, the
    # same integrity (status, offsets, detail), whole and in pieces.
    data = _bundle()
    for index in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[index] ^= 1 << bit
            for piece in (len(data), 5):
                exact = _read(FrameDecoder(bulk=False), bytes(damaged), piece)
                assert _read(FrameDecoder(), bytes(damaged), piece) == exact, (index, bit)
                assert _read(FrameDecoder(native=False), bytes(damaged), piece) == exact


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _frame(fields: bytes) -> bytes:
    """A frame of these record fields whose CRC holds, whatever the fields say."""
    crc: int = google_crc32c.value(fields)
    body = fields + b"\x7d" + crc.to_bytes(4, "little")
    return _varint(len(body)) + body


def test_a_record_a_parse_may_read_otherwise_is_left_to_python() -> None:
    # Records whose CRC holds and whose first field is the seq expected, but whose other fields
    # could make a parse find another seq or a header or a footer, or not parse at all: the
    # scan leaves each to Python, so a stretch never hands one to the reducer unasked.
    header = record_pb2.TraceRecord(seq=1)
    header.header.trace_id = "t"
    payload = record_pb2.TraceRecord(seq=2, time_us=3)
    payload.payload.payload_id = "p"
    after = record_pb2.TraceRecord(seq=4, time_us=9)
    after.payload.payload_id = "q"
    seq3 = b"\x08\x03\x10\x05"
    odd = {
        "a second seq": seq3 + b"\x2a\x03\x0a\x01p" + b"\x08\x07",
        "a header": seq3 + b"\x1a\x02\x0a\x00",
        "a footer": seq3 + b"\x22\x02\x08\x05",
        "a group": seq3 + b"\xc3\x02\xc4\x02",
        "a field cut short": seq3 + b"\x2a\x10\x0a\x01",
        "field number 0": seq3 + b"\x00\x01",
        "a varint past 10 bytes": seq3 + b"\x30" + b"\xff" * 10 + b"\x01",
    }
    start = len(encode_record(header)) + len(encode_record(payload))
    for what, fields in odd.items():
        data = encode_record(header) + encode_record(payload) + _frame(fields)
        data += encode_record(after)
        pieces, pos, _, stopped = scan.scan(data, len(encode_record(header)), 2)
        assert [piece[2] for piece in pieces] == [1], what
        assert (pos, stopped) == (start, True), what
        for piece in (len(data), 7):
            exact = _read(FrameDecoder(bulk=False), data, piece)
            assert _read(FrameDecoder(), data, piece) == exact, what
            assert _read(FrameDecoder(native=False), data, piece) == exact, what
    # A record of every ordinary kind of field still joins the stretch.
    plain = seq3 + b"\x2a\x03\x0a\x01p" + b"\x9d\x01\x00\x00\x00\x00" + b"\x99\x01" + bytes(8)
    data = encode_record(header) + encode_record(payload) + _frame(plain) + encode_record(after)
    pieces, pos, _, stopped = scan.scan(data, len(encode_record(header)), 2)
    assert [piece[2] for piece in pieces] == [3]
    assert (pos, stopped) == (len(data), False)


def test_write_text_delta_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "frames", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(UnicodeEncodeError):
            scan.write_text_delta(fd, 1, 1, 1, 0, "lone \ud800", 0)
        with pytest.raises(OverflowError):
            scan.write_text_delta(fd, -1, 1, 1, 0, "x", 0)
        with pytest.raises(TypeError):
            scan.write_text_delta(fd, 1, 1, 1, 0, b"bytes", 0)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            scan.write_text_delta(fd, 1, 1, 1, 0, "x")  # type: ignore[call-arg]
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(OSError, match="Bad file descriptor") as failed:
            scan.write_text_delta(read_end, 1, 1, 1, 0, "not writable", 0)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert failed.value.errno == errno.EBADF


def test_write_text_delta_keeps_no_second_copy_of_the_text(tmp_path: Path) -> None:
    # str caches its UTF-8 once asked for it; a streamed delta must not carry that copy after.
    text = "".join(["é€\U0001f600 "] * 50)
    size = sys.getsizeof(text)
    fd = os.open(tmp_path / "frames", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        written, frame_size = scan.write_text_delta(fd, 1, 1, 1, 0, text, 0)
    finally:
        os.close(fd)
    assert written == frame_size > len(text.encode())
    assert sys.getsizeof(text) == size


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: a write to it blocks until something is read."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"\0" * 65_536)
    os.set_blocking(write_end, True)
    return read_end, write_end


class _StoppedError(Exception):
    pass


@contextlib.contextmanager
def _alarm(handler: Callable[[int, object], None]) -> Iterator[None]:
    """SIGALRM to handler 50 ms from now (the write in the block has long been waiting by then);
    pytest-timeout's own alarm, if it set one, is put back after."""
    previous = signal.signal(signal.SIGALRM, handler)
    started = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:
            left = pending - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))


def test_write_text_delta_goes_on_after_a_signal_as_os_write_does() -> None:
    read_end, write_end = _full_pipe()
    drained: list[int] = []

    def drain(signum: int, frame: object) -> None:
        # Room for the frame: the interrupted write is made again and goes through.
        drained.append(len(os.read(read_end, 1 << 20)))

    try:
        with _alarm(drain):
            written, size = scan.write_text_delta(write_end, 1, 1, 1, 0, "after the signal", 0)
    finally:
        os.close(write_end)
    try:
        assert drained
        assert written == size
        assert os.read(read_end, size) == encode_text_delta(1, 1, 1, 0, b"after the signal", 0)
    finally:
        os.close(read_end)


def test_write_text_delta_raises_what_a_signal_handler_raises() -> None:
    read_end, write_end = _full_pipe()

    def stop(signum: int, frame: object) -> None:
        raise _StoppedError

    try:
        with _alarm(stop), pytest.raises(_StoppedError):
            scan.write_text_delta(write_end, 1, 1, 1, 0, "never written", 0)
    finally:
        os.close(write_end)
        os.close(read_end)
