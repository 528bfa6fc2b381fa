"""Rewards after the fact: the bundle's rewards.binpb sidecar (the trace's framing and CRC
rule, appended under a lock, fsynced before it is acknowledged) and the rewards in a state."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import record_pb2, state_pb2

from ._confine import open_regular_file, sidecar_problem
from ._errors import RewardError, describe_os_error
from ._framing import encode_record
from ._layout import REWARDS_FILE_NAME
from ._reader import CLEAN, CORRUPT, TRUNCATED, UNCLOSED, FrameDecoder
from ._version import __version__

MAX_NAME_CHARS = 128
MAX_SOURCE_CHARS = 1024
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
_READ_BYTES = 1 << 16


@dataclass(frozen=True)
class RewardInput:
    """One reward as a client gives it."""

    thread_id: str
    name: str
    value: float
    turn_id: str = ""
    item_id: str = ""
    weight: float = 0.0
    source: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    recorded_by: str = ""


def weighted_mean(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The weighted mean of finite (value, weight) pairs, without overflowing on the way
    (two rewards of 1.5e308 average 1.5e308): values and weights are scaled to at most 1
    first. None when the weights cancel out."""
    if not pairs:
        return None
    scale = max(abs(value) for value, _ in pairs) or 1.0
    weight_scale = max(abs(weight) for _, weight in pairs) or 1.0
    weights = math.fsum(weight / weight_scale for _, weight in pairs)
    if not weights:
        return None
    total = math.fsum((value / scale) * (weight / weight_scale) for value, weight in pairs)
    mean = total / weights * scale
    if math.isnan(mean):
        return None
    return max(-sys.float_info.max, min(sys.float_info.max, mean))


def mean_reward(rewards: Iterable[state_pb2.Reward]) -> float | None:
    """A rollout's reward as export-rl's samples and reduce-all's tables give it: the weighted
    mean of its finite rewards (a weight of 0 counts as 1); None without any."""
    pairs = []
    for reward in rewards:
        weight = reward.weight or 1.0
        if math.isfinite(reward.value) and math.isfinite(weight):
            pairs.append((reward.value, weight))
    return weighted_mean(pairs)


def check_reward(reward: RewardInput) -> None:
    """Refuse what no trainer can use: no name, a value or weight that is not a finite number,
    an item without its turn, oversized text. Raises RewardError."""
    if not reward.name or len(reward.name) > MAX_NAME_CHARS or not reward.name.isprintable():
        raise RewardError(
            f"name must be 1 to {MAX_NAME_CHARS} printable characters", "INVALID_REWARD_NAME"
        )
    for what, number in (("value", reward.value), ("weight", reward.weight)):
        if not math.isfinite(number):
            raise RewardError(
                f"{what} must be a finite number, not {number}", "INVALID_REWARD_VALUE"
            )
    if len(reward.source) > MAX_SOURCE_CHARS:
        raise RewardError(
            f"source is limited to {MAX_SOURCE_CHARS} characters", "INVALID_REWARD_SOURCE"
        )
    if len(reward.metadata) > MAX_METADATA_ENTRIES or any(
        len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS
        for key, value in reward.metadata.items()
    ):
        raise RewardError(
            f"metadata holds at most {MAX_METADATA_ENTRIES} entries, keys of "
            f"{MAX_METADATA_KEY_CHARS} and values of {MAX_METADATA_VALUE_CHARS} characters",
            "METADATA_TOO_LARGE",
        )


def _record(reward: RewardInput) -> record_pb2.RewardRecorded:
    recorded = record_pb2.RewardRecorded(
        thread_id=reward.thread_id,
        turn_id=reward.turn_id,
        item_id=reward.item_id,
        name=reward.name,
        value=reward.value,
        weight=reward.weight,
        source=reward.source,
        metadata=dict(reward.metadata),
        recorded_by=reward.recorded_by,
    )
    recorded.recorded_at.FromDatetime(datetime.now(UTC))
    return recorded


@dataclass
class _Tail:
    """How far this process has read one sidecar: each append then reads only what was
    written since (by it or another writer), so N appends cost O(N), not O(N^2)."""

    first_frame: bytes
    # Bytes fed to the decoder so far.
    size: int
    decoder: FrameDecoder
    header: record_pb2.Header | None
    # The file's size and modification time once this process last wrote it.
    left: tuple[int, int] = (0, 0)


# The sidecars this process appended to lately, by (device, inode). One that only grew since
# (another writer appended) is read from where this process left off; one rewritten in place
# (changed without growing, shrunk, or under another first frame) is read again whole.
_TAILS: OrderedDict[tuple[int, int], _Tail] = OrderedDict()
_MAX_TAILS = 1024


