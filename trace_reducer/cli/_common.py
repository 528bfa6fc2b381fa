"""What every trace-reducer command shares: its name, the exit codes, the line a warning or
an error is printed as, and the fsspec option flag."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import sys
import urllib.parse
import uuid
from collections.abc import Iterable
from pathlib import Path

from grpc_common import Redactor

from .._exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from .._exits import TRACE_REDUCER as PROG
from ..batch._storage import HTTP_TIMEOUT
from ..bundle._errors import BundleError, MissingExtraError, os_error_reason
from ..bundle._shown import one_line

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "MAX_JOBS",
    "PROG",
    "add_storage_option_argument",
    "check_output_dir",
    "check_parents",
    "hide_secrets",
    "job_count",
    "local_path_argument",
    "path_argument",
    "redact",
    "root_failure",
    "say",
    "seconds_argument",
    "unwritable_place",
    "warn",
]


# Beyond this a process pool is a mistake, not a machine: argparse says so, not the OS.
MAX_JOBS = 1024


def job_count(text: str) -> int:
    """`--jobs N`: a number of worker processes, from 1 to MAX_JOBS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_JOBS}, got {value}")
    return value


_redactors: list[Redactor] = []
# Shorter user names are left in text: hiding `u` would blank every u.
_MIN_SECRET = 4


def hide_secrets(urls: Iterable[str | None], storage_options: Iterable[str] = ()) -> None:
    """From now on what the command says (say, warn, redact) shows the URLs it was given
    (roots, tables, and those in --storage-option values) with no credentials, and no other
    --storage-option value whose name says it is a secret (key, secret, token, password, ...):
    an error message quotes the URL, and fsspec's and botocore's messages quote it and the
    options again."""
    option_values = [option.partition("=") for option in storage_options]
    option_urls = [value for _, _, value in option_values if "://" in value]
    # A value named like a secret, and one that would be a URL's credentials or query had it a
    # scheme (`endpoint_url=host/?sig=…`, which botocore quotes back refusing it), whole.
    keys = [
        value
        for name, _, value in option_values
        if "://" not in value
        and len(value) >= _MIN_SECRET
        and (_SECRET_NAME.search(name) or "?" in value or "@" in value)
    ]
    parsed = [(url, _parts(url)) for url in (*urls, *option_urls) if url and "://" in url]
    with_credentials = [(url, p) for url, p in parsed if p and (p.username or p.query)]
    # s3://KEY_ID:SECRET@bucket: the key id too (the Redactor hides a user standing alone).
    users = [p.username for _, p in with_credentials if len(p.username or "") >= _MIN_SECRET]
    _redactors[:] = [Redactor(filter(None, users), url=url) for url, _ in with_credentials]
    # One that does not parse has no parts to take out: it is not shown at all.
    _redactors.extend(Redactor([url]) for url, p in parsed if p is None)
    if keys:
        _redactors.append(Redactor(keys))


# The names fsspec's file systems give their credentials: s3fs key, secret, token; gcsfs
# token; adlfs account_key, sas_token, connection_string, client_secret; and the like.
_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|connection|sas|sig|auth", re.I)


def _parts(url: str) -> urllib.parse.SplitResult | None:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError:
        return None


def redact(text: str) -> str:
    for redactor in _redactors:
        text = redactor.text(text)
    return text


def root_failure(command: str, root: str, error: Exception, doing: str) -> Exception:
    """Opening or listing a root (a URL, mostly) failed: the extra it needs is missing, or the
    one line (exit 2) naming the root, for the URL's protocol, bucket or service to be fixed."""
    if isinstance(error, ImportError) and error.name is not None:
        return MissingExtraError(command, "batch", error.name)
    # fsspec's own "install gcsfs to access ..." is an ImportError naming no module.
    return BundleError(f"cannot {doing} {root}: {error}")


