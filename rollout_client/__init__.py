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
    "Turn",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
]
