"""Files a user names on the command line (a settings file, a TLS certificate, a bundle to
replay): what the path is when it is not what the flag takes, and a read that never waits on a
FIFO. One place for both commands' path-taking flags; it imports only the standard library."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["path_kind", "read_given_file"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISREG, "a regular file"),
)


def path_kind(path: str | os.PathLike[str]) -> str:
    """What the path names, in words for a one-line message: "a FIFO", "a directory", "a
    symbolic link to nothing", "missing", ... (a symbolic link is described by its target)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if os.path.islink(path):
            return "a symbolic link to nothing"
        if error.errno == errno.ENOENT:
            return "missing"
        return f"unreadable ({error.strerror or error})"
    return _kind(mode)


def _kind(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _is_anonymous_pipe(fd: int) -> bool:
    # `--config <(...)` hands /dev/fd/N, a pipe whose writer is the shell's command: read as it
    # comes. A FIFO named on disk may have no writer at all, so it is never waited on.
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def read_given_file(path: str | os.PathLike[str], flag: str, *, limit: int) -> bytes:
    """The bytes of the file a flag names, at most limit + 1 of them (the caller says what more
    means). A symbolic link is followed (the user named it; a mounted secret is one). Raises
    ValueError with one line naming the flag and what the path is, when it is no regular file
    (a FIFO is refused without waiting for a writer; a pipe from `<(...)` is read) or cannot be
    read."""
    shown = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        # A socket (ENXIO) or a link to nothing (ENOENT) is named for what it is.
        kind = path_kind(path)
        if kind not in ("a regular file", "a directory", "missing") and "(" not in kind:
            raise ValueError(f"{flag}: {shown} is {kind}, not a regular file") from error
        raise ValueError(f"{flag}: cannot read {shown}: {error.strerror or error}") from error
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode) and not (stat.S_ISFIFO(mode) and _is_anonymous_pipe(fd)):
            raise ValueError(f"{flag}: {shown} is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(limit + 1)
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {shown}: {error.strerror or error}") from error
    finally:
        os.close(fd)
