"""Runs of text-delta frames, checked and parsed in a few C calls instead of a few per frame.

Most records of a bundle are text deltas of one call's latest output item, and most of those
items later complete with their whole text as a payload, so a delta's text is rarely needed.
Checking, parsing and handing such frames over one by one is what made replay slow; here a run
of them is proven to hold exactly what a frame-by-frame read would find, or it is handed back to
be read frame by frame. The proof, for frames that each fit a one-byte length:

* Each frame's first bytes are those of `seq`, `time_us` and an `output_text_delta` whose own
  first field is `call`, at the offsets their canonical encodings give (checked a column at a
  time over fixed-width heads), and the delta's length is what is left of the frame before the
  5-byte CRC field. So each record has at least one `seq`, `time_us`, `call` and `delta` field
  where a parser starts reading one.
* All the frames, each as one element of a container message, are parsed in one call as a
  single merged message whose fields are repeated: if there are exactly as many `seq`,
  `time_us`, `crc32c`, `call` and `delta` values as frames, and nothing of any other body, each
  record has exactly one of each, so the values line up with the frames. The seqs must run on,
  every `call` must be the same and no `item` may appear; the parse checks the UTF-8 of every
  `delta`.
* CRC-32C is affine: a whole frame's CRC (length byte and CRC field included) is H(C) ^ K(L)
  for a frame whose body has CRC C and whose length byte is L, H linear. So the XOR of the
  frames' CRCs, each one C call, must equal H(XOR of the stored CRCs) ^ XOR of K(L): one damaged
  frame always breaks it, several cancel with odds of 2^-32, those of a CRC-32 missing damage.

Anything that fails any of this is read frame by frame, which finds the first bad frame exactly.
"""

from __future__ import annotations

import functools
import operator
import re
import sys
from array import array
from collections.abc import Callable, Iterator
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import google_crc32c
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from rollout.trace.v1 import record_pb2

# A run shorter than this is cheaper to read frame by frame.
MIN_RUN = 8

_DELTA_FIELD = record_pb2.TraceRecord.OUTPUT_TEXT_DELTA_FIELD_NUMBER
_LEN_TAG_DELTA = (_DELTA_FIELD << 3) | 2  # 0x5A
_TAG_SEQ = 0x08
_TAG_TIME = 0x10
_TAG_CALL = 0x08
_TAG_TEXT = 0x12
_CRC_TRAILER = 5
# The fields a record of a run may have; anything else sends the run back.
_RUN_FIELDS = frozenset({"seq", "time_us", "output_text_delta", "crc32c"})
_DELTA_FIELDS = frozenset({"call", "delta"})


def varint_size(value: int) -> int:
    """Bytes of value's canonical varint."""
    return max(1, (value.bit_length() + 6) // 7)


# -- message types for reading many records as one ---------------------------------------------


def _message_types() -> tuple[type[Message], type[Message], type[Message], type[Message]]:
    """(MergedBatch, RecordBatch, Delta, Merged), built from TraceRecord's own descriptor so
    that they follow it.

    Merged has every field of TraceRecord, repeated, the bodies as bytes but
    output_text_delta, which is a singular Delta (OutputTextDelta with repeated fields): a
    container whose elements are frames, parsed as Merged, concatenates each field's values
    over all frames. Records is the same container parsed as repeated TraceRecord.
    """
    source = descriptor_pb2.FileDescriptorProto()
    record_pb2.DESCRIPTOR.CopyToProto(source)
    package = "rollout.trace.v1.bulk"
    bulk = descriptor_pb2.FileDescriptorProto(
        name="rollout/trace/v1/bulk.proto",
        package=package,
        syntax="proto3",
        dependency=[record_pb2.DESCRIPTOR.name],
    )
    by_name = {message.name: message for message in source.message_type}
    label_repeated = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    label_optional = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    type_message = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
    type_bytes = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES

    delta = bulk.message_type.add()
    delta.CopyFrom(by_name["OutputTextDelta"])
    delta.name = "Delta"
    for field in delta.field:
        field.label = label_repeated
        field.ClearField("oneof_index")
        field.ClearField("proto3_optional")
    delta.ClearField("oneof_decl")

    merged = bulk.message_type.add()
    merged.CopyFrom(by_name["TraceRecord"])
    merged.name = "Merged"
    merged.ClearField("oneof_decl")
    for field in merged.field:
        field.ClearField("oneof_index")
        field.ClearField("proto3_optional")
        if field.number == _DELTA_FIELD:
            field.label = label_optional
            field.type_name = f".{package}.Delta"
        else:
            field.label = label_repeated
            if field.type == type_message:
                field.type = type_bytes
                field.ClearField("type_name")

    for name, type_name, label in (
        ("MergedBatch", f".{package}.Merged", label_optional),
        ("RecordBatch", ".rollout.trace.v1.TraceRecord", label_repeated),
    ):
        batch = bulk.message_type.add(name=name)
        batch.field.add(name="records", number=1, type=type_message, type_name=type_name)
        batch.field[0].label = label

    # Beside record.proto in the default pool, so that RecordBatch holds real TraceRecords.
    pool = descriptor_pool.Default()
    pool.AddSerializedFile(bulk.SerializeToString())

    def get(name: str) -> type[Message]:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))

    return get("MergedBatch"), get("RecordBatch"), get("Delta"), get("Merged")


