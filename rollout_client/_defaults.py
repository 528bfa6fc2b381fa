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


def url_address(address: str) -> tuple[str, bool] | None:
    """For an address written as an http(s) URL (the gateway's kind, `http://127.0.0.1:8090/v1`),
    the HOST:PORT a gRPC client takes instead and whether the URL asked for TLS (https); None
    for any other address, gRPC's own target schemes (`dns:///`, `unix:`, ...) included. gRPC
    takes such a URL for a host name, and fails as if DNS had. The URL's credentials, path and
    query are left out: they may hold secrets."""
    scheme, found, rest = address.partition("://")
    if not found or scheme.lower() not in ("http", "https"):
        return None
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
    return host or "HOST:PORT", scheme.lower() == "https"
