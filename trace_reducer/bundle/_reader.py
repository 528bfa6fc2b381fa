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

from ._bulk import MIN_RUN, DeltaRun, RunFinder, parse_container, parse_frames
from ._discover import walk_bundles
from ._errors import BundleError, BundleNotFoundError, NotABundleError
from ._framing import CRC_FIELD, CRC_TAG, CRC_TRAILER_BYTES, MAX_RECORD_BYTES, decode_varint
from ._layout import TRACE_FILE_NAME

try:
    from . import _scan
except ImportError:  # built without a C compiler: the frames are read in Python
    _scan = None  # type: ignore[assignment]

Integrity = state_pb2.Integrity
CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN
UNCLOSED = state_pb2.INTEGRITY_STATUS_UNCLOSED
TRUNCATED = state_pb2.INTEGRITY_STATUS_TRUNCATED
CORRUPT = state_pb2.INTEGRITY_STATUS_CORRUPT

_READ_BYTES = 1 << 16
# Frames read one by one between checks of whether delta runs would now be found.
_SIZE_CHECK_EVERY = 32
_LOOKS_PER_BUFFER = 4
# Frames a buffer's proofs may look at, per frame of the buffer.
_PROOF_WORK = 4
# Fewer frames than this are cheaper to check and parse one at a time than together.
_PARSE_TOGETHER = 4


Item = record_pb2.TraceRecord | DeltaRun


