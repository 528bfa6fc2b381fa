"""gRPC plumbing shared by both servers: rich errors, access control, serving, signals."""

from typing import TYPE_CHECKING

from ._flags import add_access_arguments

if TYPE_CHECKING:
    from ._access import AccessControl
    from ._errors import ERROR_DOMAIN, abort, error_status
    from ._server import GrpcServer, split_listen
    from ._signals import install_signal_handlers

# gRPC takes a noticeable time to import: what needs it loads on first use, so that a command
# that only builds its parser (or never serves) does not pay for it.
_LAZY = {
    "AccessControl": "_access",
    "ERROR_DOMAIN": "_errors",
    "abort": "_errors",
    "error_status": "_errors",
    "GrpcServer": "_server",
    "split_listen": "_server",
    "install_signal_handlers": "_signals",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ERROR_DOMAIN",
    "AccessControl",
    "GrpcServer",
    "abort",
    "add_access_arguments",
    "error_status",
    "install_signal_handlers",
    "split_listen",
]
