"""Where a client connects and with what token when it is not told: its defaults and the
environment (kept light: `agent-server health` and `--help` read them without loading gRPC)."""

from __future__ import annotations

import os

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_REDUCER_ADDRESS = "127.0.0.1:50052"
# Seconds every unary call may take unless the client or the call says otherwise (None: no
# deadline). Streams (StreamEvents, WatchBundle) have none: they last as long as a thread.
DEFAULT_TIMEOUT = 60.0
ADDRESS_ENV = "ROLLOUT_ADDRESS"
REDUCER_ADDRESS_ENV = "ROLLOUT_REDUCER_ADDRESS"
TOKEN_ENV = "ROLLOUT_TOKEN"  # noqa: S105 - the name of the variable, not a token


def address_from_env(default: str = DEFAULT_ADDRESS, variable: str = ADDRESS_ENV) -> str:
    """The address in the variable, or the default when it is unset or empty."""
    return os.environ.get(variable) or default


def token_from_env(variable: str = TOKEN_ENV) -> str | None:
    """The bearer token in the variable; None when it is unset or empty."""
    return os.environ.get(variable) or None
