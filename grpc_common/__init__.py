"""gRPC plumbing both servers share: rich errors, access, keepalive, serving, signals."""

from ._access import AccessControl
from ._errors import ERROR_DOMAIN, abort, error_status
from ._keepalive import Keepalive
from ._server import GrpcServer, split_listen
from ._signals import install_signal_handlers

__all__ = [
    "ERROR_DOMAIN",
    "AccessControl",
    "GrpcServer",
    "Keepalive",
    "abort",
    "error_status",
    "install_signal_handlers",
    "split_listen",
]
