"""Finding the bundles under a local root: the one walk every command and server uses.

A bundle is a directory holding a regular file named trace.binpb. The walk never follows a
symbolic link (to a directory or to a file), never opens anything (so a FIFO is never waited
on: it is no regular file), and never descends into a bundle. A directory whose trace.binpb is
something else (a FIFO, a symbolic link) is left out, or handed to a caller that reports it as
a bundle that cannot be read (reduce-all, `list`), with no trace time. Each directory is listed
once with `os.scandir`, its entries taken in name order, so bundles come out depth first in
name order (which for the flat roots the agent writes is the order they began); the times a
caller needs come from the one `lstat` of each file found.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ._layout import REWARDS_FILE_NAME, STATE_FILE_NAME, TRACE_FILE_NAME

__all__ = ["FoundBundle", "holds_bundles", "thread_bundles", "walk_bundles"]


@dataclass(frozen=True, slots=True)
class FoundBundle:
    """A bundle directory and the modification times of the files in it (None: absent, or
    no regular file)."""

    path: str
    trace_mtime: float | None
    state_mtime: float | None
    rewards_mtime: float | None

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _regular_mtime(entry: os.DirEntry[str]) -> float | None:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    return info.st_mtime if stat.S_ISREG(info.st_mode) else None


def _in_name_order(directory: str) -> Iterator[os.DirEntry[str]]:
    with os.scandir(directory) as listing:
        return iter(sorted(listing, key=lambda entry: entry.name))


def _utf8(path: str) -> bool:
    try:
        path.encode()
    except UnicodeEncodeError:
        return False
    return True


def walk_bundles(
    root: str | os.PathLike[str],
    *,
    recursive: bool = True,
    accept: Callable[[str], bool] | None = None,
    irregular: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Iterator[FoundBundle]:
    """The bundles below root (root itself is never one), depth first in name order.

    `recursive=False` looks only at root's own subdirectories (the layout the agent writes);
    `accept`, when given, picks the bundle directories by name; `irregular` also hands out
    directories whose trace.binpb is no regular file (trace_mtime None), for a caller that
    reports them. A subdirectory that cannot be listed, or whose name is not valid UTF-8, is
    reported to `warn` and passed over; root's own OSError is raised."""
    # A stack rather than recursion: no tree is too deep to walk. This loop runs once per
    # directory of a root of 100,000 bundles, which is why it is written out in one piece.
    stack = [_in_name_order(os.fspath(root))]
    while stack:
        for entry in stack[-1]:
            if not entry.is_dir(follow_symlinks=False):
                continue
            wanted = accept is None or accept(entry.name)
            if not wanted and not recursive:
                continue
            path = entry.path
            if not _utf8(path):
                # Listings, tables and pages are UTF-8 throughout: such a name has no place there.
                if warn is not None:
                    shown = os.fsencode(path).decode("utf-8", "backslashreplace")
                    warn(f"passed over {shown}: its name is not valid UTF-8 (rename it)")
                continue
            try:
                with os.scandir(path) as listing:
                    inside = list(listing)
            except OSError as error:
                if warn is not None:
                    warn(f"cannot list {path}: {error.strerror or error}")
                continue
            named = False
            trace = state = rewards = None
            if wanted:
                for file in inside:
                    name = file.name
                    if name == TRACE_FILE_NAME:
                        named = True
                        trace = _regular_mtime(file)
                    elif name == STATE_FILE_NAME:
                        state = _regular_mtime(file)
                    elif name == REWARDS_FILE_NAME:
                        rewards = _regular_mtime(file)
            if trace is not None or (named and irregular):
                yield FoundBundle(path, trace, state, rewards)
            elif recursive:
                stack.append(iter(sorted(inside, key=lambda file: file.name)))
                break
        else:
            stack.pop()


def no_bundles_there(path: str | os.PathLike[str]) -> str:
    """What every command that reads bundles under a root says when it finds none there (an
    empty directory, or one of other files), in one set of words for all of them (`list`,
    `reduce-all`, `view`, `export-rl`, `--replay-from`): bad input, exit 2. Only the served
    `view ROOT` starts on an empty directory, which it watches for bundles to come."""
    return f"no trace bundles (directories holding {TRACE_FILE_NAME}) under {path}"


def holds_bundles(root: str | os.PathLike[str]) -> bool:
    """Whether a directory is a root of bundles: it holds some, or nothing at all yet (a trace
    root before its first recording); a directory of other things is neither bundle nor root."""
    if next(walk_bundles(root, irregular=True), None) is not None:
        return True
    with os.scandir(root) as listing:
        return next(listing, None) is None


def thread_bundles(root: Path, thread_id: str) -> list[Path]:
    """The bundles of a thread directly under root, oldest first (their names sort by when
    they began); none for an id that is not a plain name."""
    if not thread_id or any(c in thread_id for c in "/\0") or thread_id in {".", ".."}:
        return []
    suffix = f"-{thread_id}"
    try:
        found = list(walk_bundles(root, recursive=False, accept=lambda n: n.endswith(suffix)))
    except OSError:
        return []
    return [Path(bundle.path) for bundle in found]
