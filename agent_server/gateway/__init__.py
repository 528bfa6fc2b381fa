"""The recording gateway: an OpenAI-compatible HTTP server that records every call it forwards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_server.gateway._settings import GatewaySettings, add_arguments, from_args

if TYPE_CHECKING:
    from agent_server.gateway._server import (
        MAX_CALL_ITEMS,
        SESSION_HEADER,
        THREAD_HEADER,
        CallObserver,
        Gateway,
    )

__all__ = [
    "MAX_CALL_ITEMS",
    "SESSION_HEADER",
    "THREAD_HEADER",
    "CallObserver",
    "Gateway",
    "GatewaySettings",
    "add_arguments",
    "from_args",
]

_SERVER_NAMES = frozenset(
    {"MAX_CALL_ITEMS", "SESSION_HEADER", "THREAD_HEADER", "CallObserver", "Gateway"}
)


def __getattr__(name: str) -> Any:
    # The server (aiohttp's web framework) loads on first use: the `agent-server` command's
    # start-up, which declares the gateway's flags, does without it.
    if name in _SERVER_NAMES:
        from agent_server.gateway import _server

        return getattr(_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
