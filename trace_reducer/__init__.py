"""Trace bundles of rollout-trace: the format, its writer and reader, and the reducer."""

from typing import TYPE_CHECKING

from ._compact import expand_request_items
from ._confine import BundlePathError, OutsideRootError
from ._errors import (
    BundleError,
    BundleNotFoundError,
    CorruptBundleError,
    NotABundleError,
    RecordingError,
    RecordOutOfRangeError,
    ReductionError,
    describe_os_error,
)
from ._framing import (
    MAX_RECORD_BYTES,
    RecordTooLargeError,
    decode_varint,
    encode_record,
    encode_varint,
)
from ._integrity import describe_integrity, integrity_name, require_reducible
from ._layout import REWARDS_FILE_NAME, STATE_FILE_NAME, TRACE_FILE_NAME
from ._payloads import canonical_json, payload_id
from ._reader import BundleReader, FrameDecoder, read_bundle, resolve_trace_file
from ._recorded import (
    RecordedSummary,
    RecordedThread,
    TurnNotEndedError,
    TurnNotRecordedError,
    find_thread_bundle,
    list_recorded,
    load_recorded,
)
from ._records import RecordBuilder, RecordSink
from ._reducer import Reducer
from ._replay import replay_bundle
from ._requests import RequestNotFoundError, request_body
from ._rewards import (
    RewardError,
    RewardInput,
    append_reward,
    attach_rewards,
    check_reward,
    read_rewards,
)
from ._rl_export import FORMATS as RL_FORMATS
from ._rl_export import Exported, ExportError, build_sample, export_rl
from ._state_json import iter_state_json, state_to_json, write_state_json
from ._tokens import LOGPROBS_INCLUDE, classify_stop, delta_tokens, sampling_settings
from ._version import __version__
from ._view import VIEW_FILE_NAME, write_view
from ._watch import WatchUpdate, follow_bundle
from ._writer import FORMAT_VERSION, BundleWriter

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
    "LOGPROBS_INCLUDE",
    "MAX_RECORD_BYTES",
    "REWARDS_FILE_NAME",
    "RL_FORMATS",
    "STATE_FILE_NAME",
    "TRACE_FILE_NAME",
    "VIEW_FILE_NAME",
    "BundleError",
    "BundleNotFoundError",
    "BundlePathError",
    "BundleReader",
    "BundleWriter",
    "CorruptBundleError",
    "ExportConfigError",
    "ExportError",
    "ExportFailedError",
    "Exported",
    "ExportedBundle",
    "FrameDecoder",
    "NotABundleError",
    "OutsideRootError",
    "RecordBuilder",
    "RecordOutOfRangeError",
    "RecordSink",
    "RecordTooLargeError",
    "RecordedSummary",
    "RecordedThread",
    "RecordingError",
    "Reducer",
    "ReductionError",
    "RequestNotFoundError",
    "RewardError",
    "RewardInput",
    "TurnNotEndedError",
    "TurnNotRecordedError",
    "WatchUpdate",
    "__version__",
    "append_reward",
    "attach_rewards",
    "build_sample",
    "canonical_json",
    "check_reward",
    "classify_stop",
    "decode_varint",
    "delta_tokens",
    "describe_integrity",
    "describe_os_error",
    "encode_record",
    "encode_varint",
    "expand_request_items",
    "export_otlp",
    "export_rl",
    "find_thread_bundle",
    "follow_bundle",
    "integrity_name",
    "iter_state_json",
    "list_recorded",
    "load_recorded",
    "payload_id",
    "read_bundle",
    "read_rewards",
    "replay_bundle",
    "request_body",
    "require_reducible",
    "resolve_trace_file",
    "sampling_settings",
    "state_to_json",
    "write_state_json",
    "write_view",
]