def _tail_of(fd: int) -> _Tail:
    """What the sidecar behind fd holds, read from where this process left off."""
    status = os.fstat(fd)
    key = (status.st_dev, status.st_ino)
    tail = _TAILS.pop(key, None)
    if tail is not None and (
        status.st_size < tail.left[0]
        or (status.st_size == tail.left[0] and status.st_mtime_ns != tail.left[1])
        or os.pread(fd, len(tail.first_frame), 0) != tail.first_frame
    ):
        tail = None
    if tail is None:
        tail = _Tail(b"", 0, FrameDecoder(), None)
    offset = tail.size
    while chunk := os.pread(fd, _READ_BYTES, offset):
        records = tail.decoder.feed(chunk)
        if tail.header is None and records and records[0].WhichOneof("body") == "header":
            tail.header = records[0].header
        offset += len(chunk)
    tail.size = offset
    if not tail.first_frame and offset:
        tail.first_frame = os.pread(fd, min(offset, 64), 0)
    _TAILS[key] = tail
    while len(_TAILS) > _MAX_TAILS:
        _TAILS.popitem(last=False)
    return tail


def _left_as(fd: int, tail: _Tail) -> None:
    status = os.fstat(fd)
    tail.left = (status.st_size, status.st_mtime_ns)


def _forget_tail(fd: int) -> None:
    status = os.fstat(fd)
    _TAILS.pop((status.st_dev, status.st_ino), None)


