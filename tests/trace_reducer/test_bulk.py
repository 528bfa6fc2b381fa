"""Delta runs read in bulk give exactly what reading frame by frame gives, whatever the frames.

Runs of text deltas are checked and parsed a run at a time (trace_reducer.bundle._bulk); these tests
put every way a frame can look like a delta and not be one (or be one written oddly) into such
runs and compare the records, the integrity and the reduced state with a frame-by-frame read.
The other records are checked and parsed a stretch at a time (parse_frames): the same
comparison, with every oddity a frame of a stretch can have. Every test runs twice: with the C
frame scanner (_scan.c) and with the bulk path in Python that stands in where it is not built.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable

import google_crc32c
import pytest

from rollout.trace.v1 import record_pb2, state_pb2
from trace_reducer import (
    FrameDecoder,
    Reducer,
    ReductionError,
    encode_record,
    encode_varint,
)
from trace_reducer.bundle import _reader
from trace_reducer.bundle._bulk import DeltaRun, frames_crc_ok


@pytest.fixture(autouse=True, params=["native", "python"])
def scanner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which bulk path FrameDecoder() takes: the C scanner, or Python's."""
    if request.param == "python":
        monkeypatch.setattr(_reader, "_scan", None)
    elif importlib.util.find_spec("trace_reducer.bundle._scan") is None:
        pytest.fail("the C frame scanner was not built (setup.py's extension)")
    return str(request.param)


FUZZ_RUNS = int(os.environ.get("FUZZ_BULK_ITERATIONS", "300"))

Field = tuple[int, int, bytes]  # number, wire type, encoded value (varint or bytes)


def varint_field(number: int, value: int, *, pad: int = 0) -> Field:
    encoded = bytearray(encode_varint(value))
    for _ in range(pad):
        # A longer, non-canonical encoding of the same value.
        encoded[-1] |= 0x80
        encoded.append(0)
    return (number, 0, bytes(encoded))


def len_field(number: int, value: bytes) -> Field:
    return (number, 2, value)


def encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += encode_varint((number << 3) | wire)
        if wire == 2:
            out += encode_varint(len(value))
        out += value
    return bytes(out)


def frame(body: bytes) -> bytes:
    """body framed as the writer frames a record: CRC field last, length first."""
    crc = google_crc32c.value(body)
    record = body + b"\x7d" + int(crc).to_bytes(4, "little")
    return encode_varint(len(record)) + record


def delta_fields(seq: int, time_us: int, call: int, text: bytes) -> list[Field]:
    inner = encode([varint_field(1, call), len_field(2, text)])
    return [varint_field(1, seq), varint_field(2, time_us), len_field(11, inner)]


def opening(call: int = 1) -> list[bytes]:
    """The records before a call's deltas: header, thread, turn, call, an output item."""
    header = record_pb2.Header(format_version=1, trace_id="t", thread_id="thread-1")
    header.created_at.seconds = 1_700_000_000
    records = [
        record_pb2.TraceRecord(header=header),
        record_pb2.TraceRecord(
            thread_started=record_pb2.ThreadStarted(thread=1, thread_id="thread-1", model="m")
        ),
        record_pb2.TraceRecord(
            turn_started=record_pb2.TurnStarted(turn=1, thread=1, turn_id="turn-1")
        ),
        record_pb2.TraceRecord(
            inference_started=record_pb2.InferenceStarted(
                call=call, turn=1, inference_call_id="call-1"
            )
        ),
        record_pb2.TraceRecord(
            output_item_added=record_pb2.OutputItemAdded(call=call, item=1, item_type="message")
        ),
        # The call's latest item, which the deltas (item 0) go to; a delta naming item 1 does
        # not.
        record_pb2.TraceRecord(
            output_item_added=record_pb2.OutputItemAdded(call=call, item=2, item_type="message")
        ),
    ]
    for seq, record in enumerate(records, start=1):
        record.seq = seq
        record.time_us = 100_000 * seq
    return [encode_record(record) for record in records]


