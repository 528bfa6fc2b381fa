"""Stored threads: what a thread left under a trace root, to continue it (fork, resume) or
list it when no server holds it any more."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2, record_pb2, state_pb2

from ..bundle._confine import BundleRoot
from ..bundle._discover import thread_bundles, walk_bundles
from ..bundle._errors import BundleError, BundleNotFoundError, OutsideRootError, ReductionError
from ..bundle._payloads import payload_json
from ..bundle._reader import BundleReader
from ._forks import BundleForkResolver
from ._parents import ParentBundle

__all__ = [
    "RecordedSummary",
    "StoredThread",
    "TurnNotEndedError",
    "TurnNotRecordedError",
    "list_recorded",
    "load_recorded",
]

_RUNNING = common_pb2.EXECUTION_STATUS_RUNNING


class TurnNotRecordedError(BundleError):
    """The recorded thread has no turn with that id."""

    def __init__(self, message: str, turn_id: str) -> None:
        super().__init__(message)
        self.turn_id = turn_id


class TurnNotEndedError(TurnNotRecordedError):
    """The turn was still running when its recording stopped."""


def _bundle_names(root: Path) -> list[str]:
    """The bundle directories directly under root, oldest first (the one walk's rules)."""
    try:
        return [found.name for found in walk_bundles(root, recursive=False)]
    except OSError:
        return []


@dataclass(frozen=True)
class StoredThread:
    """A bundle's thread, reduced with every payload its history needs."""

    bundle_dir: Path
    bundle: ParentBundle

    @property
    def trace(self) -> state_pb2.RolloutTrace:
        return self.bundle.trace

    @property
    def thread_id(self) -> str:
        return self.trace.root_thread_id

    @property
    def thread(self) -> state_pb2.Thread:
        return self.trace.threads[self.thread_id]

    def payload_ids(self) -> frozenset[str]:
        """What a bundle continuing this one may refer to rather than copy."""
        return self.bundle.payload_ids()

    def instructions(self) -> str:
        pid = self.thread.instructions_payload_id
        data = self.bundle.payload(pid) if pid else None
        return data.decode("utf-8", "replace") if data is not None else ""

    def continue_after(self, after_turn_id: str) -> tuple[str, int, list[dict[str, Any]]]:
        """(the turn continued after, how many turns that shares, the history as of its end).

        Empty after_turn_id: the last turn that ended. Raises TurnNotRecordedError or
        TurnNotEndedError."""
        turn_ids = list(self.thread.turn_ids)
        turns = self.trace.turns
        if not after_turn_id:
            ended = [t for t in turn_ids if turns[t].execution.status != _RUNNING]
            after_turn_id = ended[-1] if ended else ""
        elif after_turn_id not in turns:
            raise TurnNotRecordedError(
                f"thread {self.thread_id!r} has no turn {after_turn_id!r}", after_turn_id
            )
        elif turns[after_turn_id].execution.status == _RUNNING:
            raise TurnNotEndedError(
                f"turn {after_turn_id!r} had not ended when its recording stopped", after_turn_id
            )
        shared = turn_ids.index(after_turn_id) + 1 if after_turn_id else 0
        # The thread's items come in first-seen order and each turn adds to the end: the
        # history after a turn is the items of that turn and those before it (a fork's
        # inherited prefix, whose turns are its parent's, included).
        later = set(turn_ids[shared:])
        history: list[dict[str, Any]] = []
        for item_id in self.thread.conversation_item_ids:
            item = self.trace.conversation_items[item_id]
            if item.turn_id in later:
                break
            data = self.bundle.payload(item.payload_id)
            if data is None:
                raise BundleError(
                    f"payload {item.payload_id} of item {item_id} is not in the bundle or its "
                    "parents"
                )
            try:
                history.append(payload_json(data))
            except ValueError as error:
                # Not JSON, or nested past what json reads (was: RecursionError, an internal
                # error of whatever resumed or forked the thread).
                raise BundleError(
                    f"payload {item.payload_id} of item {item_id} cannot be read: {error}"
                ) from error
        return after_turn_id, shared, history

    def last_request(self) -> tuple[dict[str, Any], str]:
        """The envelope of the thread's latest request (tools, sampling, token capture) and
        its policy version; empty when it made none."""
        calls = [
            self.trace.inference_calls[call_id]
            for turn_id in self.thread.turn_ids
            for call_id in self.trace.turns[turn_id].inference_call_ids
        ]
        for call in reversed(calls):
            data = self.bundle.payload(call.request_envelope_payload_id)
            if data is not None:
                try:
                    envelope = payload_json(data)
                except ValueError:
                    # An envelope that cannot be read is none: the next older call's is taken.
                    continue
                if isinstance(envelope, dict):
                    return envelope, call.policy_version
        return {}, ""


def _open(root: BundleRoot, name: str) -> tuple[BundleReader, Path]:
    confined = root.open(name)
    # Only the trace file is read after this; the directory's descriptor is not needed.
    confined.release_directory()
    return confined.reader(), Path(confined.display_dir)


def load_recorded(root: Path, *, thread_id: str = "", bundle_path: str = "") -> StoredThread:
    """Reduce a thread's bundle under root: named by bundle_path (relative to root or absolute
    through it, never through a symlink, directly under root so that the bundles continuing
    it find it beside them), else found by thread_id.

    Raises BundleNotFoundError, OutsideRootError, BundlePathError, NotABundleError,
    BundleError (unreadable, or a different thread than thread_id) or ReductionError."""
    confined_root = BundleRoot(root)
    if bundle_path:
        name = bundle_path
    else:
        found = thread_bundles(root, thread_id)
        if not found:
            raise BundleNotFoundError(f"no recorded thread {thread_id!r} under the trace root")
        name = found[-1].name
    reader, bundle_dir = _open(confined_root, name)
    with reader:
        if bundle_dir.parent != Path(confined_root.path):
            raise OutsideRootError(
                f"bundle path {bundle_path!r} is not a bundle directly under the trace root"
            )
        resolver = BundleForkResolver(bundle_dir, every_payload=True)
        try:
            bundle = resolver.reduce_whole(reader)
        except OSError as error:
            raise BundleError(f"cannot read bundle {name!r}: {error.strerror or error}") from error
    if bundle.trace.integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT:
        raise BundleError(
            f"bundle {name!r} is corrupt ({bundle.trace.integrity.detail}); it cannot be continued"
        )
    recorded = StoredThread(bundle_dir, bundle)
    if not recorded.trace.root_thread_id or recorded.thread_id not in recorded.trace.threads:
        raise BundleError(f"bundle {name!r} records no thread")
    if thread_id and recorded.thread_id != thread_id:
        raise BundleError(
            f"bundle {name!r} records thread {recorded.thread_id!r}, not {thread_id!r}"
        )
    return recorded


@dataclass(frozen=True)
class RecordedSummary:
    """What a bundle's first records say about its thread (no full read)."""

    bundle_name: str
    bundle_dir: Path
    thread_id: str
    model: str
    created_at: datetime
    metadata: Mapping[str, str] = field(default_factory=dict)
    fork: record_pb2.ThreadForked | None = None


def _summary(root: BundleRoot, name: str) -> RecordedSummary | None:
    try:
        reader, bundle_dir = _open(root, name)
    except BundleError:
        return None
    header: record_pb2.Header | None = None
    fork: record_pb2.ThreadForked | None = None
    try:
        with reader:
            for record in reader:
                body = record.WhichOneof("body")
                if body == "header":
                    header = record.header
                elif body == "thread_forked":
                    fork = record.thread_forked
                elif body == "thread_started" and header is not None:
                    started = record.thread_started
                    try:
                        created_at = header.created_at.ToDatetime(UTC)
                    except (ValueError, OverflowError):
                        # A time outside the years 1-9999 (the reducer's RECORD_OUT_OF_RANGE):
                        # one such bundle failed every ListThreads with INTERNAL.
                        return None
                    return RecordedSummary(
                        bundle_name=name,
                        bundle_dir=bundle_dir,
                        thread_id=header.thread_id,
                        model=started.model,
                        created_at=created_at,
                        metadata=dict(started.metadata),
                        fork=fork,
                    )
                elif body != "payload":
                    break
    except (BundleError, ReductionError, OSError):
        return None
    return None


def list_recorded(
    root: Path, *, after: str = "", skip: frozenset[str] = frozenset()
) -> Iterator[RecordedSummary]:
    """The threads recorded directly under root, by bundle name after `after`, oldest first;
    bundles that cannot be read, and threads in `skip`, are left out."""
    confined = BundleRoot(root)
    for name in _bundle_names(root):
        if name <= after:
            continue
        summary = _summary(confined, name)
        if summary is not None and summary.thread_id not in skip:
            yield summary