# Merged is held although only read through MergedBatch: a class upb makes on demand for a
# field's message and nobody holds is left in a cycle for the collector at its first use.
_MergedBatch, _RecordBatch, _Delta, _Merged = _message_types()


# -- CRC-32C algebra -----------------------------------------------------------------------------

_POLY = 0x82F63B78  # CRC-32C, reflected
_ALL_ONES = 0xFFFFFFFF  # its initial register and final XOR


@functools.cache
def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        value = byte
        for _ in range(8):
            value = (value >> 1) ^ _POLY if value & 1 else value >> 1
        table.append(value)
    return tuple(table)


def _register(start: int, data: bytes) -> int:
    """The CRC register after data, from start (no initial value or final XOR of its own)."""
    table = _crc_table()
    for byte in data:
        start = (start >> 8) ^ table[(start ^ byte) & 0xFF]
    return start


def _zeros(count: int, value: int) -> int:
    return _register(value, bytes(count))


def _frame_crc_linear(stored: int) -> int:
    """H: the part of a whole frame's CRC that its stored CRC C decides (linear in C)."""
    return _register(0, b"\x00" + stored.to_bytes(4, "little")) ^ _zeros(5, stored)


@functools.cache
def _crc_tables() -> tuple[tuple[tuple[int, ...], ...], tuple[bytes, ...]]:
    """H as four byte tables, and K(L) for every one-byte length L as four translate tables
    (byte j of K(L) at index L of the j-th)."""
    h = tuple(
        tuple(_frame_crc_linear(byte << (8 * shift)) for byte in range(256)) for shift in range(4)
    )
    trailer = _register(0, bytes([0x7D, 0, 0, 0, 0])) ^ _ALL_ONES
    k = [0] * 128
    for length in range(_CRC_TRAILER, 128):
        prefix = _ALL_ONES ^ _register(_ALL_ONES, bytes([length]))
        g = _ALL_ONES ^ _zeros(length - _CRC_TRAILER, prefix)
        k[length] = trailer ^ _zeros(5, g)
    k_bytes = tuple(
        bytes((k[length] >> (8 * shift)) & 0xFF if length < 128 else 0 for length in range(256))
        for shift in range(4)
    )
    return h, k_bytes


