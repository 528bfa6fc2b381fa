"""BundleForkResolver: finds a fork's parent bundle beside it or among those given, and
reduces it once (through the one pass), for the reducer to ask through ForkResolver."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from rollout.trace.v1 import record_pb2

from ..bundle._confine import BundleRoot, ConfinedBundle
from ..bundle._errors import BundleError, ReductionError
from ..bundle._payloads import PayloadStore
from ..bundle._reader import BundleReader, read_bundle, resolve_trace_file
from ._parents import ParentBundle
from ._pass import keeping_payloads, reduce_reader

# How many generations of parents a fork is resolved through: each is reduced once, oldest
# first (never by recursion), and held while its descendants are reduced. A fork deeper than
# this reduces with the ancestors beyond it unresolved, as if they were missing.
MAX_FORK_DEPTH = 256


def is_bundle_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in {".", ".."}


def bundles_by_thread(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Path]:
    """The bundle of each thread among these bundles, read from their headers (a path that
    is no readable bundle is passed over)."""
    found: dict[str, Path] = {}
    for path in paths:
        try:
            with read_bundle(path) as reader:
                for record in reader:
                    if record.WhichOneof("body") == "header":
                        found[record.header.thread_id] = resolve_trace_file(path).parent
                    break
        except BundleError:
            continue
    return found


class BundleForkResolver:
    """Finds parents beside the bundle (the same trace root) or among bundles given
    explicitly, reduces each once (oldest first, in a loop), and remembers them.

    A parent found beside the bundle is opened as the reducer service opens a bundle: by
    name under a root, through descriptors that never follow a symbolic link, so a link
    planted under the root never leads a reader out of it. A bundle opened under a root
    (`beside`) has its parents looked for from that root, never by its own directory's path:
    a directory on the way swapped for a symlink since leads nowhere. Parents given
    explicitly are the caller's own choice and are read as given.

    A parent keeps what the bundle itself would keep (its parsed items, and unparsed payload
    bytes up to the same budget), so a fork costs its parent's state, not its size;
    every_payload keeps all of its bytes instead, for those who rebuild request bodies.
    """

    def __init__(
        self,
        bundle_dir: Path | None,
        explicit: Iterable[str | os.PathLike[str]] = (),
        *,
        every_payload: bool = False,
        explicit_ids: Mapping[str, Path] | None = None,
    ):
        """`explicit_ids`, when given, is `bundles_by_thread(explicit)` worked out already
        (by a caller that makes many resolvers over the same bundles); it is read, never
        copied."""
        # Where parents are looked for: a root, and the directory under it ("" the root).
        self._places: list[tuple[BundleRoot, str]] = []
        if bundle_dir is not None:
            self.add_root(bundle_dir.parent)
        self._explicit = [Path(path) for path in explicit]
        self._explicit_ids: Mapping[str, Path] | None = explicit_ids
        self._every_payload = every_payload
        self._loaded: dict[Path, ParentBundle | None] = {}
        # Where each located parent was found: (a root, its path under it); None for a
        # parent given explicitly.
        self._found_in: dict[Path, tuple[BundleRoot, str] | None] = {}
        # Set while ancestors are reduced: their own parents are loaded already, or beyond
        # reach (missing, too deep, or a cycle), and are never looked for again from inside.
        self._resolving = False

    @classmethod
    def beside(cls, bundle: ConfinedBundle, *, every_payload: bool = False) -> BundleForkResolver:
        """The resolver of a bundle opened under a root (BundleRoot.open): its parents are
        looked for in the directory holding it, reached again from that root."""
        resolver = cls(None, every_payload=every_payload)
        if bundle.root is not None:
            resolver._places.append((bundle.root, bundle.beside))
        return resolver

    def add_root(self, root: Path) -> None:
        """Look for parents among the bundles of `root` too."""
        if all(Path(place.path) != Path(os.path.realpath(root)) for place, _ in self._places):
            self._places.append((BundleRoot(root), ""))

    def resolve(self, forked: record_pb2.ThreadForked) -> ParentBundle | None:
        path = self._locate(forked)
        if path is None or self._resolving:
            return self._loaded.get(path) if path is not None else None
        # The ancestors not reduced yet, nearest first, up to the first one that is no fork.
        chain: list[Path] = []
        current: Path | None = path
        while (
            current is not None
            and current not in self._loaded
            and current not in chain
            and len(chain) < MAX_FORK_DEPTH
        ):
            chain.append(current)
            body = self._forked_of(current)
            current = self._locate(body) if body is not None else None
        self._resolving = True
        try:
            for ancestor in reversed(chain):
                self._loaded[ancestor] = self._load(ancestor)
        finally:
            self._resolving = False
        return self._loaded.get(path)

    def _locate(self, forked: record_pb2.ThreadForked) -> Path | None:
        wanted = forked.parent_thread_id
        explicit = self._explicit_by_thread().get(wanted)
        if explicit is not None:
            self._found_in.setdefault(explicit, None)
            return explicit
        for root, where in self._places:
            for name in self._parent_names(root, where, forked):
                relative = os.path.join(where, name)
                candidate = Path(root.path, relative)
                if candidate in self._found_in:
                    return candidate
                try:
                    with self._open_confined(root, relative):
                        pass
                except (BundleError, OSError):
                    continue
                self._found_in[candidate] = (root, relative)
                return candidate
        return None

    @staticmethod
    def _parent_names(
        root: BundleRoot, where: str, forked: record_pb2.ThreadForked
    ) -> Iterator[str]:
        """Where the parent may be in `where` under root: the bundle the fork names, then (only
        when that is not there) every bundle of the parent's thread. Lazily: listing the
        directory reads its every entry, and doing it for every fork made reducing a root of
        N forks (reduce-all, view ROOT, list) cost N times the root's size."""
        if is_bundle_name(forked.parent_bundle):
            yield forked.parent_bundle
        yield from BundleForkResolver._thread_bundles(root, where, forked.parent_thread_id)

    @staticmethod
    def _thread_bundles(root: BundleRoot, where: str, thread_id: str) -> list[str]:
        """The names of the directories in `where` that may be the bundles of a thread (their
        names end in -<thread id> and sort by when they began), oldest first."""
        if not is_bundle_name(thread_id):
            return []
        try:
            names = root.subdirectories(where)
        except (BundleError, OSError):
            return []
        return [name for name in names if name.endswith(f"-{thread_id}")]

    @staticmethod
    def _open_confined(root: BundleRoot, relative: str) -> BundleReader:
        confined = root.open(relative)
        confined.release_directory()
        return confined.reader()

    def _open(self, path: Path) -> BundleReader:
        found = self._found_in.get(path)
        if found is None:
            return read_bundle(path)
        return self._open_confined(*found)

    def _forked_of(self, path: Path) -> record_pb2.ThreadForked | None:
        """The thread_forked record of a bundle (which comes before its thread_started)."""
        try:
            with self._open(path) as reader:
                for record in reader:
                    body = record.WhichOneof("body")
                    if body == "thread_forked":
                        return record.thread_forked
                    if body in ("thread_started", "footer"):
                        return None
        except (BundleError, OSError):
            return None
        return None

    def _explicit_by_thread(self) -> Mapping[str, Path]:
        if self._explicit_ids is None:
            self._explicit_ids = bundles_by_thread(self._explicit)
        return self._explicit_ids

    def _load(self, path: Path) -> ParentBundle | None:
        """Reduce one parent whose own parent is loaded already (or beyond reach)."""
        # Every payload only when asked for; otherwise the reducer's own store, which keeps
        # what it has not parsed within its budget, and its parsed items.
        payloads = PayloadStore(budget=None) if self._every_payload else None
        keep = keeping_payloads(payloads) if payloads is not None else None
        try:
            with self._open(path) as reader:
                reduced = reduce_reader(reader, forks=self, rewards=None, on_record=keep)
        except (BundleError, ReductionError, OSError):
            return None
        store, items = reduced.held
        return ParentBundle(
            path, reduced.trace, payloads if payloads is not None else store, reduced.parent, items
        )

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
