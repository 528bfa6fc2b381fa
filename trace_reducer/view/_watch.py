"""Following a bundle while it is written: its reduced state each time new records arrive."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from rollout.trace.v1 import state_pb2

from ..bundle._liveness import LIVE_WINDOW, being_written, writer_holds
from ..bundle._reader import TRUNCATED, UNCLOSED, FrameDecoder, Integrity
from ..bundle._rewards import read_rewards
from ..reduce._forks import BundleForkResolver
from ..reduce._parents import ForkResolver
from ..reduce._pass import settle
from ..reduce._reducer import Reducer

# The file is followed by polling its size: portable, and at this pace costs nothing measurable.
POLL_INTERVAL = 0.05
# Updates are coalesced to at most ten a second.
MIN_UPDATE_INTERVAL = 0.1
# A backlog (watching a long bundle from its start) is read and reduced this much at a time.
_READ_BYTES = 1 << 20
# Building a large state takes a while: updates never take more than about a fifth of the time.
_UPDATE_COST_FACTOR = 4.0
# While nothing arrives, whether the writer is still there is asked this often.
WRITER_CHECK_INTERVAL = 1.0
# Every record starts with seq (field 1, varint): tag 0x08, and the header's seq is 1.
_HEADER_START = b"\x08\x01"
_HEAD_BYTES = 16
_T = TypeVar("_T")


@dataclass(frozen=True)
class WatchUpdate:
    """The reduced state of every record read so far."""

    trace: state_pb2.RolloutTrace
    records_read: int
    final: bool
    """No update follows: the footer was read (CLEAN), the bundle is damaged (CORRUPT), or its
    writer is gone without closing it (UNCLOSED or TRUNCATED, the integrity's detail says so)."""


class _Follower:
    """The decoding half, run in a worker thread one step at a time."""

    def __init__(
        self,
        trace_file: Path | BinaryIO,
        bundle_dir: Path | None,
        rewards_dir_fd: int | None,
        forks: ForkResolver | None = None,
    ) -> None:
        # A file already open (the service opens it under its root) is read as it is.
        if isinstance(trace_file, Path):
            self.source: BinaryIO = trace_file.open("rb", buffering=0)
            bundle_dir = bundle_dir or trace_file.parent
        else:
            self.source = trace_file
        self.bundle_dir = bundle_dir
        self.rewards_dir_fd = rewards_dir_fd
        self.decoder = FrameDecoder()
        # A fork's parent is read from beside it, as replay_bundle does (or as `forks` finds it).
        self.reducer = Reducer(forks=forks or BundleForkResolver(bundle_dir))
        self.position = 0
        self.head = b""
        self.final = False
        # Set when the writer went away without a footer: nothing more will come.
        self.writer_gone = ""

    def grew(self) -> bool:
        return os.fstat(self.source.fileno()).st_size > self.position

    def read(self) -> int:
        """Read and reduce what the file holds now; return how many records completed."""
        data = self.source.read(_READ_BYTES)
        if not data:
            return 0
        self.position += len(data)
        if len(self.head) < _HEAD_BYTES:
            self.head = (self.head + data)[:_HEAD_BYTES]
        records = self.decoder.feed(data)
        self.reducer.apply_many(records)
        if records and records[-1].WhichOneof("body") == "footer":
            self.final = True
        else:
            self.final = _over(self.decoder.finish(), self.head)
        return len(records)

    def check_writer(self, window: float) -> None:
        """End the watch when no writer holds the file and it has not changed for `window`
        seconds (bundle.being_written's rule); called only while the file is not growing."""
        fd = self.source.fileno()
        holds = writer_holds(fd)
        if being_written(holds, os.fstat(fd).st_mtime, time.time(), window):
            return
        if holds is False:
            self.writer_gone = "no writer holds it open"
        else:
            self.writer_gone = f"unchanged for {window:g} s and no lock tells of a writer"
        self.final = True

    def update(self) -> WatchUpdate:
        integrity = self.decoder.finish()
        if self.writer_gone and integrity.status in (UNCLOSED, TRUNCATED):
            ended = Integrity()
            ended.CopyFrom(integrity)
            ended.detail = (
                f"{integrity.detail}: the recording stopped without completing ({self.writer_gone})"
            )
            integrity = ended
        elif not self.final:
            # A frame still being written is awaited, not reported as a torn tail.
            integrity = Integrity(
                status=UNCLOSED,
                records_read=integrity.records_read,
                bytes_read=integrity.bad_frame_offset or integrity.bytes_read,
                detail="being written: no footer yet",
            )
        # The final state is replay_bundle's: with the rewards recorded beside the bundle.
        rewards = None
        if self.final and self.bundle_dir is not None:
            rewards = read_rewards(self.bundle_dir, dir_fd=self.rewards_dir_fd)
        trace = settle(self.reducer, integrity, rewards)
        return WatchUpdate(trace, integrity.records_read, self.final)


def _over(integrity: Integrity, head: bytes) -> bool:
    """Whether nothing more can be read; a torn tail is a frame still being written."""
    if integrity.status == UNCLOSED:
        return False
    if integrity.status != TRUNCATED:
        return True  # CORRUPT: the decoder reads nothing past a bad frame
    if integrity.records_read:
        return False
    # No header yet: wait for it, unless the bytes cannot be the start of one.
    return not _could_start_header(head)


def _could_start_header(head: bytes) -> bool:
    start = 0
    while start < len(head) and head[start] & 0x80:
        start += 1
    rest = head[start + 1 : start + 1 + len(_HEADER_START)]
    return _HEADER_START.startswith(rest)


async def follow_bundle(
    trace_file: str | os.PathLike[str] | BinaryIO,
    bundle_dir: Path | None = None,
    /,
    *,
    poll_interval: float = POLL_INTERVAL,
    min_interval: float = MIN_UPDATE_INTERVAL,
    rewards_dir_fd: int | None = None,
    live_window: float = LIVE_WINDOW,
    forks: ForkResolver | None = None,
) -> AsyncGenerator[WatchUpdate, None]:
    """Updates of a bundle's reduced state as its trace.binpb grows, until the footer.

    Reads each byte once (a push decoder and the incremental reducer), so a long recording
    costs what its new records cost. The last update has `final` set: after the footer (CLEAN),
    at the first bad frame (CORRUPT), or once the bundle is no longer being written
    (bundle.being_written: no writer holds its lock and nothing changed for `live_window`
    seconds), its integrity UNCLOSED or TRUNCATED. Raises
    ReductionError when records contradict each other, OSError when the file cannot be read.
    trace_file may be a file already open (then bundle_dir says where a fork's parent is looked
    for, and rewards_dir_fd, if given, the descriptor of that directory the final state's
    rewards are read through, and forks, if given, how a fork's parent is found).
    """
    source = Path(trace_file) if isinstance(trace_file, str | os.PathLike) else trace_file
    follower = await asyncio.to_thread(_Follower, source, bundle_dir, rewards_dir_fd, forks)
    in_flight: asyncio.Future[Any] | None = None

    async def run(step: Callable[[], _T]) -> _T:
        # Shielded: when the caller goes away the worker finishes its step on its own.
        nonlocal in_flight
        in_flight = asyncio.ensure_future(asyncio.to_thread(step))
        result: _T = await asyncio.shield(in_flight)
        return result

    try:
        next_update = -math.inf
        pending = False
        next_writer_check = time.monotonic() + WRITER_CHECK_INTERVAL
        while True:
            if follower.grew():
                pending = bool(await run(follower.read)) or pending
                next_writer_check = time.monotonic() + WRITER_CHECK_INTERVAL
            elif not follower.final and time.monotonic() >= next_writer_check:
                follower.check_writer(live_window)
                next_writer_check = time.monotonic() + WRITER_CHECK_INTERVAL
                if follower.final and follower.grew():
                    # The writer's last frames landed after the size was looked at.
                    follower.final = False
                    follower.writer_gone = ""
                    continue
            now = time.monotonic()
            if follower.final or (pending and now >= next_update):
                update = await run(follower.update)
                cost = time.monotonic() - now
                next_update = max(now + min_interval, now + cost * (1 + _UPDATE_COST_FACTOR))
                pending = False
                yield update
                if update.final:
                    return
            elif not follower.grew():
                wait = min(poll_interval, next_update - now) if pending else poll_interval
                await asyncio.sleep(max(wait, 0.0))
    finally:
        # A worker may still be reading: the file is closed once it is done, never under it.
        if in_flight is not None and not in_flight.done():
            in_flight.add_done_callback(lambda _: follower.source.close())
        else:
            follower.source.close()
