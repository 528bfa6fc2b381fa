"""Trace bundles of rollout-trace: the format, its writer and reader, and the reducer."""

from typing import TYPE_CHECKING

from ._framing import MAX_RECORD_BYTES, RecordTooLargeError
from ._payloads import canonical_json, payload_id
from ._reader import (
    BundleError,
    BundleNotFoundError,
    BundleReader,
    FrameDecoder,
    Integrity,
    NotABundleError,
    read_bundle,
    resolve_trace_file,
)
from ._reducer import Reducer, ReductionError, replay_bundle
from ._requests import RequestNotFoundError, request_body
from ._state_json import state_to_json, write_state_json
from ._version import __version__
from ._writer import (
    FORMAT_VERSION,
    STATE_FILE_NAME,
    TRACE_FILE_NAME,
    BundleWriter,
    RecordingError,
)

if TYPE_CHECKING:
    from ._otel import ExportConfigError, ExportedBundle, ExportFailedError, export_otlp

# The OTLP export needs the optional `otel` extra: it is imported on first use only.
_OTEL_NAMES = frozenset({"ExportConfigError", "ExportFailedError", "ExportedBundle", "export_otlp"})


def __getattr__(name: str) -> object:
    if name in _OTEL_NAMES:
        from . import _otel

        return getattr(_otel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "MAX_RECORD_BYTES",
    "STATE_FILE_NAME",
    "TRACE_FILE_NAME",
    "BundleError",
    "BundleNotFoundError",
    "BundleReader",
    "BundleWriter",
    "ExportConfigError",
    "ExportFailedError",
    "ExportedBundle",
    "FrameDecoder",
    "Integrity",
    "NotABundleError",
    "RecordTooLargeError",
    "RecordingError",
    "Reducer",
    "ReductionError",
    "RequestNotFoundError",
    "__version__",
    "canonical_json",
    "export_otlp",
    "payload_id",
    "read_bundle",
    "replay_bundle",
    "request_body",
    "resolve_trace_file",
    "state_to_json",
    "write_state_json",
]
