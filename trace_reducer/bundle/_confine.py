"""Bundles under a root, opened through directory descriptors that never follow a symlink.

A path is checked and then used: between the two, a directory can be swapped for a symlink.
So a bundle is opened once, one component at a time relative to its parent's descriptor
(O_NOFOLLOW), and everything after that — reading trace.binpb, writing state.json — goes
through the bundle directory's descriptor, wherever its name points by then.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import BinaryIO

from ._errors import (
    BundleError,
    BundleNotFoundError,
    BundlePathError,
    NotABundleError,
    OutsideRootError,
)
from ._layout import TRACE_FILE_NAME
from ._reader import BundleReader

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under the root must not hang the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NO_FOLLOW_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Linux's PATH_MAX: no longer path names a file, so it is refused before touching the disk.
MAX_PATH_BYTES = 4096


def open_regular_file(
    name: str | os.PathLike[str], flags: int, *, dir_fd: int | None = None, mode: int = 0o600
) -> int:
    """A descriptor of the regular file `name` (relative to dir_fd when given), for every file
    opened beside a bundle (sidecars): never through a symbolic link (O_NOFOLLOW: a link,
    dangling or not, is ELOOP, and O_CREAT never creates its target), never waiting on a FIFO
    (O_NONBLOCK until fstat shows a regular file). Raises OSError; NotRegularFileError for a
    FIFO, device or directory."""
    fd = os.open(name, flags | _NO_FOLLOW_FLAGS, mode, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, "not a regular file", os.fsdecode(name))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_aside(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, mode: int = 0o666
) -> Path:
    """Write the file at path whole or not at all, for every file written by name (a page, an
    export, the list's index): `write` fills a new file beside it (`mode` less the umask, as
    any new file gets: 0644 under umask 022; O_EXCL|O_NOFOLLOW), which is then renamed over
    it. Pass 0o600 for a file that holds a bundle's contents beside it, as the bundle's own.
    Whatever has the name already (a FIFO, a symbolic link) is replaced, never waited on nor
    written through; a reader never sees half a file, and the file before stays whole until
    the new one is. Returns the path."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
            os.replace(temp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except OSError as error:
        # Named after the file asked for, not the one beside it, nor nothing at all: a write
        # that fails (a full disk, a quota) names no file (was: `No space left on device`).
        if error.filename is not None and error.filename != os.fspath(temp):
            raise
        raise type(error)(error.errno, error.strerror, os.fspath(target)) from error
    return target


def write_dir_aside(path: str | os.PathLike[str], fill: Callable[[Path], object]) -> Path:
    """Write the directory at path whole or not at all, for a directory of files written as
    one (a static site): `fill` is given a new, empty directory beside it, which then takes
    path's place in one rename (exchanged with the directory there before, which is removed
    after). Interrupted or failed, path is left as it was and the new directory removed. A
    symbolic link at path is refused (ELOOP), never written through. Returns the path."""
    target = Path(path)
    if target.is_symlink():
        raise OSError(errno.ELOOP, "a symbolic link, not a directory", os.fspath(target))
    before = target.stat().st_mode if target.exists() else None
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}.writing")
    # Made as mkdir makes any directory (the umask's mode), or with the mode of the one it
    # replaces: a site served by a web server stays readable by it.
    os.mkdir(staging)
    try:
        if before is not None:
            os.chmod(staging, stat.S_IMODE(before))
        try:
            fill(staging)
        except OSError as error:
            # Named where the file was to be, not in the directory beside it that is gone.
            inside = os.fspath(staging)
            if isinstance(error.filename, str) and error.filename.startswith(inside):
                named = os.fspath(target) + error.filename[len(inside) :]
                raise type(error)(error.errno, error.strerror, named) from error
            raise
        if before is None:
            # A directory made there meanwhile is replaced only if empty (ENOTEMPTY).
            try:
                os.rename(staging, target)
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise
                # Was `Directory not empty: .DIR.<hex>.writing`: a name gone by the time it
                # was read, and no word of what happened.
                raise OSError(
                    error.errno,
                    "something was put there while this was written (another command writing "
                    "the same place?); it is left as it is: run again to replace it",
                    os.fspath(target),
                ) from error
        else:
            _exchange(staging, target)
    finally:
        # After the exchange it holds what was there before; after a failure, half the new.
        _remove_tree(staging)
    return target