def reduce_both(data: bytes, rng: random.Random) -> int:
    """Frame by frame and in bulk, in random chunks: the same records, integrity and state.

    The opening records come as a chunk of their own, so that runs are looked for from the
    first delta on (with the seq and time sizes the records before them had). Returns how many
    runs the bulk read made.
    """
    exact = FrameDecoder(bulk=False)
    reference = Reducer()
    bulk = FrameDecoder()
    reducer = Reducer()
    exact_records: list[record_pb2.TraceRecord] = []
    bulk_records: list[record_pb2.TraceRecord] = []
    runs = 0
    pos = 0
    reference_error = bulk_error = ""
    opening_bytes = len(b"".join(opening()))
    while pos < len(data):
        step = opening_bytes if pos == 0 else rng.choice([7, 300, 4096, 1 << 18])
        chunk = data[pos : pos + step]
        pos += step
        records = exact.feed(chunk)
        exact_records += records
        items = bulk.feed_batch(chunk)
        runs += sum(isinstance(item, DeltaRun) for item in items)
        for item in items:
            bulk_records += item.records() if isinstance(item, DeltaRun) else [item]
        if not reference_error:
            try:
                for record in records:
                    reference.apply(record)
            except ReductionError as error:
                reference_error = str(error)
        if not bulk_error:
            try:
                reducer.apply_many(items)
            except ReductionError as error:
                bulk_error = str(error)
    assert bulk_records == exact_records
    assert bulk.finish() == exact.finish()
    assert bulk_error == reference_error
    if not reference_error:
        reference.set_integrity(exact.finish())
        reducer.set_integrity(bulk.finish())
        assert reducer.state() == reference.state()
    return runs


def build(deltas: list[bytes], *, tail: list[bytes] | None = None) -> bytes:
    return b"".join([*opening(), *deltas, *(tail or [])])


def plain_deltas(count: int, *, first_seq: int = 7, text: bytes = b"word ") -> list[bytes]:
    return [
        frame(encode(delta_fields(first_seq + i, 1_000_000 + 10 * i, 1, text)))
        for i in range(count)
    ]


def test_plain_deltas_are_read_as_runs(scanner: str) -> None:
    data = build(plain_deltas(2000))
    decoder = FrameDecoder()
    items = decoder.feed_batch(data)
    in_runs = sum(item.count for item in items if isinstance(item, DeltaRun))
    if scanner == "native":
        # The scanner reads each frame's fields, whatever their sizes: every delta is in a run.
        assert in_runs == 2000
    else:
        # Where the seq or the time grows a byte (the time after the opening records, the seq
        # at 128), a few frames are read one by one before the runs are looked for again.
        assert 2000 - 3 * 32 <= in_runs < 2000
    reduce_both(data, random.Random(1))


Mutation = Callable[[int, int], list[Field]]


