"""Reader: streaming, and the integrity classification of every way a bundle can end."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from google.protobuf import proto

from rollout.trace.v1 import record_pb2
from trace_reducer import (
    BundleNotFoundError,
    BundleWriter,
    FrameDecoder,
    NotABundleError,
    encode_record,
    integrity_name,
    read_bundle,
)


def _small_bundle(root: Path) -> Path:
    writer = BundleWriter.create(root, "thread-1")
    writer.append(
        record_pb2.TraceRecord(
            thread_started=record_pb2.ThreadStarted(thread=1, thread_id="thread-1", model="m")
        )
    )
    item = writer.put_payload(b'{"role":"user"}', record_pb2.PAYLOAD_KIND_INPUT_ITEM)
    writer.append(
        record_pb2.TraceRecord(
            turn_started=record_pb2.TurnStarted(
                turn=1, thread=1, turn_id="turn-1", input_payload_ids=[item]
            )
        )
    )
    for word in ["one ", "two"]:
        writer.append(
            record_pb2.TraceRecord(output_text_delta=record_pb2.OutputTextDelta(call=1, delta=word))
        )
    writer.close()
    return writer.file_path


def _classify(data: bytes) -> tuple[str, int]:
    decoder = FrameDecoder()
    count = 0
    # Feed in uneven pieces: the classification must not depend on chunking.
    for start in range(0, len(data), 7):
        count += len(decoder.feed(data[start : start + 7]))
    integrity = decoder.finish()
    assert integrity.records_read == count
    return integrity_name(integrity.status), count


def test_clean_bundle(tmp_path: Path) -> None:
    path = _small_bundle(tmp_path)
    with read_bundle(path.parent) as reader:
        seqs = [r.seq for r in reader]
        integrity = reader.integrity
    assert seqs == [1, 2, 3, 4, 5, 6, 7]
    assert integrity_name(integrity.status) == "CLEAN"
    assert integrity.bytes_read == path.stat().st_size
    assert integrity.records_read == 7


def test_standard_delimited_reader_reads_every_record(tmp_path: Path) -> None:
    path = _small_bundle(tmp_path)
    seqs = []
    with io.BytesIO(path.read_bytes()) as stream:
        while (record := proto.parse_length_prefixed(record_pb2.TraceRecord, stream)) is not None:
            seqs.append(record.seq)
    assert seqs == [1, 2, 3, 4, 5, 6, 7]


def test_every_truncation_is_classified_never_clean(tmp_path: Path) -> None:
    data = _small_bundle(tmp_path).read_bytes()
    boundaries = set()
    offset = 0
    while offset < len(data):
        size = data[offset]  # every frame of this small bundle has a one-byte length
        offset += 1 + size
        boundaries.add(offset)
    for cut in range(len(data)):
        status, count = _classify(data[:cut])
        expected = "UNCLOSED" if cut in boundaries else "TRUNCATED"
        assert status == expected, (cut, status)
        assert count == sum(1 for b in boundaries if b <= cut)


def test_every_single_bit_flip_is_detected(tmp_path: Path) -> None:
    data = _small_bundle(tmp_path).read_bytes()
    for index in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[index] ^= 1 << bit
            status, _ = _classify(bytes(damaged))
            assert status in {"CORRUPT", "TRUNCATED"}, (index, bit, status)


def test_zero_filled_tail_is_corrupt(tmp_path: Path) -> None:
    writer = BundleWriter.create(tmp_path, "t")
    writer.abandon()
    data = writer.file_path.read_bytes()
    decoder = FrameDecoder()
    assert len(decoder.feed(data + bytes(4096))) == 1
    integrity = decoder.finish()
    assert integrity_name(integrity.status) == "CORRUPT"
    assert integrity.bad_frame_offset == len(data)
    assert integrity.bad_frame_seq == 2


def test_data_after_footer_is_corrupt(tmp_path: Path) -> None:
    data = _small_bundle(tmp_path).read_bytes()
    extra = encode_record(record_pb2.TraceRecord(seq=8, footer=record_pb2.Footer(record_count=8)))
    assert _classify(data + extra) == ("CORRUPT", 7)
    decoder = FrameDecoder()
    decoder.feed(data)
    decoder.feed(b"\x00")
    assert decoder.finish().detail.endswith("data after the footer")


def test_seq_gap_and_missing_header_are_corrupt() -> None:
    header = record_pb2.TraceRecord(seq=1, header=record_pb2.Header(thread_id="t"))
    gap = record_pb2.TraceRecord(seq=3, provider_event=record_pb2.ProviderEvent())
    status, count = _classify(encode_record(header) + encode_record(gap))
    assert (status, count) == ("CORRUPT", 1)
    not_header = record_pb2.TraceRecord(seq=1, provider_event=record_pb2.ProviderEvent())
    assert _classify(encode_record(not_header)) == ("CORRUPT", 0)


def test_footer_with_wrong_count_is_corrupt() -> None:
    header = record_pb2.TraceRecord(seq=1, header=record_pb2.Header(thread_id="t"))
    footer = record_pb2.TraceRecord(seq=2, footer=record_pb2.Footer(record_count=5))
    assert _classify(encode_record(header) + encode_record(footer)) == ("CORRUPT", 1)


def test_corrupt_detail_names_offset_and_seq(tmp_path: Path) -> None:
    data = bytearray(_small_bundle(tmp_path).read_bytes())
    second_frame = 1 + data[0]
    data[second_frame + 3] ^= 0xFF
    decoder = FrameDecoder()
    decoder.feed(bytes(data))
    integrity = decoder.finish()
    assert integrity_name(integrity.status) == "CORRUPT"
    assert integrity.bad_frame_offset == second_frame
    assert integrity.bad_frame_seq == 2
    assert f"byte {second_frame}" in integrity.detail
    assert "seq 2" in integrity.detail


def test_garbage_and_empty_input() -> None:
    assert _classify(b"")[0] == "TRUNCATED"
    assert _classify(b"this is not a bundle at all")[0] in {"CORRUPT", "TRUNCATED"}
    decoder = FrameDecoder()
    decoder.feed(io.BytesIO(b"\xff" * 64).read())
    assert integrity_name(decoder.finish().status) == "CORRUPT"


def test_missing_path_and_directory_without_trace(tmp_path: Path) -> None:
    with pytest.raises(BundleNotFoundError):
        read_bundle(tmp_path / "nope")
    with pytest.raises(NotABundleError):
        read_bundle(tmp_path)


def test_integrity_is_unknown_before_reading(tmp_path: Path) -> None:
    with read_bundle(_small_bundle(tmp_path)) as reader, pytest.raises(RuntimeError):
        _ = reader.integrity
