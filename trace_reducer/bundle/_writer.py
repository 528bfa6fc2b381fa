"""BundleWriter: creates a bundle, frames records into it, dedups payloads, flushes and fsyncs."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rollout.trace.v1 import record_pb2

from ._errors import RecordingError, describe_os_error
from ._framing import MAX_RECORD_BYTES, encode_record, encode_text_delta
from ._layout import TRACE_FILE_NAME, bundle_dir_name
from ._liveness import lock_for_writing, release_writing_lock
from ._payloads import payload_id
from ._version import __version__

_WriteTextDelta = Callable[[int, int, int, int, int, str, int], tuple[int, int]]
_write_text_delta: _WriteTextDelta | None
try:
    from ._scan import write_text_delta as _write_text_delta
except ImportError:  # built without a C compiler: the frame is made in Python
    _write_text_delta = None

FORMAT_VERSION = 1

# Leaves room for the payload record's own fields and the frame around the chunk.
_CHUNK_BYTES = MAX_RECORD_BYTES - 4096
_UINT32_MAX = 2**32 - 1
_DELTA_KINDS = frozenset(record_pb2.DeltaKind.values())
# A delta of at most this many characters is under the record limit (4 UTF-8 bytes a
# character at most, and its fields), so the compiled frame needs no check of its size.
_COMPILED_DELTA_CHARS = MAX_RECORD_BYTES // 4 - 64


class BundleWriter:
    """Appends records to one bundle's trace.binpb; never appends after close or failure.

    Every frame goes to the OS in a single write() (an unbuffered file descriptor), so a killed
    process loses nothing it had recorded; sync() makes it durable. The file is locked for
    writing (flock) until it is closed or fails, which tells readers it is being written.
    """

    def __init__(self, bundle_dir: Path, fd: int, trace_id: str, created_at: datetime) -> None:
        self.bundle_dir = bundle_dir
        self.file_path = bundle_dir / TRACE_FILE_NAME
        self.trace_id = trace_id
        self.created_at = created_at
        self.record_count = 0
        # Bytes of the file written so far (frames that were written whole).
        self.bytes_written = 0
        self.failed = False
        self.closed = False
        self._fd = fd
        self._started_ns = time.monotonic_ns()
        self._payloads: set[str] = set()
        self._entry_synced = False

    @classmethod
    def create(
        cls,
        trace_root: str | Path,
        thread_id: str,
        *,
        trace_id: str | None = None,
        producer_name: str = "rollout-trace",
        producer_version: str = __version__,
    ) -> BundleWriter:
        """Create `<trace_root>/<UTC stamp>-<thread_id>/trace.binpb` and write its header.

        The bundle is made under a hidden temporary name and renamed into place once its header
        is written, so no one (a reader, a crash) ever sees a bundle without one; a failure
        removes what was made.
        """
        if not thread_id or "/" in thread_id or thread_id in {".", ".."} or "\0" in thread_id:
            raise RecordingError(f"invalid thread id for a bundle name: {thread_id!r}")
        created_at = datetime.now(UTC)
        root = Path(trace_root)
        name = bundle_dir_name(created_at, thread_id)
        try:
            if not root.is_dir():
                # mkdir -p would turn a typo into a silent new tree; a missing root is created,
                # anything else that is not a directory is the user's to fix.
                # Checked again: another writer (a second gateway) may just have made it.
                if root.exists() and not root.is_dir():
                    raise RecordingError(f"trace root is not a directory: {root}")
                root.mkdir(mode=0o700, parents=True, exist_ok=True)
            # mkdtemp makes the directory 0700, as a bundle's is.
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".creating", dir=root))
        except OSError as error:
            raise RecordingError(describe_os_error(error)) from error
        try:
            fd = os.open(
                staging / TRACE_FILE_NAME,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                0o600,
            )
        except OSError as error:
            _remove_bundle(staging)
            raise RecordingError(describe_os_error(error, root / name)) from error
        # Before the bundle has its name: no reader ever sees it without its writer's lock.
        lock_for_writing(fd)
        writer = cls(root / name, fd, trace_id or uuid.uuid4().hex, created_at)
        header = record_pb2.Header(
            format_version=FORMAT_VERSION,
            trace_id=writer.trace_id,
            thread_id=thread_id,
            producer_name=producer_name,
            producer_version=producer_version,
        )
        header.created_at.FromDatetime(created_at)
        try:
            writer.append(record_pb2.TraceRecord(header=header))
            # A directory of that name with anything in it is never replaced (ENOTEMPTY).
            os.rename(staging, writer.bundle_dir)
        except (RecordingError, OSError) as error:
            writer.abandon()
            _remove_bundle(staging)
            if isinstance(error, RecordingError):
                raise
            raise RecordingError(describe_os_error(error, writer.bundle_dir)) from error
        return writer

    def append(self, record: record_pb2.TraceRecord) -> int:
        """Fill in seq and time, write the record as one frame, and return its seq."""
        self._check_open()
        seq = self.record_count + 1
        record.seq = seq
        record.time_us = self._time_us()
        self._write(encode_record(record), seq)
        return seq

    def append_text_delta(self, call: int, item: int, delta: str, kind: int) -> int:
        """append(TraceRecord(output_text_delta=OutputTextDelta(call=call, item=item,
        delta=delta, kind=kind))) without the message: the same frame, encoded by hand, for
        the record written once per provider read. call and item are uint32s and kind a
        DeltaKind; anything else goes through append, which says what is wrong with it."""
        if not (0 <= call <= _UINT32_MAX and 0 <= item <= _UINT32_MAX and kind in _DELTA_KINDS):
            body = record_pb2.OutputTextDelta(
                call=call, item=item, delta=delta, kind=record_pb2.DeltaKind.ValueType(kind)
            )
            return self.append(record_pb2.TraceRecord(output_text_delta=body))
        # _check_open, _time_us and _wrote inline: this runs once per provider read, and in a
        # server each Python call it makes costs what it costs cold (P3).
        if self.failed or self.closed:
            self._check_open()  # raises
        seq = self.record_count + 1
        time_us = (time.monotonic_ns() - self._started_ns) // 1000
        if _write_text_delta is None or len(delta) > _COMPILED_DELTA_CHARS:
            self._write(encode_text_delta(seq, time_us, call, item, delta.encode(), kind), seq)
            return seq
        # Framed and written in one C call.
        try:
            written, size = _write_text_delta(self._fd, seq, time_us, call, item, delta, kind)
        except OSError as error:
            self._fail()
            raise RecordingError(describe_os_error(error)) from error
        if written != size:
            self._wrote(written, size, seq)  # raises
        self.record_count = seq
        self.bytes_written += written
        return seq

    def _check_open(self) -> None:
        if self.failed or self.closed:
            state = "failed" if self.failed else "closed"
            raise RecordingError(f"the recording is {state}: {self.file_path}")

    def _time_us(self) -> int:
        return (time.monotonic_ns() - self._started_ns) // 1000

    def _write(self, frame: bytes, seq: int) -> None:
        """Write one frame in one write(); it is record `seq`."""
        try:
            written = os.write(self._fd, frame)
        except OSError as error:
            self._fail()
            raise RecordingError(describe_os_error(error)) from error
        self._wrote(written, len(frame), seq)

    def _wrote(self, written: int, size: int, seq: int) -> None:
        """Account for record `seq`, a frame of `size` bytes of which write() took `written`."""
        if written != size:
            # A short write leaves a torn frame; appending after it would hide the damage.
            self._fail()
            raise RecordingError(f"short write ({written} of {size} bytes): {self.file_path}")
        self.record_count = seq
        self.bytes_written += written

    def put_payload(
        self,
        data: bytes,
        kind: record_pb2.PayloadKind.ValueType,
        media_type: str = "application/json",
    ) -> str:
        """Write data as a payload unless this bundle already has it; return its id."""
        pid = payload_id(data)
        if pid in self._payloads:
            return pid
        if len(data) <= _CHUNK_BYTES:
            self.append(
                record_pb2.TraceRecord(
                    payload=record_pb2.Payload(
                        payload_id=pid, kind=kind, media_type=media_type, data=data
                    )
                )
            )
        else:
            count = -(-len(data) // _CHUNK_BYTES)
            for index in range(count):
                chunk = data[index * _CHUNK_BYTES : (index + 1) * _CHUNK_BYTES]
                payload = record_pb2.Payload(
                    payload_id=pid,
                    kind=kind,
                    media_type=media_type,
                    data=chunk,
                    chunk_index=index,
                    chunk_count=count,
                )
                self.append(record_pb2.TraceRecord(payload=payload))
        self._payloads.add(pid)
        return pid

    def inherit_payloads(self, payload_ids: set[str] | frozenset[str]) -> None:
        """Payloads another bundle already holds (a fork's parent): referred to, not written.

        A reader resolves them from that bundle; `ThreadForked.parent_bundle` names it.
        """
        self._payloads.update(payload_ids)

    @property
    def payload_ids(self) -> frozenset[str]:
        """The payloads this bundle holds or refers to its parent for."""
        return frozenset(self._payloads)

    def sync(self) -> None:
        """Make everything written so far durable."""
        if self.failed or self.closed:
            return
        try:
            os.fsync(self._fd)
            links = os.fstat(self._fd).st_nlink
        except OSError as error:
            self._fail()
            raise RecordingError(describe_os_error(error)) from error
        if links == 0:
            # Writes to a removed file still succeed, into a file nobody can open: say so
            # instead of recording into the void.
            self._fail()
            raise RecordingError(f"the bundle file was removed: {self.file_path}")
        if not self._entry_synced:
            # The bundle's name is durable once the root's entry for it is; where a file system
            # cannot sync a directory, the records themselves still are.
            with contextlib.suppress(OSError):
                _sync_directory(self.bundle_dir.parent)
            self._entry_synced = True

    def close(self) -> None:
        """Write the footer, fsync and close; after a failure only release the file."""
        if self.closed:
            return
        try:
            if not self.failed:
                footer = record_pb2.Footer(record_count=self.record_count + 1)
                self.append(record_pb2.TraceRecord(footer=footer))
                self.sync()
        finally:
            self._release()

    def abandon(self) -> None:
        """Close the file without a footer, as a killed writer would leave it."""
        self._release()

    def discard(self) -> None:
        """Close and remove the bundle: for a recording that never got going."""
        self._release()
        _remove_bundle(self.bundle_dir)

    def _fail(self) -> None:
        self.failed = True
        # Nothing more is written: a reader following the bundle stops waiting for it.
        release_writing_lock(self._fd)

    def _release(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)


def _remove_bundle(directory: Path) -> None:
    """Remove a bundle directory this writer made: its trace file, then the directory."""
    with contextlib.suppress(OSError):
        (directory / TRACE_FILE_NAME).unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
