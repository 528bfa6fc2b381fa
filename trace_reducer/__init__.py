"""Trace bundles of rollout-trace: the format, its writer and reader, and the reducer."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bundle import (
        FORMAT_VERSION,
        LENGTH_REASONS,
        LOGPROBS_INCLUDE,
        MAX_RECORD_BYTES,
        REWARDS_FILE_NAME,
        STATE_FILE_NAME,
        TRACE_FILE_NAME,
        BundleError,
        BundleNotFoundError,
        BundlePathError,
        BundleReader,
        BundleWriter,
        CorruptBundleError,
        FrameDecoder,
        NotABundleError,
        OutsideRootError,
        RecordBuilder,
        RecordingError,
        RecordOutOfRangeError,
        RecordSink,
        RecordTooLargeError,
        ReductionError,
        RewardError,
        RewardInput,
        __version__,
        append_reward,
        attach_rewards,
        canonical_json,
        check_reward,
        classify_stop,
        decode_varint,
        delta_tokens,
        describe_integrity,
        describe_os_error,
        encode_record,
        encode_varint,
        integrity_name,
        payload_id,
        read_bundle,
        read_rewards,
        require_reducible,
        resolve_trace_file,
        sampling_settings,
        thread_bundles,
    )
    from .export import (
        RL_FORMATS,
        ExportConfigError,
        Exported,
        ExportedBundle,
        ExportError,
        ExportFailedError,
        build_sample,
        export_otlp,
        export_rl,
    )
    from .reduce import (
        CHAT_API,
        REPLAY_IGNORED_FIELDS,
        REPLAY_IGNORED_ITEM_FIELDS,
        Difference,
        RecordedCall,
        RecordedSummary,
        RecordedThread,
        Reducer,
        RequestNotFoundError,
        RunDiff,
        StoredThread,
        TurnNotEndedError,
        TurnNotRecordedError,
        body_diff,
        bundle_paths,
        chat_items,
        chat_messages,
        comparable_request,
        diff_runs,
        expand_request_items,
        iter_state_json,
        list_recorded,
        load_recorded,
        nested_deeper_than,
        read_recorded,
        read_recorded_thread,
        replay_bundle,
        request_body,
        request_difference,
        state_to_json,
        write_state_json,
    )
    from .view import VIEW_FILE_NAME, WatchUpdate, follow_bundle, write_view


# Nothing is imported until first used. `trace-reducer`'s entry point (trace_reducer.cli.main) is
# inside this package, so this module runs before it can catch anything: were the reducer loaded
# here, a Ctrl-C in the first quarter second of every command would end in a traceback.
_SUBPACKAGES = ("bundle", "export", "reduce", "view")


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in __all__:
        # Each public name is in exactly one subpackage's __all__ (the OTLP export's names load
        # the optional `otel` extra there, on first use).
        for subpackage in _SUBPACKAGES:
            module = importlib.import_module(f"{__name__}.{subpackage}")
            if name in getattr(module, "__all__", ()):
                value = getattr(module, name)
                globals()[name] = value
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


__all__ = [
    "CHAT_API",
    "FORMAT_VERSION",
    "LENGTH_REASONS",
    "LOGPROBS_INCLUDE",
    "MAX_RECORD_BYTES",
    "REPLAY_IGNORED_FIELDS",
    "REPLAY_IGNORED_ITEM_FIELDS",
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
    "Difference",
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
    "RecordedCall",
    "RecordedSummary",
    "RecordedThread",
    "RecordingError",
    "Reducer",
    "ReductionError",
    "RequestNotFoundError",
    "RewardError",
    "RewardInput",
    "RunDiff",
    "StoredThread",
    "TurnNotEndedError",
    "TurnNotRecordedError",
    "WatchUpdate",
    "__version__",
    "append_reward",
    "attach_rewards",
    "body_diff",
    "build_sample",
    "bundle_paths",
    "canonical_json",
    "chat_items",
    "chat_messages",
    "check_reward",
    "classify_stop",
    "comparable_request",
    "decode_varint",
    "delta_tokens",
    "describe_integrity",
    "describe_os_error",
    "diff_runs",
    "encode_record",
    "encode_varint",
    "expand_request_items",
    "export_otlp",
    "export_rl",
    "follow_bundle",
    "integrity_name",
    "iter_state_json",
    "list_recorded",
    "load_recorded",
    "nested_deeper_than",
    "payload_id",
    "read_bundle",
    "read_recorded",
    "read_recorded_thread",
    "read_rewards",
    "replay_bundle",
    "request_body",
    "request_difference",
    "require_reducible",
    "resolve_trace_file",
    "sampling_settings",
    "state_to_json",
    "thread_bundles",
    "write_state_json",
    "write_view",
]
