"""A typed Python client of the rollout-trace agent server (async, with a blocking facade)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._defaults import (
    ADDRESS_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_REDUCER_ADDRESS,
    DEFAULT_TIMEOUT,
    REDUCER_ADDRESS_ENV,
    TOKEN_ENV,
    address_from_env,
    token_from_env,
    url_address,
)

if TYPE_CHECKING:
    from ._client import AgentClient, Thread, Turn
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
    from ._options import CallOptions, ForkOptions, RewardOptions, ThreadOptions, TurnOptions
    from ._reducer import ReducerClient
    from ._sync import SyncAgentClient, SyncThread, SyncTurn
    from ._tools import Tool, ToolHandler, function_tool

# Each name and the module it is in: loaded when first used, so a program that only reads the
# defaults (`agent-server health`, `--help`) does not load gRPC's asyncio stack.
_LAZY = {
    "AgentClient": "_client",
    "Thread": "_client",
    "Turn": "_client",
    "ReducerClient": "_reducer",
    "SyncAgentClient": "_sync",
    "SyncThread": "_sync",
    "SyncTurn": "_sync",
    "CallOptions": "_options",
    "ForkOptions": "_options",
    "RewardOptions": "_options",
    "ThreadOptions": "_options",
    "TurnOptions": "_options",
    "Tool": "_tools",
    "ToolHandler": "_tools",
    "function_tool": "_tools",
    **dict.fromkeys(
        (
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
            "UnauthenticatedError",
            "UnavailableError",
            "UnimplementedError",
        ),
        "_errors",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_ADDRESS",
    "DEFAULT_REDUCER_ADDRESS",
    "DEFAULT_TIMEOUT",
    "REDUCER_ADDRESS_ENV",
    "TOKEN_ENV",
    "AgentClient",
    "CallOptions",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "ForkOptions",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ReducerClient",
    "ResourceExhaustedError",
    "RewardOptions",
    "RolloutError",
    "RpcError",
    "StreamEndedError",
    "SyncAgentClient",
    "SyncThread",
    "SyncTurn",
    "Thread",
    "ThreadOptions",
    "Tool",
    "ToolHandler",
    "Turn",
    "TurnOptions",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "address_from_env",
    "function_tool",
    "token_from_env",
    "url_address",
]
