"""Forked threads: finding a fork's parent bundle and what the fork shares with it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rollout.trace.v1 import record_pb2, state_pb2

from ..bundle._bulk import DeltaRun
from ..bundle._errors import BundleError, ReductionError
from ..bundle._layout import TRACE_FILE_NAME
from ..bundle._payloads import PayloadError, PayloadStore
from ..bundle._reader import BundleReader, read_bundle, resolve_trace_file

if TYPE_CHECKING:
    from ._reducer import Reducer


class ParentBundle:
    """A fork's parent, reduced: its payloads (and its own parent's) and its items."""

    def __init__(
        self,
        path: Path,
        trace: state_pb2.RolloutTrace,
        payloads: PayloadStore,
        grandparent: ParentBundle | None,
    ) -> None:
        self.path = path
        self.trace = trace
        self._payloads = payloads
        self._grandparent = grandparent

    def payload(self, pid: str) -> bytes | None:
        """The bytes of payload `pid`, from this bundle or the bundles it forked from."""
        try:
            return self._payloads.get(pid)
        except PayloadError:
            return self._grandparent.payload(pid) if self._grandparent is not None else None

    def payload_ids(self) -> frozenset[str]:
        """Every payload id `payload` answers: this bundle's and its ancestors'."""
        own = self._payloads.ids()
        return own | self._grandparent.payload_ids() if self._grandparent is not None else own

    def prefix_items(self, payload_ids: Sequence[str]) -> list[state_pb2.ConversationItem | None]:
        """The parent's conversation items a fork's prefix names, in order: for each payload
        id the first of the parent's items with that payload not taken yet."""
        thread = self.trace.threads.get(self.trace.root_thread_id)
        order = list(thread.conversation_item_ids) if thread is not None else []
        by_payload: dict[str, list[str]] = {}
        for item_id in order:
            item = self.trace.conversation_items[item_id]
            by_payload.setdefault(item.payload_id, []).append(item_id)
        found: list[state_pb2.ConversationItem | None] = []
        for pid in payload_ids:
            candidates = by_payload.get(pid)
            found.append(self.trace.conversation_items[candidates.pop(0)] if candidates else None)
        return found


def fork_chain(
    forked: record_pb2.ThreadForked, parent: ParentBundle | None
) -> list[state_pb2.ForkLink]:
    """The threads a fork's history came through, its parent first: each with where it came
    from in turn (as far as the parent bundles were read)."""
    link = state_pb2.ForkLink(thread_id=forked.parent_thread_id, bundle=forked.parent_bundle)
    if parent is None or not parent.trace.HasField("fork"):
        return [link]
    origin = parent.trace.fork
    link.parent_thread_id = origin.parent_thread_id
    link.after_turn_id = origin.after_turn_id
    link.group_id = origin.group_id
    link.repetition_index = origin.repetition_index
    link.resumed = origin.resumed
    return [link, *origin.ancestors]


class ForkResolver(Protocol):
    """What the reducer asks when a bundle turns out to be a fork."""

    def resolve(self, forked: record_pb2.ThreadForked) -> ParentBundle | None:
        """The parent bundle of a fork, reduced; None when it cannot be found or read."""


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in {".", ".."}


class BundleForkResolver:
    """Finds parents beside the bundle (the same trace root) or among bundles given
    explicitly, reduces each once (and its own parent, recursively), and remembers them."""

    def __init__(self, bundle_dir: Path | None, explicit: Iterable[str | os.PathLike[str]] = ()):
        self._roots: list[Path] = [bundle_dir.parent] if bundle_dir is not None else []
        self._explicit = [Path(path) for path in explicit]
        self._explicit_ids: dict[str, Path] | None = None
        self._loaded: dict[Path, ParentBundle | None] = {}
        self._loading: set[Path] = set()

    def add_root(self, root: Path) -> None:
        """Look for parents among the bundles of `root` too."""
        if root not in self._roots:
            self._roots.append(root)

    def resolve(self, forked: record_pb2.ThreadForked) -> ParentBundle | None:
        path = self._locate(forked)
        if path is None:
            return None
        return self._load(path)

    def _locate(self, forked: record_pb2.ThreadForked) -> Path | None:
        wanted = forked.parent_thread_id
        explicit = self._explicit_by_thread().get(wanted)
        if explicit is not None:
            return explicit
        for root in self._roots:
            if _safe_name(forked.parent_bundle):
                candidate = root / forked.parent_bundle
                if (candidate / TRACE_FILE_NAME).is_file():
                    return candidate
            if _safe_name(wanted) and "*" not in wanted and "?" not in wanted:
                for candidate in sorted(root.glob(f"*-{wanted}")):
                    if (candidate / TRACE_FILE_NAME).is_file():
                        return candidate
        return None

    def _explicit_by_thread(self) -> dict[str, Path]:
        if self._explicit_ids is None:
            self._explicit_ids = {}
            for path in self._explicit:
                try:
                    with read_bundle(path) as reader:
                        for record in reader:
                            if record.WhichOneof("body") == "header":
                                self._explicit_ids[record.header.thread_id] = resolve_trace_file(
                                    path
                                ).parent
                            break
                except BundleError:
                    continue
        return self._explicit_ids

    def _load(self, path: Path) -> ParentBundle | None:
        key = path.resolve()
        if key in self._loaded:
            return self._loaded[key]
        if key in self._loading:
            # A bundle that is (through its parents) its own parent: nothing to resolve.
            return None
        self._loading.add(key)
        try:
            try:
                with read_bundle(path) as reader:
                    parent = self.reduce_whole(reader)
            except (BundleError, ReductionError, OSError):
                self._loaded[key] = None
                return None
            self._loaded[key] = parent
            return parent
        finally:
            self._loading.discard(key)

    def reduce_whole(self, reader: BundleReader) -> ParentBundle:
        """Reduce an open bundle keeping every payload (a fork may share any part of its
        history), its own parents resolved through this resolver.

        Raises BundleError, ReductionError or OSError."""
        from ._reducer import Reducer

        reducer: Reducer = Reducer(forks=self)
        payloads = PayloadStore(budget=None)
        for batch in reader.batches():
            for record in batch:
                if isinstance(record, DeltaRun):
                    continue
                if record.WhichOneof("body") == "payload":
                    try:
                        payloads.add(record.payload)
                    except PayloadError:
                        continue
            reducer.apply_many(batch)
        reducer.set_integrity(reader.integrity)
        return ParentBundle(reader.bundle_dir, reducer.state(), payloads, reducer.parent)