def _exchange(new: Path, old: Path) -> None:
    """Put directory `new` where `old` is and `old` where `new` was, in one step where the
    kernel offers one (Linux's renameat2 RENAME_EXCHANGE), else by two renames no Ctrl-C can
    come between."""
    try:
        _rename_exchange(new, old)
        return
    except OSError as error:
        if error.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
    aside = old.with_name(f".{old.name}.{uuid.uuid4().hex}.replaced")
    with stops_held():
        os.rename(old, aside)
        try:
            os.rename(new, old)
        except BaseException:
            os.rename(aside, old)
            raise
        os.rename(aside, new)


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off until the block has ended, for steps that must not stop
    between each other (renames that replace one thing by another): one that arrives is
    noted, then sent again once the block is over, to the handler there was before.

    Noted by a handler rather than blocked: a process-directed signal blocked in this thread
    goes to another (fsspec's, tqdm's), and Python still runs its handler here, mid-block."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can set handlers, and only it runs them
        return
    arrived: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        arrived.append(signum)

    previous = {stop: signal.signal(stop, note) for stop in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler if handler is not None else signal.SIG_DFL)
        if arrived:
            signal.raise_signal(arrived[0])


def _rename_exchange(first: Path, second: Path) -> None:
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # not Linux, or a C library before glibc 2.28
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fspath(second))


def _remove_tree(path: Path) -> None:
    # rmtree never follows a link out of the tree it removes.
    shutil.rmtree(path, ignore_errors=True)


class NotRegularFileError(OSError):
    """A name beside a bundle is a FIFO, device or directory, not a file: never opened for use."""


def sidecar_problem(error: OSError, name: str) -> str:
    """Why a file beside a bundle cannot be used, in a few words that name it."""
    if error.errno == errno.ELOOP:
        return f"{name} is a symbolic link, which is not followed"
    if isinstance(error, NotRegularFileError):
        return f"{name} is not a regular file"
    return f"{name}: {error.strerror or error}"


def open_found_trace(bundle: str | os.PathLike[str]) -> BinaryIO:
    """The trace.binpb of a bundle found under a root (walk_bundles), opened for reading as
    every command that reads many bundles opens it: never through a symbolic link, never
    waiting on a FIFO. Raises NotABundleError in the words reduce-all, `list` and export-rl
    report such a bundle with."""
    path = os.path.join(bundle, TRACE_FILE_NAME)
    try:
        return os.fdopen(open_regular_file(path, os.O_RDONLY), "rb", buffering=0)
    except OSError as error:
        raise NotABundleError(
            f"not a trace bundle: {sidecar_problem(error, TRACE_FILE_NAME)}: {os.fspath(bundle)}"
        ) from error


