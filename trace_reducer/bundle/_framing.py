"""One frame in, one frame out: varint length prefix, the trailing CRC-32C field, size limits."""

from __future__ import annotations

import struct

import google_crc32c

from rollout.trace.v1 import record_pb2

from ._errors import RecordTooLargeError

# Go's protodelim reader refuses larger messages by default; staying under it keeps bundles
# readable everywhere.
MAX_RECORD_BYTES = 4 * 1024 * 1024

# The largest bundle ReducerService.ReduceRecords takes by default: the reducer's memory follows
# the state, but the bytes still cost time, and a client could send without end.
DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024 * 1024

# Field 15, wire type 5 (fixed32): (15 << 3) | 5.
CRC_TAG = 0x7D
CRC_TRAILER_BYTES = 5
# The trailer as it sits at the end of a frame: the field tag byte, then the little-endian CRC.
CRC_FIELD = struct.Struct("<BI")

_MAX_VARINT_BYTES = 10


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128, as protobuf writes lengths and integer fields; unrolled for the sizes
    nearly every length and record field has (time_us: 4 bytes up to 4.5 minutes into a
    bundle, 5 up to 9.5 hours)."""
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    if 0x80 <= value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if 0x4000 <= value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    if 0x200000 <= value < 0x10000000:
        return bytes(
            (value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80, value >> 21)
        )
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# One-byte varints, made once: nearly every field of a text-delta record is one.
_SMALL_VARINTS = tuple(bytes((value,)) for value in range(0x80))


def decode_varint(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int] | None:
    """Return (value, next position), None if buf ends inside the varint.

    Raises ValueError for a varint longer than 10 bytes.
    """
    value = 0
    shift = 0
    end = len(buf)
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    if end - pos >= _MAX_VARINT_BYTES:
        raise ValueError("length prefix is longer than 10 bytes")
    return None


def encode_record(record: record_pb2.TraceRecord) -> bytes:
    """Serialize record (its crc32c field is ignored) and frame it with its CRC appended."""
    record.crc32c = 0
    body = record.SerializeToString()
    checksum = int(google_crc32c.value(body))
    size = len(body) + CRC_TRAILER_BYTES
    if size > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"record of {size} bytes exceeds the {MAX_RECORD_BYTES}-byte limit"
        )
    return b"".join((encode_varint(size), body, CRC_FIELD.pack(CRC_TAG, checksum)))


def encode_text_delta(
    seq: int, time_us: int, call: int, item: int, delta: bytes, kind: int
) -> bytes:
    """The frame encode_record makes of TraceRecord(seq, time_us, output_text_delta(call,
    delta, item, kind)), byte for byte, without building the message: the record written once
    per provider read. Fields are in number order and zero (empty) ones left out, as protobuf
    serializes them; the caller keeps every value in its field's range (uint32, a known kind).
    """
    # OutputTextDelta: call (1) and delta (2, length-delimited), item (3), kind (4).
    body = b"\x08" + encode_varint(call) if call else b""
    if delta:
        body += b"\x12" + encode_varint(len(delta)) + delta
    if item:
        body += b"\x18" + encode_varint(item)
    if kind:
        body += b"\x20" + encode_varint(kind)
    # TraceRecord: seq (1), time_us (2), output_text_delta (11, length-delimited).
    times = b"\x10" + encode_varint(time_us) if time_us else b""
    record = b"\x08" + encode_varint(seq) + times + b"\x5a" + encode_varint(len(body)) + body
    size = len(record) + CRC_TRAILER_BYTES
    if size > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"record of {size} bytes exceeds the {MAX_RECORD_BYTES}-byte limit"
        )
    checksum = int(google_crc32c.value(record))
    return encode_varint(size) + record + CRC_FIELD.pack(CRC_TAG, checksum)


def verify_crc(frame: bytes) -> bool:
    """Whether frame (one record, without its length prefix) ends with a matching CRC field."""
    if len(frame) < CRC_TRAILER_BYTES:
        return False
    tag, expected = CRC_FIELD.unpack_from(frame, len(frame) - CRC_TRAILER_BYTES)
    return bool(tag == CRC_TAG and int(google_crc32c.value(frame[:-CRC_TRAILER_BYTES])) == expected)
