"""A typed Python client of the rollout-trace agent server (async, with a blocking facade)."""

from ._client import DEFAULT_ADDRESS, AgentClient, Thread, Turn
from ._errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RolloutError,
    RpcError,
    StreamEndedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from ._sync import SyncAgentClient, SyncThread, SyncTurn
from ._tools import ToolHandler, function_tool

__all__ = [
    "DEFAULT_ADDRESS",
    "AgentClient",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RolloutError",
    "RpcError",
    "StreamEndedError",
    "SyncAgentClient",
    "SyncThread",
    "SyncTurn",
    "Thread",
    "ToolHandler",
    "Turn",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "function_tool",
]