def _fold(data: bytes, width: int = 32) -> int:
    """XOR of the little-endian `width`-bit words of data, by halving one big integer."""
    value = int.from_bytes(data, "little")
    bits = len(data) * 8
    while bits > width:
        half = ((bits // width + 1) // 2) * width
        value = (value & ((1 << half) - 1)) ^ (value >> half)
        bits = half
    return value


def frames_crc_ok(frames: list[bytes], lengths: bytes, stored: bytes) -> bool:
    """Whether frames (each whole, one-byte length first) all carry their body's CRC.

    lengths: each frame's length byte; stored: each one's CRC field value, as little-endian
    32-bit words.
    """
    h, k_bytes = _crc_tables()
    total = _fold(array("I", map(google_crc32c.value, frames)).tobytes())
    # XOR of K(L) over the frames, a byte of it at a time: each frame's length byte looked up
    # in a table of that byte of K.
    for shift, table in enumerate(k_bytes):
        total ^= _fold(lengths.translate(table), 8) << (8 * shift)
    crc = _fold(stored)
    expected = (
        h[0][crc & 0xFF] ^ h[1][(crc >> 8) & 0xFF] ^ h[2][(crc >> 16) & 0xFF] ^ h[3][crc >> 24]
    )
    return total == expected


# -- any records ---------------------------------------------------------------------------------

_CRC_TAG = 0x7D
_SEQ = attrgetter("seq")
_BODY = methodcaller("WhichOneof", "body")
_TRAILER_TAG = itemgetter(-5)
_STORED_CRC = itemgetter(slice(-4, None))
# The smallest frame a record makes: a length, a seq field and the CRC field.
_MIN_FRAME = 1 + 2 + _CRC_TRAILER


def parse_frames(frames: list[bytes], first_seq: int) -> list[record_pb2.TraceRecord] | None:
    """frames (each whole, its length first) as the records a frame-by-frame read gives, their
    CRCs and seqs checked, in a few C calls; None when any frame is not an ordinary record of
    the stretch (damage, the header, the footer), for a frame-by-frame read to find it.

    * Each frame as one element of a container of repeated TraceRecord (its length prefix is
      the element's) parses exactly as the frame alone does; one bad frame fails the parse.
    * Each frame ends with the CRC field, whose value is the CRC-32C of the body before it.
    * The seqs run on from first_seq; no record is a header or a footer.
    """
    count = len(frames)
    if first_seq == 1 or not count or min(map(len, frames)) < _MIN_FRAME:
        return None
    if bytes(map(_TRAILER_TAG, frames)) != bytes([_CRC_TAG]) * count:
        return None
    # A length takes one byte up to 127, two up to 16 KiB (nearly every record); a longer
    # frame is read alone.
    bodies = [
        frame[1:-5] if frame[0] < 0x80 else frame[2:-5] if frame[1] < 0x80 else None
        for frame in frames
    ]
    if None in bodies or sys.byteorder != "little":
        return None
    computed = array("I", map(google_crc32c.value, bodies)).tobytes()
    if computed != b"".join(map(_STORED_CRC, frames)):
        return None
    return parse_container(b"\n" + b"\n".join(frames), first_seq, count)


def parse_container(
    container: bytes, first_seq: int, count: int, *, scanned: bool = False
) -> list[record_pb2.TraceRecord] | None:
    """The `count` records of container (frames whose CRCs hold, each after a 0x0A byte) as a
    frame-by-frame read gives them; None when one does not parse, their seqs do not run on
    from first_seq, or one is a header or a footer.

    scanned: the C scanner made the container, and has seen to the seqs and the bodies (each
    record's one seq field is the one expected, and no field is a header or a footer), which
    are then not asked for again."""
    try:
        batch: Any = _RecordBatch.FromString(container)
    except DecodeError:
        return None
    records: list[record_pb2.TraceRecord] = list(batch.records)
    if len(records) != count:
        return None
    if scanned:
        return records
    if list(map(_SEQ, records)) != list(range(first_seq, first_seq + count)):
        return None
    kinds = set(map(_BODY, records))
    if "header" in kinds or "footer" in kinds:
        return None
    return records


# -- runs ------------------------------------------------------------------------------------------


class DeltaRun:
    """count consecutive text-delta records, seq first_seq on, of `call`'s latest item (item 0).

    The text is not decoded until asked for: most of it never is.
    """

    __slots__ = ("call", "container", "count", "first_seq", "last_time_us")

    def __init__(
        self, call: int, first_seq: int, count: int, last_time_us: int, container: bytes
    ) -> None:
        self.call = call
        self.first_seq = first_seq
        self.count = count
        self.last_time_us = last_time_us
        self.container = container

    @property
    def size(self) -> int:
        """Bytes it holds."""
        return len(self.container)

    def text(self) -> str:
        """The deltas' text, joined."""
        merged: Any = _MergedBatch.FromString(self.container)
        return "".join(merged.records.output_text_delta.delta)

    def records(self) -> list[record_pb2.TraceRecord]:
        """The records themselves, as a frame-by-frame read gives them."""
        batch: Any = _RecordBatch.FromString(self.container)
        return list(batch.records)


class RunFinder:
    """Finds and proves the delta runs among the complete frames of one buffer."""

    __slots__ = ("_base", "_flags", "_frames", "_heads", "_k", "_vt", "_width")

    def __init__(self, frames: list[bytes], base: int, first_seq: int, last_time_us: int):
        """frames: the buffer's complete frames, each with its length prefix; those from index
        base on are looked at.

        first_seq: the seq the frame at base must have; last_time_us: the time of the record
        before it (deltas that follow mostly have a time of the same encoded size).
        """
        self._base = base
        self._frames = frames = frames[base:] if base else frames
        count = len(frames)
        self._k = k = varint_size(first_seq)
        self._vt = vt = varint_size(last_time_us)
        # Each frame's first `width` bytes, side by side, so that a byte at one offset in every
        # frame is one strided slice: the length byte at 0, then `08 seq 10 time 5A length 08
        # call 12`, the call's size known only once parsed (at most 3 bytes here).
        self._width = width = 10 + k + vt
        heads = b"".join(map(operator.itemgetter(slice(0, width)), frames))
        if len(heads) != count * width:
            # A frame shorter than a delta's head (no delta is): pad it, keep the columns.
            heads = b"".join(frame[:width].ljust(width, b"\xff") for frame in frames)
        self._heads = heads
        bad = 0
        for offset, table in _column_checks(k, vt):
            bad |= int.from_bytes(heads[offset::width].translate(table), "big")
        # The delta's length is what the frame holds after seq, time and the delta's own tag
        # and length: then nothing but the CRC field follows it.
        expected = heads[0::width].translate(_minus(9 + k + vt))
        bad |= int.from_bytes(expected, "big") ^ int.from_bytes(heads[4 + k + vt :: width], "big")
        self._flags = bad.to_bytes(count, "big") if count else b""

    def sizes_hold(self, next_seq: int, last_time_us: int) -> bool:
        """Whether the seq and time sizes it looks for are still those of records to come."""
        return varint_size(next_seq) == self._k and varint_size(last_time_us) == self._vt

    def runs(self) -> Iterator[tuple[int, int]]:
        """(first, end) frame indexes of each stretch that may be a run, at least MIN_RUN long."""
        base = self._base
        # Flags are 0 where a frame may belong to a run; anything else is why it may not.
        for match in _RUN_FLAGS.finditer(self._flags):
            first, end = match.span()
            yield first + base, end + base

    def prove(self, first: int, end: int, first_seq: int) -> DeltaRun | None:
        """The run of frames [first, end), or None when any part of the proof fails."""
        first -= self._base
        end -= self._base
        count = end - first
        k = self._k
        if first_seq == 1 or varint_size(first_seq) != k or varint_size(first_seq + count - 1) != k:
            return None
        width = self._width
        heads = self._heads
        below = first * width
        above = end * width
        # Each frame's first seq field is the seq it must have, in exactly k bytes.
        for offset, expected in enumerate(_varint_columns(first_seq, count, k)):
            if heads[below + 2 + offset : above : width] != expected:
                return None
        # The call: its bytes in the first frame, and the same bytes in every other; then the
        # text's tag.
        call_at = 6 + k + self._vt
        head = heads[below : below + width]
        call_end = call_at
        while head[call_end] & 0x80:
            call_end += 1
            if call_end >= width - 1:
                return None
        call_end += 1
        for offset in range(call_at, call_end):
            if heads[below + offset : above : width] != head[offset : offset + 1] * count:
                return None
        if heads[below + call_end : above : width] != bytes([_TAG_TEXT]) * count:
            return None
        frames = self._frames[first:end]
        container = b"\n" + b"\n".join(frames)
        try:
            batch: Any = _MergedBatch.FromString(container)
        except DecodeError:
            return None
        merged = batch.records
        if {field.name for field, _ in merged.ListFields()} - _RUN_FIELDS:
            return None
        delta = merged.output_text_delta
        if (
            not (
                len(merged.seq)
                == len(merged.time_us)
                == len(merged.crc32c)
                == len(delta.call)
                == len(delta.delta)
                == count
            )
            or {field.name for field, _ in delta.ListFields()} - _DELTA_FIELDS
        ):
            # A delta naming its item, or of another kind of text, is read on its own.
            return None
        call = delta.call[0]
        last_time_us = merged.time_us[-1]
        # What is left after clearing the rest is the CRC fields, packed: their raw words.
        for name in ("seq", "time_us", "output_text_delta"):
            merged.ClearField(name)
        stored = merged.SerializeToString()[-4 * count :]
        if sys.byteorder != "little" or not frames_crc_ok(frames, heads[below:above:width], stored):
            return None
        return DeltaRun(call, first_seq, count, last_time_us, container)


def _varint_columns(first: int, count: int, size: int) -> Iterator[bytes]:
    """Byte j of the `size`-byte varints of first, first+1, ... (count of them), for each j."""
    for index in range(size):
        shift = 7 * index
        more = 0x80 if index < size - 1 else 0
        if index == 0:
            # The lowest byte cycles through 128 values, one per seq.
            start = first % 128
            cycle = _CYCLE_MORE if more else _CYCLE
            repeats = (start + count) // 128 + 1
            yield (cycle * repeats)[start : start + count]
            continue
        # A higher byte stays the same for 128**index seqs at a time.
        block = 1 << shift
        pieces = []
        value = first
        while value < first + count:
            following = min(first + count, (value // block + 1) * block)
            pieces.append(bytes([((value >> shift) & 0x7F) | more]) * (following - value))
            value = following
        yield b"".join(pieces)


_CYCLE = bytes(range(128))
_CYCLE_MORE = bytes(range(0x80, 0x100))


def _table(accepted: Callable[[int], bool]) -> bytes:
    """A translate table: 0 for the bytes accepted, 1 for the others."""
    return bytes(0 if accepted(byte) else 1 for byte in range(256))


def _tag(value: int) -> bytes:
    return _table(lambda byte: byte == value)


_SMALL = _table(lambda byte: byte < 0x80)
_MORE = _table(lambda byte: byte >= 0x80)  # a varint byte with more to come
_LAST = _table(lambda byte: 0 < byte < 0x80)  # the last byte of a canonical, non-zero varint
_TAGS = {tag: _tag(tag) for tag in (_TAG_SEQ, _TAG_TIME, _LEN_TAG_DELTA)}


@functools.cache
def _column_checks(k: int, vt: int) -> tuple[tuple[int, bytes], ...]:
    """(offset, table) of each byte checked in a frame's head, for seq and time sizes k, vt."""
    checks = [(0, _SMALL), (1, _TAGS[_TAG_SEQ]), (2 + k, _TAGS[_TAG_TIME])]
    # time_us takes exactly vt bytes: more-bits on all but the last, the last not zero (a
    # time_us of 0 is not written at all).
    checks += [(3 + k + index, _MORE) for index in range(vt - 1)]
    checks.append((2 + k + vt, _LAST))
    checks += [(3 + k + vt, _TAGS[_LEN_TAG_DELTA]), (5 + k + vt, _tag(_TAG_CALL))]
    return tuple(checks)


@functools.cache
def _minus(amount: int) -> bytes:
    return bytes((value - amount) % 256 for value in range(256))


_RUN_FLAGS = re.compile(b"\\x00{%d,}" % MIN_RUN)
