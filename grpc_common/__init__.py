"""gRPC plumbing shared by both servers: rich errors, access control, serving, signals."""

from ._access import AccessControl, header_secret
from ._errors import ERROR_DOMAIN, abort, error_status
from ._server import GrpcServer, split_listen
from ._signals import install_signal_handlers

__all__ = [
    "ERROR_DOMAIN",
    "AccessControl",
    "GrpcServer",
    "abort",
    "error_status",
    "header_secret",
    "install_signal_handlers",
    "split_listen",
]
