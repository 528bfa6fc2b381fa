"""stdout whose failures say they are stdout's, so `main` can tell "the output is gone or full"
from an input file that could not be read or written.

A write to a closed descriptor, a pipe whose reader left, or /dev/full raises the same OSError
as any other file; and with fd 1 closed Python sets `sys.stdout` to None, where print() writes
nothing and `sys.stdout.write` is an AttributeError. Under `guarded_stdout()` every write to
fd 1 that fails raises StdoutError instead, and a closed fd 1 fails the first write.
"""

from __future__ import annotations

import codecs
import errno
import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from grpc_common import discard_stdout, open_standard_fds, stdout_failure

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["StdoutError", "guarded_stdout", "silence_stdout"]


class StdoutError(OSError):
    """A write to stdout failed (closed, a pipe nobody reads, a full device)."""

    def describe(self) -> str:
        return stdout_failure(self)


class _Fd1(io.RawIOBase):
    """fd 1 as raw bytes; `closed_at_start`: it was closed when the command began (it now
    holds /dev/null, so that no file opened later takes its number), and every write fails."""

    def __init__(self, closed_at_start: bool) -> None:
        super().__init__()
        self._closed_at_start = closed_at_start
        # Set once stdout failed: what is still buffered is dropped (see silence_stdout).
        self.discarding = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 1

    def isatty(self) -> bool:
        return not self._closed_at_start and os.isatty(1)

    def write(self, data: ReadableBuffer, /) -> int | None:
        if self.discarding:
            return memoryview(data).nbytes
        if self._closed_at_start:
            raise StdoutError(errno.EBADF, os.strerror(errno.EBADF))
        try:
            return os.write(1, data)
        except BlockingIOError:
            return None  # a non-blocking stdout: the buffer keeps it, as for FileIO
        except OSError as error:
            raise StdoutError(error.errno, error.strerror) from None


_guarded: _Fd1 | None = None

# A character stdout's encoding has no byte for (an `é` on an ASCII or Latin-1 stdout): written
# as its escape, `\xe9`, where the write failed as an `internal error`. A name that is not
# UTF-8 (lone surrogates U+DC80-U+DCFF) still fails, for `main` to say which name it is.
_ESCAPE_UNENCODABLE = "rollout-trace-escape-unencodable"


def _escape_unencodable(error: UnicodeError) -> tuple[str | bytes, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    bad = error.object[error.start : error.end]
    if all("\udc80" <= char <= "\udcff" for char in bad):
        raise error
    return codecs.backslashreplace_errors(error)


codecs.register_error(_ESCAPE_UNENCODABLE, _escape_unencodable)


@contextmanager
def guarded_stdout() -> Iterator[None]:
    """While the command runs, sys.stdout raises StdoutError when fd 1 fails.

    A stdout someone else put in place (a test's capture, a program that called `main`
    with its own) is left as it is.
    """
    # A closed fd would be the number the next file or socket opened gets: a state.json
    # written through "stdout", a socket uvloop refuses to close (it aborts the process).
    fd1_closed = 1 in open_standard_fds()
    real = sys.stdout
    if real is not None and real is not sys.__stdout__:
        yield
        return
    global _guarded
    _guarded = _Fd1(fd1_closed)
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(_guarded),
        encoding=real.encoding if real is not None else "utf-8",
        errors=_ESCAPE_UNENCODABLE if real is None or real.errors == "strict" else real.errors,
        line_buffering=real.line_buffering if real is not None else False,
        write_through=False,
    )
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        except StdoutError:
            silence_stdout()
            sys.stdout.flush()
        sys.stdout = real
        _guarded = None


def silence_stdout() -> None:
    """What is still to be written to stdout goes to /dev/null: the interpreter's last flush
    would only fail again, as an "Exception ignored" traceback."""
    if _guarded is not None:
        _guarded.discarding = True
    discard_stdout()
