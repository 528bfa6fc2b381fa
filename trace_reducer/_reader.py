"""Streaming bundle reader: frames to records, and how the bundle ends (its integrity)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import google_crc32c
from google.protobuf.message import DecodeError

from rollout.trace.v1 import record_pb2, state_pb2

from ._errors import BundleError, BundleNotFoundError, NotABundleError, describe_os_error
from ._framing import CRC_FIELD, CRC_TAG, CRC_TRAILER_BYTES, MAX_RECORD_BYTES, decode_varint
from ._layout import TRACE_FILE_NAME

Integrity = state_pb2.Integrity
CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN
UNCLOSED = state_pb2.INTEGRITY_STATUS_UNCLOSED
TRUNCATED = state_pb2.INTEGRITY_STATUS_TRUNCATED
CORRUPT = state_pb2.INTEGRITY_STATUS_CORRUPT

_READ_BYTES = 1 << 16


class FrameDecoder:
    """Push-style decoder: feed bytes as they come, get the records that completed.

    It stops at the first bad frame and ignores what follows; finish() classifies the end.
    Records before the damage are always returned.
    """

    def __init__(self) -> None:
        # The start of a frame not complete yet. Bytes are appended to it and decoding waits
        # until `_need` of them are there, so a frame fed in many small pieces costs its size,
        # not its size times the number of pieces.
        self._pending = bytearray()
        self._need = 0
        self._offset = 0  # absolute offset of _pending[0]
        self._next_seq = 1
        self._footer_seen = False
        self._damage: state_pb2.Integrity | None = None

    @property
    def records_read(self) -> int:
        return self._next_seq - 1

    @property
    def stopped(self) -> bool:
        """Damage was found: nothing fed from now on is looked at."""
        return self._damage is not None

    def feed(self, data: bytes) -> list[record_pb2.TraceRecord]:
        """Decode every complete frame now buffered; keep a partial one for later."""
        if self._damage is not None or not data:
            return []
        if self._footer_seen:
            self._corrupt(self._offset, "data after the footer")
            return []
        if self._pending:
            self._pending += data
            if len(self._pending) < self._need:
                return []
            buffer = bytes(self._pending)
            self._pending.clear()
        else:
            buffer = data
        # This loop runs once per record of every bundle read: it is kept flat on purpose.
        records: list[record_pb2.TraceRecord] = []
        append = records.append
        parse = record_pb2.TraceRecord.FromString
        checksum = google_crc32c.value
        unpack_crc = CRC_FIELD.unpack_from
        next_seq = self._next_seq
        pos = 0
        end = len(buffer)
        problem = ""
        while pos < end:
            size = buffer[pos]
            if size < 0x80:
                body_start = pos + 1
            else:
                try:
                    prefix = decode_varint(buffer, pos)
                except ValueError as error:
                    problem = str(error)
                    break
                if prefix is None:
                    break
                size, body_start = prefix
                if size > MAX_RECORD_BYTES:
                    problem = f"frame length {size} exceeds the {MAX_RECORD_BYTES}-byte limit"
                    break
            body_end = body_start + size
            if body_end > end:
                break
            crc_at = body_end - CRC_TRAILER_BYTES
            tag, expected = unpack_crc(buffer, crc_at) if size >= CRC_TRAILER_BYTES else (0, 0)
            if tag != CRC_TAG or checksum(buffer[body_start:crc_at]) != expected:
                problem = "CRC mismatch" if size else "zero-length frame"
                break
            try:
                record = parse(buffer[body_start:body_end])
            except DecodeError as error:
                problem = f"record does not parse: {error}"
                break
            if record.seq != next_seq:
                problem = f"seq {record.seq} where {next_seq} was expected"
                break
            body = record.WhichOneof("body")
            if (body == "header") != (next_seq == 1):
                problem = "the first record must be the header, and only the first"
                break
            if body == "footer" and record.footer.record_count != next_seq:
                problem = f"footer counts {record.footer.record_count} records, found {next_seq}"
                break
            next_seq += 1
            append(record)
            pos = body_end
            if body == "footer":
                self._footer_seen = True
                if pos < end:
                    problem = "data after the footer"
                break
        self._next_seq = next_seq
        self._advance(buffer, pos)
        if problem:
            self._corrupt(self._offset, problem)
        return records

    def _advance(self, buffer: bytes, pos: int) -> None:
        self._offset += pos
        rest = len(buffer) - pos
        if not rest:
            return
        self._pending += memoryview(buffer)[pos:]
        # Decoding can go on once the whole frame is in, or at least its length prefix.
        try:
            prefix = decode_varint(buffer, pos)
        except ValueError:
            prefix = None
        self._need = rest + 1 if prefix is None else prefix[1] - pos + prefix[0]

    def finish(self) -> state_pb2.Integrity:
        """Classify the end of the stream once all bytes were fed."""
        if self._damage is not None:
            return self._damage
        read = self.records_read
        if self._pending:
            return Integrity(
                status=TRUNCATED,
                records_read=read,
                bytes_read=self._offset,
                detail=f"ends inside a frame at byte {self._offset} "
                f"({len(self._pending)} bytes of seq {self._next_seq})",
                bad_frame_offset=self._offset,
                bad_frame_seq=self._next_seq,
            )
        if self._footer_seen:
            return Integrity(status=CLEAN, records_read=read, bytes_read=self._offset)
        if read == 0:
            return Integrity(status=TRUNCATED, detail="empty: no header", bad_frame_seq=1)
        return Integrity(
            status=UNCLOSED,
            records_read=read,
            bytes_read=self._offset,
            detail=f"no footer after seq {read}",
        )

    def _corrupt(self, offset: int, reason: str) -> None:
        self._damage = Integrity(
            status=CORRUPT,
            records_read=self.records_read,
            bytes_read=offset,
            detail=f"bad frame at byte {offset} (seq {self._next_seq}): {reason}",
            bad_frame_offset=offset,
            bad_frame_seq=self._next_seq,
        )


class BundleReader:
    """Iterates over the records of one trace.binpb, streaming it from disk."""

    def __init__(self, file_path: Path, source: BinaryIO) -> None:
        self.file_path = file_path
        self.bundle_dir = file_path.parent
        self._source = source
        self._decoder = FrameDecoder()
        self._integrity: state_pb2.Integrity | None = None

    @property
    def integrity(self) -> state_pb2.Integrity:
        """How the bundle ends; valid once iteration is over."""
        if self._integrity is None:
            raise RuntimeError("integrity is known only after reading every record")
        return self._integrity

    def __iter__(self) -> Iterator[record_pb2.TraceRecord]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[record_pb2.TraceRecord]]:
        """The records in the lists they were decoded in (one per read of the file): a loop
        over a million records saves a generator step per record."""
        decoder = self._decoder
        read = self._source.read
        # Past the first bad frame nothing counts: the rest of the file is not even read.
        while not decoder.stopped and (chunk := read(_READ_BYTES)):
            yield decoder.feed(chunk)
        self._integrity = decoder.finish()

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def resolve_trace_file(path: str | os.PathLike[str]) -> Path:
    """The trace.binpb of a bundle given as its directory or as the file itself."""
    given = Path(path)
    if not given.exists():
        raise BundleNotFoundError(f"no such file or directory: {given}")
    candidate = given / TRACE_FILE_NAME if given.is_dir() else given
    if not candidate.is_file():
        raise NotABundleError(f"not a trace bundle (no {TRACE_FILE_NAME}): {given}")
    return candidate


def read_bundle(path: str | os.PathLike[str]) -> BundleReader:
    """Open a bundle (its directory or its trace.binpb) for streaming."""
    file_path = resolve_trace_file(path)
    try:
        source = file_path.open("rb", buffering=0)
    except OSError as error:
        raise BundleError(f"cannot read {describe_os_error(error, file_path)}") from error
    return BundleReader(file_path, source)
