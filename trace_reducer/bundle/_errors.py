"""Every exception trace_reducer raises, in one tree, and the one way an OSError is put into
words. Each is imported where it is raised from here; the tree:

    BundleError                     the path given is not a readable trace bundle
    ├── BundleNotFoundError         nothing at the path
    ├── NotABundleError             no trace.binpb, or no header in it
    ├── CorruptBundleError          CORRUPT and not salvaging (carries the integrity)
    ├── BundlePathError             a malformed path (ReducerService)
    ├── OutsideRootError            a path outside the root or through a symlink (ReducerService)
    └── RequestNotFoundError        no inference call with that id (`request`)
    ReductionError                  records contradict each other
    └── RecordOutOfRangeError       a value the state cannot hold (a time past year 9999)
    RecordingError                  a bundle could not be created or written
    RewardError                     a reward that cannot be recorded (`reason`: a code)
    PayloadError (ValueError)       payload records that do not fit together
    RecordTooLargeError (ValueError)  a record over MAX_RECORD_BYTES once framed
    ExportError                     the RL export cannot be written
    ExportConfigError (ValueError)  an OTLP endpoint, protocol, header or timeout unusable
    ExportFailedError               the OTLP receiver did not take the spans
    MissingExtraError               a command needs an optional extra that is not installed
    └── RayUnavailableError         `--ray` without the ray extra

The ValueError ones are bad values handed in by code; the others are what a command or a
service turns into its exit code or status (cli/_main.py, service/_service.py, batch/_batch.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable

from rollout.trace.v1 import state_pb2


class BundleError(Exception):
    """The path given is not a readable trace bundle."""


class BundleNotFoundError(BundleError):
    """Nothing exists at the path given."""


class NotABundleError(BundleError):
    """The path exists but holds no bundle: no trace.binpb, or no header record in it."""


class CorruptBundleError(BundleError):
    """The bundle is CORRUPT and the caller did not ask to salvage it."""

    def __init__(self, message: str, integrity: state_pb2.Integrity) -> None:
        super().__init__(message)
        self.integrity = integrity

    def __reduce__(self) -> tuple[type[CorruptBundleError], tuple[str, state_pb2.Integrity]]:
        # Raised in a worker process, it crosses back to the parent by pickle.
        return type(self), (str(self), self.integrity)


class BundlePathError(BundleError):
    """The bundle path is malformed: empty, with a NUL byte, or too long."""


class OutsideRootError(BundleError):
    """The bundle path leads outside the root, or through a symbolic link."""


class RequestNotFoundError(BundleError):
    """The bundle has no inference call with the id asked for."""


class RecordingError(Exception):
    """A bundle could not be created or written; the message is the cause."""


class ReductionError(Exception):
    """Records contradict each other; the message starts with the seq of the offending one."""


class RecordOutOfRangeError(ReductionError):
    """A record holds a value the state cannot: a time outside the years 1-9999."""


class RewardError(Exception):
    """A reward that cannot be recorded; `reason` is an UPPER_SNAKE code for services."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PayloadError(ValueError):
    """Payload records that do not fit together."""


class RecordTooLargeError(ValueError):
    """A record would exceed MAX_RECORD_BYTES once framed."""


class ExportError(Exception):
    """The export cannot be written (pyarrow missing, an unwritable output directory)."""


class ExportConfigError(ValueError):
    """An endpoint, protocol, header or timeout the export cannot use."""


class ExportFailedError(Exception):
    """The receiver could not be reached or did not accept the spans."""


class MissingExtraError(Exception):
    """An optional extra is not installed: says what needs it, the package that is missing and
    the pip line that installs it (a command exits 2 with it, before doing anything)."""

    def __init__(self, what: str, extra: str, missing: str | None = None) -> None:
        package = f" ({missing} is missing)" if missing else ""
        super().__init__(
            f"{what} needs the {extra} extra{package}: pip install 'rollout-trace[{extra}]'"
        )


class RayUnavailableError(MissingExtraError):
    """The ray extra is not installed."""


def not_reduced_reason(
    error: Exception, describe_os: Callable[[OSError], str] | None = None
) -> str:
    """Why a bundle could not be reduced, in the words reduce-all's summary and export-rl's
    warnings both use (`describe_os`: how an OSError is said where it came from a store)."""
    if isinstance(error, ReductionError):
        return f"records contradict each other: {error}"
    if isinstance(error, BundleError):
        return str(error)
    if isinstance(error, OSError):
        return (describe_os or describe_os_error)(error)
    return f"internal error: {type(error).__name__}: {error}"


def describe_os_error(error: OSError, path: str | os.PathLike[str] | None = None) -> str:
    """`<reason>: <path>`, naming `path` (what the user gave) over the file the OS tried."""
    reason = os_error_reason(error)
    named = path if path is not None else error.filename
    return f"{reason}: {os.fsdecode(named)}" if named is not None else reason


def os_error_reason(error: OSError) -> str:
    """The OS's reason for error, and for the open-file limit what it is and how to move it:
    a busy server meets it (each open thread keeps its bundle open), and "Too many open files"
    alone does not say that the limit is the process's, nor which."""
    reason = error.strerror or str(error) or type(error).__name__
    if error.errno == errno.EMFILE:
        held = "its limit of open files"
        with contextlib.suppress(ImportError, OSError, ValueError):
            import resource

            held = f"its limit of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} open files"
        reason = (
            f"{reason} (the process is at {held}; each open thread or session keeps its "
            "bundle open: raise the limit, e.g. `ulimit -n`, systemd's LimitNOFILE, docker's "
            "--ulimit nofile)"
        )
    return reason
