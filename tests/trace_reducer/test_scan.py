"""The C frame scanner's own parts; what it reads is compared with Python's reads in test_bulk."""

from __future__ import annotations

import random

import google_crc32c

from rollout.trace.v1 import record_pb2
from trace_reducer import encode_record
from trace_reducer.bundle import _scan as scan


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