def append_reward(
    bundle_dir: Path, reward: RewardInput, *, trace_id: str, dir_fd: int | None = None
) -> int:
    """Append one reward to `<bundle_dir>/rewards.binpb` and fsync it; return its seq.

    The file is created with its own header on first use, and opened as the trace is: never
    through a symbolic link, never a FIFO or anything but a regular file; through dir_fd, the
    bundle directory's descriptor, when given (bundle_dir then only names it in messages).
    Writers (the agent, the CLI) take an exclusive lock, so their records never interleave. A
    torn last frame (a writer died mid-append, before it acknowledged anything) is cut off
    first; a corrupt file, or one that does not begin with a whole header (no sidecar at all),
    is refused, never appended to. Raises RewardError.
    """
    path = bundle_dir / REWARDS_FILE_NAME
    try:
        fd = open_regular_file(
            REWARDS_FILE_NAME if dir_fd is not None else path,
            os.O_RDWR | os.O_CREAT | os.O_APPEND,
            dir_fd=dir_fd,
        )
    except OSError as error:
        raise RewardError(
            f"cannot record rewards: {sidecar_problem(error, str(path))}", "REWARDS_UNWRITABLE"
        ) from error
    # The file's size before this append's own bytes: what a failed write is cut back to.
    before: int | None = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tail = _tail_of(fd)
        integrity = tail.decoder.finish()
        header = tail.header
        if integrity.status == CORRUPT:
            raise RewardError(
                f"{path} is corrupt, not appending to it: {integrity.detail}", "REWARDS_CORRUPT"
            )
        if header is None and tail.size:
            # Not a sidecar a writer of ours began: its header is the first frame, written
            # whole before any reward. Cutting a "torn tail" here would wipe someone's file.
            raise RewardError(
                f"{path} is not a rewards sidecar (it does not begin with a whole header "
                "frame), not appending to it",
                "REWARDS_CORRUPT",
            )
        if integrity.status == TRUNCATED:
            os.ftruncate(fd, integrity.bytes_read)
            # Read again from the start next time: the decoder holds the torn frame.
            _forget_tail(fd)
        before = os.fstat(fd).st_size
        if header is not None and header.thread_id != reward.thread_id:
            raise RewardError(
                f"{path} holds the rewards of thread {header.thread_id!r}, not "
                f"{reward.thread_id!r}",
                "REWARDS_CORRUPT",
            )
        if header is None:
            header = record_pb2.Header(
                format_version=1,
                trace_id=trace_id,
                thread_id=reward.thread_id,
                producer_name="rollout-trace rewards",
                producer_version=__version__,
            )
            header.created_at.FromDatetime(datetime.now(UTC))
            _write(fd, record_pb2.TraceRecord(seq=1, header=header))
            seq = 2
        else:
            seq = integrity.records_read + 1
        base_us = header.created_at.seconds * 1_000_000 + header.created_at.nanos // 1000
        record = record_pb2.TraceRecord(
            seq=seq,
            time_us=max(0, time.time_ns() // 1000 - base_us),
            reward_recorded=_record(reward),
        )
        _write(fd, record)
        os.fsync(fd)
        _left_as(fd, tail)
        return seq
    except OSError as error:
        if before is not None:
            # A write cut short (a full disk, a quota) leaves no torn frame behind: a torn
            # header would have every later append refused ("not a rewards sidecar").
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
        _forget_tail(fd)
        raise RewardError(describe_os_error(error, path), "REWARDS_UNWRITABLE") from error
    finally:
        os.close(fd)


def _write(fd: int, record: record_pb2.TraceRecord) -> None:
    frame = encode_record(record)
    written = os.write(fd, frame)
    if written != len(frame):
        raise OSError(f"short write ({written} of {len(frame)} bytes)")


@dataclass(frozen=True)
class RewardFile:
    """What a bundle's rewards.binpb holds, up to any damage."""

    rewards: list[tuple[int, record_pb2.RewardRecorded]]
    problem: str


def read_rewards(bundle_dir: Path, *, dir_fd: int | None = None) -> RewardFile:
    """The rewards of a bundle (none when it has no sidecar); a damaged sidecar gives the
    rewards before the damage and says why in `problem`, and one that is a symbolic link or
    no regular file (a FIFO) is not read at all. dir_fd: the bundle directory's descriptor,
    to open the sidecar relative to rather than by path."""
    path = bundle_dir / REWARDS_FILE_NAME
    try:
        fd = open_regular_file(
            REWARDS_FILE_NAME if dir_fd is not None else path, os.O_RDONLY, dir_fd=dir_fd
        )
        with os.fdopen(fd, "rb") as source:
            data = source.read()
    except FileNotFoundError:
        return RewardFile([], "")
    except OSError as error:
        return RewardFile([], sidecar_problem(error, REWARDS_FILE_NAME))
    return decode_rewards(data)


def decode_rewards(data: bytes) -> RewardFile:
    """The rewards in a rewards.binpb's bytes, up to any damage (said in `problem`)."""
    decoder = FrameDecoder()
    records = decoder.feed(data)
    integrity = decoder.finish()
    rewards = []
    problem = ""
    for record in records:
        if record.WhichOneof("body") != "reward_recorded":
            continue
        recorded = record.reward_recorded
        if not _holdable(recorded.recorded_at):
            # No state could show it (proto3 JSON refused it: `reduce` exited 1 with an
            # internal error): damage, the rewards before it kept.
            problem = (
                f"{REWARDS_FILE_NAME}: seq {record.seq}: recorded_at is "
                f"{recorded.recorded_at.seconds} s from 1970, outside the years 1-9999 a "
                "timestamp can hold"
            )
            break
        rewards.append((record.seq, recorded))
    if not problem and integrity.status not in (CLEAN, UNCLOSED) and data:
        problem = f"{REWARDS_FILE_NAME}: {integrity.detail}"
    return RewardFile(rewards, problem)


# What a Timestamp may hold: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
_MIN_SECONDS = -62_135_596_800
_MAX_SECONDS = 253_402_300_799


def _holdable(stamp: timestamp_pb2.Timestamp) -> bool:
    return _MIN_SECONDS <= stamp.seconds <= _MAX_SECONDS and 0 <= stamp.nanos < 1_000_000_000


def _find_item(trace: state_pb2.RolloutTrace, target: state_pb2.RewardTarget) -> str:
    for item_id, item in _items_of(trace, target.thread_id):
        if item.responses_item_id == target.item_id and (
            not target.turn_id or item.turn_id == target.turn_id
        ):
            return item_id
    return ""


def _items_of(
    trace: state_pb2.RolloutTrace, thread_id: str
) -> Iterator[tuple[str, state_pb2.ConversationItem]]:
    thread = trace.threads.get(thread_id)
    if thread is None:
        return
    for item_id in thread.conversation_item_ids:
        yield item_id, trace.conversation_items[item_id]


def attach_rewards(
    trace: state_pb2.RolloutTrace, bundle_dir: Path, *, dir_fd: int | None = None
) -> None:
    """Add the bundle's rewards to its reduced state, each with the target it resolves to."""
    add_rewards(trace, read_rewards(bundle_dir, dir_fd=dir_fd))


def add_rewards(trace: state_pb2.RolloutTrace, found: RewardFile) -> None:
    """Add rewards read from a sidecar to a reduced state, each with the target it resolves
    to; a damaged sidecar's problem joins the state's integrity detail."""
    for seq, recorded in found.rewards:
        reward = trace.rewards.add(
            name=recorded.name,
            value=recorded.value,
            weight=recorded.weight,
            source=recorded.source,
            recorded_by=recorded.recorded_by,
            seq=seq,
        )
        reward.metadata.update(recorded.metadata)
        reward.recorded_at.CopyFrom(recorded.recorded_at)
        target = reward.target
        target.thread_id = recorded.thread_id
        target.turn_id = recorded.turn_id
        target.item_id = recorded.item_id
        found_thread = recorded.thread_id in trace.threads
        found_turn = not recorded.turn_id or (
            recorded.turn_id in trace.turns
            and trace.turns[recorded.turn_id].thread_id == recorded.thread_id
        )
        if recorded.item_id:
            target.conversation_item_id = _find_item(trace, target)
        target.found = (
            found_thread
            and found_turn
            and (not recorded.item_id or bool(target.conversation_item_id))
        )
    if found.problem:
        integrity = trace.integrity
        integrity.detail = (
            f"{integrity.detail}; {found.problem}" if integrity.detail else found.problem
        )
