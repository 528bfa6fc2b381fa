"""Keepalive and connection-age settings of both servers, as gRPC channel options."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KEEPALIVE_TIME = 60.0
DEFAULT_KEEPALIVE_TIMEOUT = 20.0
# Clients may ping this often (rollout_client pings every 60 s while a call is open); gRPC's
# default, 5 minutes, answers a client pinging more often with GOAWAY `too_many_pings`.
DEFAULT_MIN_CLIENT_PING_INTERVAL = 30.0
DEFAULT_MAX_CONNECTION_AGE_GRACE = 30.0


@dataclass(frozen=True)
class Keepalive:
    """How a server keeps long streams (StreamEvents, WatchBundle) alive through load balancers
    and NAT tables that drop idle connections, and how it retires old connections.

    time: seconds of silence on a connection before the server pings it; timeout: seconds it
    waits for the answer before it closes the connection. max_connection_age: seconds after
    which a connection is asked to go away (GOAWAY, so a load balancer spreads clients again);
    its calls get max_connection_age_grace seconds more. None: connections live on.
    """

    time: float = DEFAULT_KEEPALIVE_TIME
    timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    min_client_ping_interval: float = DEFAULT_MIN_CLIENT_PING_INTERVAL
    max_connection_age: float | None = None
    max_connection_age_grace: float = DEFAULT_MAX_CONNECTION_AGE_GRACE

    def __post_init__(self) -> None:
        for name in ("time", "timeout", "min_client_ping_interval", "max_connection_age_grace"):
            if not getattr(self, name) > 0:
                raise ValueError(f"keepalive {name.replace('_', ' ')} must be more than 0 seconds")
        if self.max_connection_age is not None and not self.max_connection_age > 0:
            raise ValueError("the max connection age must be more than 0 seconds")

    def options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.keepalive_time_ms", _ms(self.time)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout)),
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                _ms(self.min_client_ping_interval),
            ),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if self.max_connection_age is not None:
            options += [
                ("grpc.max_connection_age_ms", _ms(self.max_connection_age)),
                ("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace)),
            ]
        return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