def _odd(seq: int, time_us: int) -> dict[str, list[Field]]:
    """Delta-like records that are not plain deltas, each by one oddity."""
    inner = encode([varint_field(1, 1), len_field(2, b"odd ")])
    plain = delta_fields(seq, time_us, 1, b"odd ")
    return {
        "seq twice": [varint_field(1, seq), *plain],
        "seq twice, later": [*plain, varint_field(1, seq)],
        "no seq": plain[1:],
        "seq padded": [varint_field(1, seq, pad=1), *plain[1:]],
        "time padded": [plain[0], varint_field(2, time_us, pad=2), plain[2]],
        "no time": [plain[0], plain[2]],
        "time twice": [*plain[:2], varint_field(2, time_us + 1), plain[2]],
        "delta twice": [*plain, len_field(11, inner)],
        "empty delta after": [*plain, len_field(11, b"")],
        "another body after": [*plain, len_field(12, b"")],
        "another body before": [plain[0], plain[1], len_field(12, b""), plain[2]],
        "unknown field": [*plain, varint_field(99, 7)],
        "crc field inside": [*plain, (15, 5, b"\x00\x00\x00\x00")],
        "seq as packed": [len_field(1, encode_varint(seq)), *plain[1:]],
        "item named": [
            *plain[:2],
            len_field(11, encode([varint_field(1, 1), len_field(2, b"x"), varint_field(3, 1)])),
        ],
        "other call": delta_fields(seq, time_us, 2, b"odd "),
        "call padded": [
            *plain[:2],
            len_field(11, encode([varint_field(1, 1, pad=1), len_field(2, b"odd ")])),
        ],
        "call twice": [
            *plain[:2],
            len_field(11, encode([varint_field(1, 1), varint_field(1, 1), len_field(2, b"o")])),
        ],
        "text twice": [
            *plain[:2],
            len_field(11, encode([varint_field(1, 1), len_field(2, b"a"), len_field(2, b"b")])),
        ],
        "no text": [*plain[:2], len_field(11, encode([varint_field(1, 1)]))],
        "no call": [*plain[:2], len_field(11, encode([len_field(2, b"odd ")]))],
        "text first": [
            *plain[:2],
            len_field(11, encode([len_field(2, b"odd "), varint_field(1, 1)])),
        ],
        "invalid utf-8": delta_fields(seq, time_us, 1, b"\xff\xfe"),
        "lone surrogate bytes": delta_fields(seq, time_us, 1, b"\xed\xb0\x80"),
        "split character": delta_fields(seq, time_us, 1, b"\xe2\x82"),
        "empty text": delta_fields(seq, time_us, 1, b""),
        "time zero": [plain[0], plain[2]],
        "wrong seq": delta_fields(seq + 1, time_us, 1, b"odd "),
        "seq of 1": delta_fields(1, time_us, 1, b"odd "),
        "fields reordered": [plain[1], plain[0], plain[2]],
        "time grows a byte": delta_fields(seq, 300_000_000, 1, b"odd "),
        # A field where seq, time, the delta or its call would be, holding the same bytes under
        # another number: the frame's layout looks right, its meaning is not.
        "seq under field 15": [varint_field(15, seq), *plain[1:]],
        "time under field 14": [plain[0], varint_field(14, time_us), plain[2]],
        "delta as a provider event": [*plain[:2], len_field(13, inner)],
        "call under field 5": [
            *plain[:2],
            len_field(11, encode([varint_field(5, 1), len_field(2, b"odd ")])),
        ],
    }


ODDITIES = sorted(_odd(1, 1))


@pytest.mark.parametrize("oddity", ODDITIES)
def test_an_odd_frame_in_a_run_is_read_as_frame_by_frame_reads_it(oddity: str) -> None:
    rng = random.Random(oddity)
    deltas = plain_deltas(60)
    for position in (0, 1, 30, 59):
        odd = list(deltas)
        seq = 7 + position
        odd[position] = frame(encode(_odd(seq, 1_000_000 + 10 * position)[oddity]))
        runs = reduce_both(build(odd), rng)
        # The plain deltas before the odd frame, at least, are read as a run.
        assert runs or position < 8, position


# Two oddities in one run whose counts make up for each other: only the checks of each
# frame's own layout tell the run from plain deltas.
COMPENSATING = [
    ("seq twice", "no seq"),
    ("seq twice, later", "no seq"),
    ("time twice", "no time"),
    ("time twice", "time zero"),
    ("call twice", "no call"),
    ("text twice", "no text"),
    ("delta twice", "no text"),
    ("delta twice", "no call"),
    ("text first", "call padded"),
    ("seq as packed", "seq twice"),
    ("seq under field 15", "seq twice, later"),
    ("time under field 14", "time twice"),
    ("delta as a provider event", "delta twice"),
    ("call under field 5", "call twice"),
]


@pytest.mark.parametrize(("first", "second"), COMPENSATING)
def test_oddities_that_make_up_for_each_other(first: str, second: str) -> None:
    for positions in ((10, 11), (11, 10), (3, 40)):
        deltas = plain_deltas(60)
        for oddity, position in zip((first, second), positions, strict=True):
            time_us = 1_000_000 + 10 * position
            deltas[position] = frame(encode(_odd(7 + position, time_us)[oddity]))
        runs = reduce_both(build(deltas), random.Random(f"{first}{second}{positions}"))
        assert runs or min(positions) < 8


