"""Frames: varint prefix, trailing CRC field, size limit; the text-delta frame made by hand
(in Python and in C) against encode_record's."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2
from trace_reducer.bundle import _scan as scan
from trace_reducer.bundle._errors import RecordTooLargeError
from trace_reducer.bundle._framing import (
    CRC_TAG,
    MAX_RECORD_BYTES,
    decode_varint,
    encode_record,
    encode_text_delta,
    encode_varint,
    verify_crc,
)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63])
def test_varint_round_trip(value: int) -> None:
    encoded = encode_varint(value)
    assert decode_varint(encoded + b"\xff", 0) == (value, len(encoded))


def test_varint_is_protobufs_encoding_at_every_length_edge() -> None:
    # A message whose only field is a uint64: its bytes after the tag are the varint.
    assert encode_varint(0) == b"\x00"  # proto3 leaves a zero field out: compared alone
    values = {1, 0x7F, 0x80, 0x81, 0x3FFF, 0x4000, 0x1FFFFF, 0x200000, 2**32, 2**64 - 1}
    values |= {random.Random(3).randrange(2**64) for _ in range(500)}
    for value in sorted(values):
        assert encode_varint(value) == record_pb2.TraceRecord(seq=value).SerializeToString()[1:]
    with pytest.raises(ValueError, match="range"):
        encode_varint(-1)


def test_varint_incomplete_and_overlong() -> None:
    assert decode_varint(b"\x80\x80", 0) is None
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        decode_varint(b"\x80" * 11, 0)


def test_crc_is_the_last_field_and_standard_parsers_see_it() -> None:
    record = record_pb2.TraceRecord(
        seq=7, output_text_delta=record_pb2.OutputTextDelta(call=1, delta="hi")
    )
    frame = encode_record(record)
    size, start = decode_varint(frame, 0) or (0, 0)
    body = frame[start:]
    assert len(body) == size
    assert body[-5] == CRC_TAG
    assert verify_crc(body)
    parsed = record_pb2.TraceRecord.FromString(body)
    assert parsed.crc32c == int.from_bytes(body[-4:], "little")
    assert parsed.output_text_delta.delta == "hi"


def test_any_changed_byte_fails_the_crc() -> None:
    footer = record_pb2.TraceRecord(seq=1, footer=record_pb2.Footer(record_count=1))
    body = encode_record(footer)[1:]
    for index in range(len(body)):
        damaged = bytearray(body)
        damaged[index] ^= 0x01
        assert not verify_crc(bytes(damaged))


@pytest.mark.parametrize("text_bytes", [1, 40, 100])
def test_text_delta_overhead_is_at_most_24_bytes(text_bytes: int) -> None:
    # Worst realistic case: seq past a million, an hour into the recording, call 200; the item
    # is left out because deltas belong to the call's latest item unless the provider says else.
    text = "x" * text_bytes
    record = record_pb2.TraceRecord(
        seq=2_000_000,
        time_us=3_600_000_000,
        output_text_delta=record_pb2.OutputTextDelta(call=200, delta=text),
    )
    assert len(encode_record(record)) - len(text) <= 24


def test_oversized_record_is_refused() -> None:
    big = record_pb2.TraceRecord(seq=1, payload=record_pb2.Payload(data=b"\0" * MAX_RECORD_BYTES))
    with pytest.raises(RecordTooLargeError):
        encode_record(big)


def _random_text(rng: random.Random) -> str:
    """Empty, ASCII, multi-byte, astral, or long enough for a two-byte length prefix."""
    alphabet = 'ab z\n"\\é€\u0000\U0001f600\u200b'
    length = rng.choice([0, 1, 5, 40, 127, 128, 300, 20_000])
    return "".join(rng.choice(alphabet) for _ in range(length))


def test_text_delta_frame_is_encode_records_byte_for_byte(tmp_path: Path) -> None:
    # Framed in Python and in C (written to a file, as the writer writes it): the same bytes.
    rng = random.Random(25)
    fd = os.open(tmp_path / "frames", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    written = 0
    edges = [0, 1, 127, 128, 16_383, 16_384, 2**32 - 1]
    kinds = list(record_pb2.DeltaKind.values())
    try:
        for _ in range(2_000):
            seq = rng.choice([1, 127, 128, rng.randrange(1, 2**40)])
            time_us = rng.choice([0, 1, 127, 128, rng.randrange(0, 2**45)])
            call, item = (rng.choice([*edges, rng.randrange(0, 2**32)]) for _ in range(2))
            kind = rng.choice(kinds)
            delta = _random_text(rng)
            record = record_pb2.TraceRecord(seq=seq, time_us=time_us)
            body = record.output_text_delta
            body.call, body.item, body.delta, body.kind = call, item, delta, kind
            expected = encode_record(record)
            assert encode_text_delta(seq, time_us, call, item, delta.encode(), kind) == expected
            frame = scan.write_text_delta(fd, seq, time_us, call, item, delta, kind)
            assert frame == (len(expected), len(expected))
            assert os.pread(fd, len(expected) + 1, written) == expected
            written += len(expected)
    finally:
        os.close(fd)


def test_text_delta_frame_refuses_what_encode_record_refuses() -> None:
    with pytest.raises(RecordTooLargeError, match="exceeds"):
        encode_text_delta(1, 1, 1, 0, b"x" * MAX_RECORD_BYTES, 0)
