"""The errors a caller of trace_reducer meets, and the one way an OSError is put into words."""

from __future__ import annotations

import os

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


class RecordingError(Exception):
    """A bundle could not be created or written; the message is the cause."""


class ReductionError(Exception):
    """Records contradict each other; the message starts with the seq of the offending one."""


class RecordOutOfRangeError(ReductionError):
    """A record holds a value the state cannot: a time outside the years 1-9999."""


def describe_os_error(error: OSError, path: str | os.PathLike[str] | None = None) -> str:
    """`<reason>: <path>`, naming `path` (what the user gave) over the file the OS tried."""
    reason = error.strerror or str(error) or type(error).__name__
    named = path if path is not None else error.filename
    return f"{reason}: {os.fsdecode(named)}" if named is not None else reason
