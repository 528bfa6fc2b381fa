"""How both clients open a channel: credentials, keepalive, retries of the idempotent calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import grpc

from ._defaults import url_address
from ._errors import RolloutError

# Calls that change nothing are retried on UNAVAILABLE (a server restarting, a connection
# refused), with backoff, by gRPC itself: its service config, so every attempt counts against
# the one deadline of the call.
_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
HEALTH_CHECK = ("grpc.health.v1.Health", "Check")
# A ping every minute on a channel with calls open keeps a long StreamEvents or WatchBundle
# alive through load balancers and NAT tables that drop idle connections, and finds a dead
# peer within `_KEEPALIVE_TIMEOUT_MS`. Both servers accept pings this often.
_KEEPALIVE_TIME_MS = 60_000
_KEEPALIVE_TIMEOUT_MS = 20_000


def credentials(tls: bool | str | Path) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS trusting the system's CAs (True) or those in a PEM file."""
    if tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    path = Path(tls)
    try:
        roots = path.read_bytes()
    except OSError as error:
        raise RolloutError(f"cannot read the CA certificates {path}: {error.strerror}") from error
    return grpc.ssl_channel_credentials(root_certificates=roots)


def service_config(retried: Sequence[tuple[str, str]]) -> str:
    """The gRPC service config retrying these (service, method) calls."""
    names = [{"service": service, "method": method} for service, method in retried]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": _RETRY_POLICY}]})


def open_channel(
    address: str, tls: bool | str | Path, retried: Sequence[tuple[str, str]]
) -> grpc.aio.Channel:
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(retried)),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ]
    secure = credentials(tls)
    if secure is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, secure, options=options)


class Connection:
    """What both clients share: one channel, the token sent with every call, the default
    deadline of unary calls, and `async with` closing the channel."""

    def __init__(
        self,
        address: str,
        tls: bool | str | Path,
        retried: Sequence[tuple[str, str]],
        token: str | None,
        timeout: float | None,
    ) -> None:
        in_url = url_address(address)
        if in_url is not None:
            host, https = in_url
            with_tls = " and tls=True" if https else ""
            raise ValueError(
                f"the address is the server's HOST:PORT, not a URL: give {host!r}{with_tls}"
            )
        self.address = address
        self.timeout = timeout
        self._channel = open_channel(address, tls, retried)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls still running are cancelled."""
        await self._channel.close(None)
