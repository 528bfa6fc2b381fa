"""BundleForkResolver: finds a fork's parent bundle beside it or among those given, and
reduces it once (through the one pass), for the reducer to ask through ForkResolver."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from rollout.trace.v1 import record_pb2

from ..bundle._errors import BundleError, ReductionError
from ..bundle._layout import TRACE_FILE_NAME, thread_bundles
from ..bundle._payloads import PayloadStore
from ..bundle._reader import BundleReader, read_bundle, resolve_trace_file
from ._parents import ParentBundle
from ._pass import keeping_payloads, reduce_reader


def is_bundle_name(name: str) -> bool:
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
            if is_bundle_name(forked.parent_bundle):
                candidate = root / forked.parent_bundle
                if (candidate / TRACE_FILE_NAME).is_file():
                    return candidate
            found = thread_bundles(root, wanted)
            if found:
                return found[0]
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

    def _open(self, path: Path) -> BundleReader:
        """The parent's records; a resolver over another store opens them there."""
        return read_bundle(path)

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
                with self._open(path) as reader:
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
        # Every payload: a fork may share any part of its parent's history.
        payloads = PayloadStore(budget=None)
        reduced = reduce_reader(
            reader, forks=self, rewards=None, on_record=keeping_payloads(payloads)
        )
        return ParentBundle(reader.bundle_dir, reduced.trace, payloads, reduced.parent)
