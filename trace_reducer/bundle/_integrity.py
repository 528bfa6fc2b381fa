"""One integrity policy: what a reduced bundle's integrity means for the CLI, service and demo."""

from __future__ import annotations

from rollout.trace.v1 import state_pb2

from ._errors import CorruptBundleError, NotABundleError
from ._names import integrity_word


def integrity_name(status: state_pb2.IntegrityStatus.ValueType) -> str:
    """`CLEAN`, `UNCLOSED`, `TRUNCATED` or `CORRUPT`."""
    return integrity_word(status)


def describe_integrity(integrity: state_pb2.Integrity) -> str:
    """One line: status, how much was read, and the reader's detail."""
    line = (
        f"{integrity_name(integrity.status)} "
        f"({integrity.records_read} records, {integrity.bytes_read} bytes)"
    )
    return f"{line}: {integrity.detail}" if integrity.detail else line


def bundle_warning(status: state_pb2.IntegrityStatus.ValueType, bundle: str, what: str) -> str:
    """The warning export-rl and reduce-all give of a bundle they read, whose integrity (or a
    sidecar beside it) says something is wrong: `clean bundle NAME: rewards.binpb is not a
    regular file`."""
    return f"{integrity_name(status).lower()} bundle {bundle}: {what}"


def require_reducible(integrity: state_pb2.Integrity, *, salvage: bool, source: str) -> None:
    """Refuse what is no bundle at all, and a CORRUPT bundle unless salvaging.

    UNCLOSED and TRUNCATED bundles pass: the records before the end are the state.
    Raises NotABundleError (no header record could be read) or CorruptBundleError.
    """
    if integrity.records_read == 0:
        raise NotABundleError(
            f"not a trace bundle (no header record): {source}: {integrity.detail}"
        )
    if integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT and not salvage:
        raise CorruptBundleError(f"corrupt bundle {source}: {integrity.detail}", integrity)
