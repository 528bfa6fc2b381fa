"""What reads and writes a bundle's bytes: layout, framing, payloads, the reader and the writer."""

from ._confine import BundleRoot, ConfinedBundle
from ._discover import FoundBundle, holds_bundles, thread_bundles, walk_bundles
from ._errors import (
    BundleError,
    BundleNotFoundError,
    BundlePathError,
    CorruptBundleError,
    NotABundleError,
    OutsideRootError,
    RecordingError,
    RecordOutOfRangeError,
    RecordTooLargeError,
    ReductionError,
    RewardError,
    describe_os_error,
    os_error_reason,
)
from ._framing import MAX_RECORD_BYTES, decode_varint, encode_record, encode_varint
from ._integrity import describe_integrity, integrity_name, require_reducible
from ._layout import REWARDS_FILE_NAME, STATE_FILE_NAME, TRACE_FILE_NAME
from ._liveness import LIVE_WINDOW, being_written, writer_holds, writer_holds_file
from ._payloads import (
    LONG_NUMBER_DIGITS,
    canonical_json,
    canonical_json_with_list,
    fast_json,
    payload_id,
)
from ._reader import BundleReader, FrameDecoder, read_bundle, resolve_trace_file
from ._records import RecordBuilder, RecordSink, same_objects_prefix
from ._rewards import (
    RewardInput,
    append_reward,
    attach_rewards,
    check_reward,
    read_rewards,
)
from ._tokens import (
    LENGTH_REASONS,
    LOGPROBS_INCLUDE,
    classify_stop,
    delta_tokens,
    sampling_settings,
)
from ._version import __version__
from ._writer import FORMAT_VERSION, BundleWriter

__all__ = [
    "FORMAT_VERSION",
    "LENGTH_REASONS",
    "LIVE_WINDOW",
    "LOGPROBS_INCLUDE",
    "LONG_NUMBER_DIGITS",
    "MAX_RECORD_BYTES",
    "REWARDS_FILE_NAME",
    "STATE_FILE_NAME",
    "TRACE_FILE_NAME",
    "BundleError",
    "BundleNotFoundError",
    "BundlePathError",
    "BundleReader",
    "BundleRoot",
    "BundleWriter",
    "ConfinedBundle",
    "CorruptBundleError",
    "FoundBundle",
    "FrameDecoder",
    "NotABundleError",
    "OutsideRootError",
    "RecordBuilder",
    "RecordOutOfRangeError",
    "RecordSink",
    "RecordTooLargeError",
    "RecordingError",
    "ReductionError",
    "RewardError",
    "RewardInput",
    "__version__",
    "append_reward",
    "attach_rewards",
    "being_written",
    "canonical_json",
    "canonical_json_with_list",
    "check_reward",
    "classify_stop",
    "decode_varint",
    "delta_tokens",
    "describe_integrity",
    "describe_os_error",
    "encode_record",
    "encode_varint",
    "fast_json",
    "holds_bundles",
    "integrity_name",
    "os_error_reason",
    "payload_id",
    "read_bundle",
    "read_rewards",
    "require_reducible",
    "resolve_trace_file",
    "same_objects_prefix",
    "sampling_settings",
    "thread_bundles",
    "walk_bundles",
    "writer_holds",
    "writer_holds_file",
]