def path_argument(text: str) -> str:
    """A path a command reads or writes: an empty one is a slip (an unset variable), not the
    current directory, which `reduce-all ''` reduced whole."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty (. is the current directory)")
    return text


def finite_argument(text: str) -> float:
    """A finite number (a reward's value or weight: `nan` and `inf` no trainer can use)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a finite number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def local_path_argument(text: str) -> str:
    """A path of a command that reads and writes only local files: a URL is said to be one
    (only `list` and `reduce-all` read URL roots), not looked for as a path, which said `no such
    file or directory: http:/host/...`, the URL mangled."""
    path = path_argument(text)
    if "://" in path and not os.path.lexists(path):
        scheme = path.partition("://")[0]
        raise argparse.ArgumentTypeError(
            f"a {scheme}:// URL: this command reads local paths only (list and reduce-all read "
            "URL roots)"
        )
    return path


def seconds_argument(text: str) -> float:
    """A number of seconds, finite and not negative."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number from 0, got {text}")
    return value


def check_parents(parents: Iterable[str]) -> None:
    """Each `--parent` is a bundle: one missing or not readable (a FIFO) is a mistake to say,
    not a fork silently left unresolved."""
    from ..bundle._reader import resolve_trace_file

    for parent in parents:
        try:
            resolve_trace_file(parent)
        except BundleError as error:
            raise BundleError(f"--parent {parent}: {error}") from error


def unwritable_place(target: Path, *, directory: bool) -> str | None:
    """Why target (a file, or a directory made if missing) cannot be written, found before any
    work: a bad output path is bad input (exit 2), as a bad input path is; None if it can be."""
    try:
        return _unwritable_place(target, directory=directory)
    except OSError as error:
        # What the path itself cannot be (a name longer than the file system takes) is bad
        # input too, not an exit 1 before any work (was: `File name too long`, exit 1).
        return os_error_reason(error)


def _unwritable_place(target: Path, *, directory: bool) -> str | None:
    if directory and target.exists():
        if not target.is_dir():
            return "not a directory"
        place = target
    elif directory and target.is_symlink():
        # It cannot be made there (`File exists`, found only after the work was done).
        return "a symbolic link to nothing: no directory can be made there"
    elif directory:  # made with its parents, in the nearest directory there is
        place = next((parent for parent in target.parents if parent.exists()), Path("."))
        if not place.is_dir():
            return f"not a directory: {place}"
    else:
        place = target.parent
        if not place.is_dir():
            return f"no such directory: {place}"
    return _cannot_write_in(place)


def _cannot_write_in(place: Path) -> str | None:
    """Why no file can be made in the directory place, found by making one and removing it.

    os.access answers for permissions alone, and root has them all: /proc, /sys, a read-only
    mount passed it, and the command failed after its work, exit 1 (`export-rl --out
    /proc/nope`). The probe is a new hidden name, never a link followed (O_EXCL|O_NOFOLLOW)."""
    probe = place / f".{uuid.uuid4().hex}.probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        # A virtual file system (/proc) answers a new name with ENOENT: say what that means.
        reason = "it takes no new files" if error.errno == errno.ENOENT else None
        return f"cannot write in {place}: {reason or os_error_reason(error)}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def check_output_dir(flag: str, given: str) -> None:
    problem = unwritable_place(Path(given), directory=True)
    if problem is not None:
        raise BundleError(f"{flag} {given}: {problem}")


def say(message: str) -> None:
    """One line on stderr, named after the command: how errors and notes reach the user."""
    # One line even when a library's message (botocore's, say) runs over several.
    line = one_line(" ".join(redact(message).splitlines()))
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    say(f"warning: {message}")


def add_storage_option_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--storage-option KEY=VALUE`, repeatable: fsspec options for `what`."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"fsspec option for {what}, e.g. endpoint_url=http://...; for an http(s) URL, "
        f"timeout=SECONDS bounds each connect and each silence of a request (default "
        f"{HTTP_TIMEOUT:g})",
    )