def test_damage_in_a_run_is_found_at_its_frame() -> None:
    data = bytearray(build(plain_deltas(100)))
    for at in (len(data) // 2, len(data) - 3):
        damaged = bytearray(data)
        damaged[at] ^= 0x10
        reduce_both(bytes(damaged), random.Random(at))
        decoder = FrameDecoder()
        decoder.feed_batch(bytes(damaged))
        integrity = decoder.finish()
        assert integrity.status in {
            state_pb2.INTEGRITY_STATUS_CORRUPT,
            state_pb2.INTEGRITY_STATUS_TRUNCATED,
        }


def payload_frame(seq: int, size: int) -> bytes:
    record = record_pb2.TraceRecord(seq=seq, time_us=2_000_000 + seq)
    record.payload.payload_id = f"p{seq}"
    record.payload.data = b'{"role":"user","content":"%s"}' % (b"x" * size)
    return encode_record(record)


def ordinary(first_seq: int = 7) -> list[bytes]:
    """Records no run takes: payloads of one- and two-byte lengths, a delta naming its item,
    and last a payload of a three-byte length."""
    frames = [payload_frame(first_seq + i, (40, 200)[i % 2]) for i in range(19)]
    named = record_pb2.TraceRecord(seq=first_seq + 19, time_us=3_000_000)
    named.output_text_delta.call = 1
    named.output_text_delta.item = 1
    named.output_text_delta.delta = "named"
    return [*frames, encode_record(named), payload_frame(first_seq + 20, 20_000)]


def crc_inside(seq: int) -> bytes:
    """A frame without a CRC field whose last four bytes are the CRC of the bytes before the
    fifth-last: the end of a payload's data."""
    head = encode([varint_field(1, seq)])
    # payload {payload_id: "p", data: 7 bytes of text, then the 4 bytes}
    inner_head = encode([len_field(1, b"p")]) + b"\x12\x0b" + b"texttex"
    body_head = head + b"\x2a" + encode_varint(len(inner_head) + 4) + inner_head
    crc = int(google_crc32c.value(body_head[:-1])).to_bytes(4, "little")
    return encode_varint(len(body_head) + 4) + body_head + crc


ODD_FRAMES: dict[str, Callable[[int], bytes]] = {
    "bad CRC": lambda seq: payload_frame(seq, 200)[:-1] + b"\x00",
    "no CRC field": lambda seq: encode_varint(6) + encode(delta_fields(seq, 5, 1, b"")),
    "seq skipped": lambda seq: payload_frame(seq + 1, 200),
    "a second header": lambda seq: encode_record(
        record_pb2.TraceRecord(seq=seq, header=record_pb2.Header(trace_id="t"))
    ),
    "an early footer": lambda seq: encode_record(
        record_pb2.TraceRecord(seq=seq, footer=record_pb2.Footer(record_count=seq))
    ),
    "a body that does not parse": lambda seq: frame(encode([varint_field(1, seq)]) + b"\xff"),
    "tiny": lambda seq: frame(b""),
    "no CRC field, the right CRC at its end": lambda seq: crc_inside(seq),
    "its CRC under another field": lambda seq: (
        lambda body: (
            encode_varint(len(body) + 5)
            + body
            + b"\x75"
            + int(google_crc32c.value(body)).to_bytes(4, "little")
        )
    )(encode([varint_field(1, seq), len_field(7, b"payload")])),
    "unknown body": lambda seq: frame(encode([varint_field(1, seq), len_field(200, b"new")])),
}


def read_whole(data: bytes, *, bulk: bool) -> tuple[list[record_pb2.TraceRecord], object]:
    decoder = FrameDecoder(bulk=bulk)
    return decoder.feed(data), decoder.finish()


@pytest.mark.parametrize("oddity", sorted(ODD_FRAMES))
def test_ordinary_records_are_read_together_as_frame_by_frame_reads_them(oddity: str) -> None:
    stretch = ordinary()
    assert reduce_both(build(stretch), random.Random(0)) == 0
    for position in (0, 1, 10, len(stretch) - 2, len(stretch) - 1):
        frames = list(stretch)
        frames[position] = ODD_FRAMES[oddity](7 + position)
        data = build(frames)
        # In one piece (the opening, then the stretch, each read together) and in random ones.
        assert read_whole(data, bulk=True) == read_whole(data, bulk=False)
        reduce_both(data, random.Random(position))


def test_runs_across_seq_and_time_sizes() -> None:
    # Seqs from 2 to 3 bytes, times from 4 to 5 bytes, calls beyond one byte.
    frames = [
        frame(encode(delta_fields(16_300 + i, 268_435_000 + 9 * i, 1, b"w "))) for i in range(200)
    ]
    header_and_rest = opening()
    bundle = b"".join(header_and_rest) + b"".join(frames)
    reduce_both(bundle, random.Random(3))  # seq gap at 7: CORRUPT, read the same both ways
    filler = plain_deltas(16_300 - 7)
    reduce_both(b"".join([*header_and_rest, *filler, *frames]), random.Random(4))


def footer(seq: int) -> bytes:
    return encode_record(
        record_pb2.TraceRecord(
            seq=seq, time_us=2_000_000, footer=record_pb2.Footer(record_count=seq)
        )
    )


def test_random_odd_runs() -> None:
    rng = random.Random(20261130)
    for _ in range(FUZZ_RUNS):
        count = rng.randrange(8, 120)
        deltas = plain_deltas(count, text=rng.choice([b"a", b"word ", b"\xc3\xa9t\xc3\xa9 "]))
        for _ in range(rng.randrange(0, 4)):
            position = rng.randrange(count)
            oddity = rng.choice(ODDITIES)
            time_us = 1_000_000 + 10 * position
            deltas[position] = frame(encode(_odd(7 + position, time_us)[oddity]))
        tail = rng.choice(
            [
                [],
                [footer(7 + count)],
                [footer(7 + count), bytes(rng.randrange(1, 40))],
                [footer(7 + count), *plain_deltas(10, first_seq=8 + count)],
                [footer(7 + count - 1)],
            ]
        )
        data = bytearray(build(deltas, tail=tail))
        if rng.random() < 0.3:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        reduce_both(bytes(data), rng)


def test_a_whole_frames_crc_is_affine_in_its_stored_crc() -> None:
    # What the bulk CRC check rests on: crc32c(frame) = H(C) ^ K(L), C the body's CRC and L the
    # one-byte length; and the XOR over frames of their CRCs follows from the XOR of the Cs.
    rng = random.Random(32)
    frames = []
    for _ in range(500):
        body = rng.randbytes(rng.randrange(0, 123))
        frames.append(frame(body))
    lengths = bytes(f[0] for f in frames)
    stored = b"".join(f[-4:] for f in frames)
    assert frames_crc_ok(frames, lengths, stored)
    for index in (0, 250, 499):
        damaged = bytearray(frames[index])
        damaged[rng.randrange(1, len(damaged))] ^= 1 << rng.randrange(8)
        changed = [*frames[:index], bytes(damaged), *frames[index + 1 :]]
        changed_stored = b"".join(f[-4:] for f in changed)
        assert not frames_crc_ok(changed, lengths, changed_stored), index


# Text at the edges of UTF-8: what a string field takes, and what it refuses.
UTF8_EDGES = [
    b"\xc2\x80",  # U+0080
    b"\xdf\xbf",  # U+07FF
    b"\xe0\xa0\x80",  # U+0800
    b"\xed\x9f\xbf",  # U+D7FF, the last before the surrogates
    b"\xee\x80\x80",  # U+E000, the first after them
    b"\xef\xbf\xbf",  # U+FFFF
    b"\xf0\x90\x80\x80",  # U+10000
    b"\xf4\x8f\xbf\xbf",  # U+10FFFF, the last code point
    b"\xc0\x80",  # overlong NUL
    b"\xc1\xbf",  # overlong
    b"\xe0\x9f\xbf",  # overlong three bytes
    b"\xed\xa0\x80",  # a high surrogate
    b"\xf0\x8f\xbf\xbf",  # overlong four bytes
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xf5\x80\x80\x80",
    b"\x80",  # a continuation byte alone
    b"word\xc2",  # cut short, at the end
    b"\xe0\xa0",
    b"\xf0\x90\x80",
    b"\xf8\x88\x80\x80\x80",  # five bytes
    b"\xe2\x82\xacok",  # a whole sign, then text
]


@pytest.mark.parametrize("text", UTF8_EDGES, ids=lambda text: text.hex())
def test_utf8_edges_in_a_run(text: bytes) -> None:
    deltas = plain_deltas(40)
    deltas[20] = frame(encode(delta_fields(27, 1_000_000 + 200, 1, text)))
    reduce_both(build(deltas), random.Random(text))