class FrameDecoder:
    """Push-style decoder: feed bytes as they come, get the records that completed.

    It stops at the first bad frame and ignores what follows; finish() classifies the end.
    Records before the damage are always returned. feed() returns records; feed_batch()
    returns the same with runs of text deltas as DeltaRuns (see _bulk), which Reducer.apply_many
    takes without decoding their text. bulk=False reads every frame one by one, as the reference
    the runs are checked against.
    """

    def __init__(self, *, bulk: bool = True, native: bool = True) -> None:
        # The start of a frame not complete yet. Bytes are appended to it and decoding waits
        # until `_need` of them are there, so a frame fed in many small pieces costs its size,
        # not its size times the number of pieces.
        self._pending = bytearray()
        self._need = 0
        self._offset = 0  # absolute offset of _pending[0]
        self._next_seq = 1
        self._last_time_us = 0
        self._footer_seen = False
        self._bulk = bulk
        # The C scanner (_scan.c) where it was built; native=False reads the bulk path in
        # Python, as the reference it is tested against.
        self._scanner = _scan.scan if bulk and native and _scan is not None else None
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
        records: list[record_pb2.TraceRecord] = []
        for item in self.feed_batch(data):
            if isinstance(item, DeltaRun):
                records.extend(item.records())
            else:
                records.append(item)
        return records

    def feed_batch(self, data: bytes) -> list[Item]:
        """feed(), with runs of text deltas left whole as DeltaRuns."""
        if self._damage is not None or not data:
            return []
        if self._footer_seen:
            self._corrupt(self._offset, "data after the footer")
            return []
        if self._pending:
            if len(self._pending) + len(data) < self._need:
                self._pending += data
                return []
            # The partial frame is small beside a read: one copy of the read, not two.
            buffer = bytes(self._pending) + data
            self._pending.clear()
        else:
            buffer = data
        items: list[Item] = []
        if self._scanner is not None:
            consumed, problem = self._scanned(buffer, items)
            self._settle(buffer, consumed, problem)
            return items
        frames, split_end, problem = _split_frames(buffer)
        count = len(frames)
        done = 0
        if self._bulk:
            done = self._runs_and_records(frames, items)
        if done < count and not self._halted:
            done = self._one_by_one(frames, done, count, items)
        consumed = split_end if done == count else _offset_of(frames, done)
        self._settle(buffer, consumed, problem if done == count else "")
        return items

    def _settle(self, buffer: bytes, consumed: int, problem: str) -> None:
        """Name what stopped the read of buffer at `consumed`, if anything did, and keep what
        is left of it for the next feed."""
        if self._damage is None:
            if self._footer_seen:
                if consumed < len(buffer):
                    self._corrupt(self._offset + consumed, "data after the footer")
            elif problem:
                self._corrupt(self._offset + consumed, problem)
        self._advance(buffer, consumed)

    def _scanned(self, buffer: bytes, items: list[Item]) -> tuple[int, str]:
        """buffer's frames through the C scanner, what it does not take read here one frame
        at a time; return where the read stopped and, when that is damage the scan found
        before any frame, why."""
        scan = self._scanner
        assert scan is not None
        pos = 0
        while True:
            pieces, end, self._next_seq, stopped = scan(buffer, pos, self._next_seq)
            for call, first_seq, count, extra, container in pieces:
                if call >= 0:
                    items.append(DeltaRun(call, first_seq, count, extra, container))
                    self._last_time_us = extra
                    continue
                records = parse_container(container, first_seq, count, scanned=True)
                if records is not None:
                    items.extend(records)
                    self._last_time_us = records[-1].time_us
                    continue
                # Damage the CRC let through, or the footer: frame by frame finds which.
                frames, _, _ = _split_frames(buffer[extra : extra + len(container) - count])
                self._next_seq = first_seq
                done = self._one_by_one(frames, 0, len(frames), items, base=extra)
                if done < len(frames) or self._halted:
                    return extra + _offset_of(frames, done), ""
            if not stopped:
                return end, ""
            # One frame the scan does not take (the header, damage, a long prefix): alone.
            frame, problem = _one_frame(buffer, end)
            if frame is None:
                return end, problem
            done = self._one_by_one([frame], 0, 1, items, base=end)
            if not done or self._halted:
                return end + len(frame) * done, ""
            pos = end + len(frame)

    def _runs_and_records(self, frames: list[bytes], items: list[Item]) -> int:
        """Frames as delta runs where they prove to be, one by one between; return where it
        stopped (before a bad frame, after the footer, or at the end)."""
        count = len(frames)
        done = 0
        # Proving costs what it looks at; a frame that is not what it seems makes a stretch be
        # tried again in halves. This bounds what that may cost in all.
        budget = _PROOF_WORK * count
        # Each look costs what is left of the buffer; a few suffice for the sizes to settle
        # (a bundle's seqs and times grow a byte a handful of times in all).
        for _ in range(_LOOKS_PER_BUFFER):
            if done >= count:
                break
            finder = RunFinder(frames, done, self._next_seq, self._last_time_us)
            look_again = False
            for first, end in finder.runs():
                if first > done:
                    done = self._until_sizes_change(frames, done, first, items, finder)
                    if self._halted:
                        return done
                    look_again = done < first
                while done < end and not look_again:
                    # The longest run from here that proves: the stretch, or its first half, ...
                    length = end - done
                    run = None
                    while length >= MIN_RUN and budget >= length and run is None:
                        budget -= length
                        run = finder.prove(done, done + length, self._next_seq)
                        length //= 2
                    if run is not None:
                        items.append(run)
                        self._next_seq += run.count
                        self._last_time_us = run.last_time_us
                        done += run.count
                        continue
                    # No run starts here: a few frames, this one at least, are read alone.
                    step = min(end, done + MIN_RUN)
                    done = self._until_sizes_change(frames, done, step, items, finder)
                    if self._halted:
                        return done
                    look_again = done < step
                if look_again:
                    break
            else:
                done = self._until_sizes_change(frames, done, count, items, finder)
            if self._halted:
                break
        return done

    @property
    def _halted(self) -> bool:
        """Nothing more is read from this stream: it was damaged, or its footer came."""
        return self._damage is not None or self._footer_seen

    def _until_sizes_change(
        self,
        frames: list[bytes],
        first: int,
        end: int,
        items: list[Item],
        finder: RunFinder,
    ) -> int:
        """Frames [first, end) one by one, stopping early where the seq or the time grows a
        byte: that moves every field after it, so the runs beyond must be looked for again."""
        done = first
        while done < end:
            step = min(end, done + _SIZE_CHECK_EVERY)
            done = self._one_by_one(frames, done, step, items)
            if self._halted or not finder.sizes_hold(self._next_seq, self._last_time_us):
                break
        return done

    def _one_by_one(
        self, frames: list[bytes], first: int, end: int, items: list[Item], *, base: int = 0
    ) -> int:
        """Check and parse frames [first, end) one at a time; return where it stopped.

        It stops early at a bad frame (recording the damage) or after the footer. In bulk mode
        the frames are first tried all at once (parse_frames); only what that refuses is read
        one at a time here, which finds the bad frame exactly.
        """
        if self._bulk and end - first >= _PARSE_TOGETHER:
            together = parse_frames(frames[first:end], self._next_seq)
            if together is not None:
                items.extend(together)
                self._next_seq += len(together)
                self._last_time_us = together[-1].time_us
                return end
        append = items.append
        parse = record_pb2.TraceRecord.FromString
        checksum = google_crc32c.value
        unpack_crc = CRC_FIELD.unpack_from
        next_seq = self._next_seq
        index = first
        problem = ""
        # Only the last good record's time is kept: one read of it, not one per frame.
        last_record = None
        while index < end:
            frame = frames[index]
            if frame[0] < 0x80:
                body_start = 1
            elif frame[1] < 0x80:
                body_start = 2
            else:
                body_start = len(frame) - _frame_size(frame)
            size = len(frame) - body_start
            crc_at = len(frame) - CRC_TRAILER_BYTES
            tag, expected = unpack_crc(frame, crc_at) if size >= CRC_TRAILER_BYTES else (0, 0)
            if tag != CRC_TAG or checksum(frame[body_start:crc_at]) != expected:
                problem = "CRC mismatch" if size else "zero-length frame"
                break
            try:
                record = parse(frame[body_start:])
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
            last_record = record
            append(record)
            index += 1
            if body == "footer":
                self._footer_seen = True
                break
        self._next_seq = next_seq
        if last_record is not None:
            self._last_time_us = last_record.time_us
        if problem:
            self._corrupt(self._offset + base + _offset_of(frames, index), problem)
        return index

    def _advance(self, buffer: bytes, pos: int) -> None:
        self._offset += pos
        rest = len(buffer) - pos
        if not rest or self._damage is not None:
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


