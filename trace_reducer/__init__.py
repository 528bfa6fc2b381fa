"""Trace bundles of rollout-trace: the format, its writer and reader, and the reducer."""

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
from ._view import VIEW_FILE_NAME, write_view
from ._watch import WatchUpdate, follow_bundle
from ._writer import (
    FORMAT_VERSION,
    STATE_FILE_NAME,
    TRACE_FILE_NAME,
    BundleWriter,
    RecordingError,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_RECORD_BYTES",
    "STATE_FILE_NAME",
    "TRACE_FILE_NAME",
    "VIEW_FILE_NAME",
    "BundleError",
    "BundleNotFoundError",
    "BundleReader",
    "BundleWriter",
    "FrameDecoder",
    "Integrity",
    "NotABundleError",
    "RecordTooLargeError",
    "RecordingError",
    "Reducer",
    "ReductionError",
    "RequestNotFoundError",
    "WatchUpdate",
    "__version__",
    "canonical_json",
    "follow_bundle",
    "payload_id",
    "read_bundle",
    "replay_bundle",
    "request_body",
    "resolve_trace_file",
    "state_to_json",
    "write_state_json",
    "write_view",
]
