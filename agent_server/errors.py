"""Domain errors of the agent server, each with its gRPC status code and ErrorInfo reason."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.descriptor import EnumDescriptor

import grpc_common

# The agent's statuses: each AgentError carries its own; the rest is INTERNAL.
ERRORS = grpc_common.ErrorMapping(log=logging.getLogger("agent_server.service"))


class AgentError(grpc_common.RpcStatusError):
    """An error a client caused or must know about; never a provider failure."""


class InvalidArgumentError(AgentError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class MissingThreadIdError(InvalidArgumentError):
    reason = "MISSING_THREAD_ID"


class MissingTurnIdError(InvalidArgumentError):
    reason = "MISSING_TURN_ID"


class EmptyInputError(InvalidArgumentError):
    reason = "EMPTY_INPUT"


class InputTooLargeError(InvalidArgumentError):
    reason = "INPUT_TOO_LARGE"


class InvalidModelError(InvalidArgumentError):
    reason = "INVALID_MODEL"


class InstructionsTooLargeError(InvalidArgumentError):
    reason = "INSTRUCTIONS_TOO_LARGE"


class MetadataTooLargeError(InvalidArgumentError):
    reason = "METADATA_TOO_LARGE"


class InvalidPageTokenError(InvalidArgumentError):
    reason = "INVALID_PAGE_TOKEN"


class InvalidToolError(InvalidArgumentError):
    reason = "INVALID_TOOL"


class EmptyToolOutputsError(InvalidArgumentError):
    reason = "EMPTY_TOOL_OUTPUTS"


class UnknownCallIdError(InvalidArgumentError):
    reason = "UNKNOWN_CALL_ID"


class DuplicateToolOutputError(InvalidArgumentError):
    reason = "DUPLICATE_TOOL_OUTPUT"


class ToolOutputTooLargeError(InvalidArgumentError):
    reason = "TOOL_OUTPUT_TOO_LARGE"


class InvalidSamplingError(InvalidArgumentError):
    reason = "INVALID_SAMPLING"


class InvalidStatusFilterError(InvalidArgumentError):
    reason = "INVALID_STATUS_FILTER"


def unknown_enum(descriptor: EnumDescriptor, value: int, field: str) -> str:
    """Why value cannot be field's, or '' when it is one of the enum's numbers.

    proto3 keeps an enum number it does not know as it came (a client built against another
    .proto, or a bug), and the server would otherwise treat it as unset: a setting silently
    not applied, a filter that matches nothing."""
    if value in descriptor.values_by_number:
        return ""
    known = ", ".join(f"{v.name} ({v.number})" for v in descriptor.values)
    return f"{field} {value} is not a {descriptor.name}; known values: {known}"


class UnknownProviderError(InvalidArgumentError):
    reason = "UNKNOWN_PROVIDER"


class InvalidForkCountError(InvalidArgumentError):
    reason = "INVALID_FORK_COUNT"


class InvalidGroupIdError(InvalidArgumentError):
    reason = "INVALID_GROUP_ID"


class InvalidFlushWindowError(InvalidArgumentError):
    reason = "INVALID_FLUSH_WINDOW"


class InvalidRewardError(InvalidArgumentError):
    """A reward refused by trace_reducer.check_reward; the reason is its own."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # type: ignore[misc]


class ItemNotFoundError(AgentError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "ITEM_NOT_FOUND"


class RecordingOffError(AgentError):
    reason = "RECORDING_OFF"


class RewardsUnavailableError(AgentError):
    """The rewards sidecar cannot take the reward (unwritable, or corrupt)."""

    def __init__(self, message: str, reason: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.reason = reason  # type: ignore[misc]
        self.code = code  # type: ignore[misc]


class TurnNotFoundError(AgentError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "TURN_NOT_FOUND"


class TurnNotAwaitingToolOutputsError(AgentError):
    reason = "TURN_NOT_AWAITING_TOOL_OUTPUTS"


class ThreadNotFoundError(AgentError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "THREAD_NOT_FOUND"


class ThreadClosedError(AgentError):
    reason = "THREAD_CLOSED"


class ThreadActiveError(AgentError):
    reason = "THREAD_ACTIVE"


class BundlePathDeniedError(AgentError):
    """A bundle path outside the trace root, or through a symbolic link."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "BUNDLE_PATH_DENIED"


class InvalidBundlePathError(InvalidArgumentError):
    reason = "INVALID_BUNDLE_PATH"


class RecordedThreadUnreadableError(AgentError):
    """The recorded thread's bundle cannot be continued (not a bundle, corrupt, no thread)."""

    reason = "RECORDED_THREAD_UNREADABLE"


class TurnAlreadyRunningError(AgentError):
    reason = "TURN_ALREADY_RUNNING"


class TurnNotRunningError(AgentError):
    reason = "TURN_NOT_RUNNING"


class RecordingStartFailedError(AgentError):
    reason = "RECORDING_START_FAILED"

    def __init__(self, cause: str) -> None:
        super().__init__(f"failed to start rollout recording: {cause}")


class EventsOutOfRangeError(AgentError):
    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "EVENT_INDEX_OUT_OF_RANGE"


class ShuttingDownError(AgentError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "SHUTTING_DOWN"

    def __init__(self) -> None:
        super().__init__("the agent server is shutting down")