def _frame_size(frame: bytes) -> int:
    """The body size of a complete frame whose length prefix is several bytes long."""
    prefix = decode_varint(frame, 0)
    assert prefix is not None  # _split_frames found the frame complete
    return int(prefix[0])


def _split_frames(buffer: bytes) -> tuple[list[bytes], int, str]:
    """buffer's complete frames (length prefix included), where the last one ends, and why
    they stop before the buffer ends when that is damage rather than a frame still coming."""
    frames: list[bytes] = []
    add_frame = frames.append
    pos = 0
    end = len(buffer)
    problem = ""
    # This loop runs once per record of every bundle read: it is kept flat on purpose. Up to
    # `roomy`, any frame with a one-byte length fits in the buffer, so only its length is
    # looked at.
    roomy = end - 0x80
    while pos < roomy:
        size = buffer[pos]
        if size & 0x80:
            break
        following = pos + size + 1
        add_frame(buffer[pos:following])
        pos = following
    # Past the first longer frame: one- and two-byte lengths (frames up to 16 KiB, nearly all
    # of them) are read inline, longer ones through decode_varint.
    last = end - 1
    while pos < end:
        size = buffer[pos]
        if size < 0x80:
            following = pos + 1 + size
        elif pos < last and buffer[pos + 1] < 0x80:
            following = pos + 2 + ((size & 0x7F) | (buffer[pos + 1] << 7))
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
            following = body_start + size
        if following > end:
            break
        add_frame(buffer[pos:following])
        pos = following
    return frames, pos, problem


def _one_frame(buffer: bytes, pos: int) -> tuple[bytes | None, str]:
    """The whole frame at pos, or None and why not: "" when it is still coming, else the
    damage in its length prefix (what _split_frames would say of it)."""
    try:
        prefix = decode_varint(buffer, pos)
    except ValueError as error:
        return None, str(error)
    if prefix is None:
        return None, ""
    size, body_start = prefix
    if size > MAX_RECORD_BYTES:
        return None, f"frame length {size} exceeds the {MAX_RECORD_BYTES}-byte limit"
    following = body_start + size
    if following > len(buffer):
        return None, ""
    return buffer[pos:following], ""


def _offset_of(frames: list[bytes], index: int) -> int:
    """Where frame `index` starts in the buffer frames were split from."""
    return sum(map(len, frames[:index]))


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
            for item in batch:
                if isinstance(item, DeltaRun):
                    yield from item.records()
                else:
                    yield item

    def batches(self) -> Iterator[list[Item]]:
        """What each read of the file decoded (FrameDecoder.feed_batch), for Reducer.apply_many:
        runs of text deltas stay whole, and a loop over a million records saves a step each."""
        decoder = self._decoder
        read = self._source.read
        # Past the first bad frame nothing counts: the rest of the file is not even read.
        while not decoder.stopped and (chunk := read(_READ_BYTES)):
            yield decoder.feed_batch(chunk)
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
    candidate = given / TRACE_FILE_NAME if given.is_dir() else given
    if candidate.is_file():
        return candidate
    raise why_not_a_bundle(given)


def why_not_a_bundle(given: Path) -> BundleError:
    """Why a path given as one bundle names none, saying what it (or its trace.binpb) is: a
    FIFO, a socket, a link to nothing, ... Nothing is opened, so no FIFO is waited on."""
    if not os.path.lexists(given):
        return BundleNotFoundError(f"no such file or directory: {given}")
    candidate = given / TRACE_FILE_NAME if given.is_dir() else given
    if os.path.lexists(candidate):
        # Loaded on this path alone: grpc_common's package loads asyncio, which reading a
        # bundle never needs. Its words are the flags' own (`--config: x is a FIFO, ...`).
        from grpc_common._files import path_kind

        return NotABundleError(
            f"not a trace bundle ({candidate} is {path_kind(candidate)}, not a regular file)"
        )
    if _holds_a_bundle(given):
        # A root given where one of its bundles belongs (`reduce traces`): say so, and
        # where the bundles' names are, rather than only what the root lacks.
        return NotABundleError(
            f"not a trace bundle (no {TRACE_FILE_NAME}) but a root of bundles: {given}: "
            f"give one of them (`trace-reducer list {given}` names them)"
        )
    return NotABundleError(f"not a trace bundle (no {TRACE_FILE_NAME}): {given}")


def _holds_a_bundle(directory: Path) -> bool:
    # Its own subdirectories only, the layout the agent writes: an error message must not
    # walk a whole tree (`reduce ~`) to be said.
    try:
        return next(walk_bundles(directory, recursive=False), None) is not None
    except OSError:
        return False


def read_bundle(path: str | os.PathLike[str]) -> BundleReader:
    """Open a bundle (its directory or its trace.binpb) for streaming."""
    file_path = resolve_trace_file(path)
    try:
        source = file_path.open("rb", buffering=0)
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise BundleError(f"cannot read {file_path}: {reason}") from error
    return BundleReader(file_path, source)