class ConfinedBundle:
    """An open bundle: its directory's descriptor and its trace.binpb, both read through them;
    and the root it was opened under, with the directory holding it relative to that root
    (`beside`: "" for the root itself), for what is looked for beside it by name."""

    def __init__(
        self,
        dir_fd: int,
        trace: BinaryIO,
        display_dir: str,
        *,
        root: BundleRoot | None = None,
        beside: str = "",
    ) -> None:
        self.dir_fd = dir_fd
        self.trace = trace
        self.display_dir = display_dir
        self.root = root
        self.beside = beside

    def reader(self) -> BundleReader:
        """Its trace.binpb to read, through the descriptor it was opened with."""
        return BundleReader(Path(self.display_dir) / TRACE_FILE_NAME, self.trace)

    def close(self) -> None:
        try:
            self.trace.close()
        finally:
            self.release_directory()

    def release_directory(self) -> None:
        """Close the directory's descriptor (the trace file stays open)."""
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> ConfinedBundle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class BundleRoot:
    """The directory a service may read bundles under, and nothing else."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = os.path.realpath(root)
        # The root as given too: a client may name a bundle by an absolute path through it.
        self._given = os.path.abspath(root)

    def open(self, bundle: str) -> ConfinedBundle:
        """Open `bundle` (a directory, or its trace.binpb) under the root.

        Raises BundlePathError, OutsideRootError, BundleNotFoundError or NotABundleError.
        """
        parts = self._components(bundle)
        if not parts:
            raise self._the_root(bundle)
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            for part in parts[:-1]:
                fd = self._step(fd, part, bundle)
            return self._open_last(fd, parts[-1], bundle, at_root=len(parts) == 1)
        except BaseException:
            os.close(fd)
            raise

    def subdirectories(self, directory: str) -> list[str]:
        """The names of the directories directly in `directory` (relative to the root, "" for
        the root itself), in name order, symbolic links left out. The directory is reached as
        a bundle is, one component at a time never through a link, so a directory swapped for
        a symlink since it was last looked at is never listed through it.

        Raises BundleError (OutsideRootError, BundleNotFoundError, ...)."""
        parts = self._components(directory) if directory else []
        try:
            fd = os.open(self.path, _DIR_FLAGS)
        except OSError as error:
            raise self._explain(error, directory) from error
        try:
            for part in parts:
                fd = self._step(fd, part, directory)
            # scandir works on its own duplicate of the descriptor.
            with os.scandir(fd) as listing:
                return sorted(
                    entry.name for entry in listing if entry.is_dir(follow_symlinks=False)
                )
        except OSError as error:
            raise self._explain(error, directory) from error
        finally:
            os.close(fd)

    def _components(self, bundle: str) -> list[str]:
        problem = ""
        if not bundle:
            problem = "is empty"
        elif "\0" in bundle:
            problem = "contains a NUL byte"
        elif len(bundle.encode()) > MAX_PATH_BYTES:
            problem = f"is longer than {MAX_PATH_BYTES} bytes"
        if problem:
            raise BundlePathError(f"bundle path {problem}")
        relative = bundle
        if os.path.isabs(bundle):
            for root in (self.path, self._given):
                if os.path.commonpath([root, os.path.normpath(bundle)]) == root:
                    relative = os.path.relpath(os.path.normpath(bundle), root)
                    break
            else:
                raise self._outside(bundle)
        # No symlink is followed, so `..` means what it says and can be resolved by name.
        normal = os.path.normpath(relative)
        if normal == os.pardir or normal.startswith(os.pardir + os.sep):
            raise self._outside(bundle)
        return [] if normal == os.curdir else normal.split(os.sep)

    @staticmethod
    def _the_root(bundle: str) -> BundlePathError:
        # A bundle is under the root, never the root itself: a fork's parent is looked for
        # beside its bundle, and beside the root is outside it.
        return BundlePathError(
            f"bundle path {bundle!r} names the bundle root itself; name a bundle under it"
        )

    @staticmethod
    def _outside(bundle: str) -> OutsideRootError:
        return OutsideRootError(f"bundle path {bundle!r} is outside the bundle root")

    def _step(self, parent: int, name: str, bundle: str) -> int:
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as error:
            raise self._explain(error, bundle) from error
        os.close(parent)
        return child

    def _open_last(self, parent: int, name: str, bundle: str, *, at_root: bool) -> ConfinedBundle:
        """`name` in parent is the bundle directory, or its trace file; parent is the root
        itself when at_root.

        On success the bundle owns parent (or closed it); on failure the caller closes it.
        """
        directory = parent
        trace_name = TRACE_FILE_NAME
        file_named = False
        try:
            directory = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as error:
            if error.errno != errno.ENOTDIR:
                raise self._explain(error, bundle) from error
            trace_name = name  # the trace file itself was named
            file_named = True
        try:
            trace = self._open_trace(directory, trace_name, bundle)
            if file_named and at_root:
                trace.close()
                if name != TRACE_FILE_NAME:
                    # A file beside the bundles (the list's index, notes): no bundle at all.
                    raise NotABundleError(
                        f"not a trace bundle: {bundle!r} is a file in the bundle root; "
                        "name a bundle directory under it"
                    )
                raise self._the_root(bundle)
        except BaseException:
            if directory != parent:
                os.close(directory)
            raise
        if directory != parent:
            os.close(parent)
        parts = self._components(bundle)
        if file_named:
            parts = parts[:-1]
        return ConfinedBundle(
            directory,
            trace,
            os.path.join(self.path, *parts),
            root=self,
            beside=os.path.join("", *parts[:-1]),
        )

    def _open_trace(self, directory: int, name: str, bundle: str) -> BinaryIO:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=directory)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ENOTDIR):
                raise NotABundleError(
                    f"not a trace bundle (no {TRACE_FILE_NAME}): {bundle!r}"
                ) from error
            raise self._explain(error, bundle) from error
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotABundleError(f"not a trace bundle ({name} is no file): {bundle!r}")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def _explain(self, error: OSError, bundle: str) -> BundleError:
        if error.errno == errno.ELOOP:
            # A symlink can lead anywhere, and where it leads can change after any check.
            return OutsideRootError(
                f"bundle path {bundle!r} goes through a symbolic link, which is not followed"
            )
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return BundleNotFoundError(f"no bundle at {bundle!r}")
        if error.errno == errno.ENAMETOOLONG:
            return BundlePathError("bundle path has a name longer than the file system allows")
        return BundleError(f"cannot open bundle {bundle!r}: {error.strerror or error}")
