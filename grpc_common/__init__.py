"""Serving plumbing the servers share: rich errors, access, keepalive, signals, GC, loop, logs."""

from typing import TYPE_CHECKING

from ._flags import add_access_arguments, add_event_loop_argument, parse_command_line
from ._http_log import (
    HTTP_IDLE_SECONDS,
    addressed_to_loopback,
    http_runner_options,
    http_server_logger,
    is_loopback,
)
from ._limits import raise_open_file_limit
from ._listen import ListenError, listen_error, refuse_address_in_use
from ._loop import (
    EVENT_LOOPS,
    announce,
    default_event_loop,
    discard_stdout,
    event_loop_problem,
    open_standard_fds,
    run_on_loop,
    running_event_loop,
    stdout_failure,
)

if TYPE_CHECKING:
    from ._access import AccessControl, header_secret, variable_name
    from ._collector import tune_collector_for_serving
    from ._errors import (
        ERROR_DOMAIN,
        INTERNAL_REASON,
        ErrorMapping,
        RpcStatusError,
        StatusRule,
        abort,
        error_status,
    )
    from ._keepalive import Keepalive
    from ._metrics import MetricsServer, RpcMetricsInterceptor
    from ._secret import Redactor, StreamRedactor, bearer_token, redact_url, same_secret
    from ._server import DEFAULT_MAX_RECEIVE_BYTES, GrpcServer, split_listen
    from ._signals import install_signal_handlers
    from ._tasks import outlive_caller

# gRPC takes a noticeable time to import: what needs it loads on first use, so that a command
# that only builds its parser (or never serves) does not pay for it.
_LAZY = {
    "AccessControl": "_access",
    "header_secret": "_access",
    "variable_name": "_access",
    "ERROR_DOMAIN": "_errors",
    "INTERNAL_REASON": "_errors",
    "ErrorMapping": "_errors",
    "RpcStatusError": "_errors",
    "StatusRule": "_errors",
    "abort": "_errors",
    "error_status": "_errors",
    "Keepalive": "_keepalive",
    "MetricsServer": "_metrics",
    "RpcMetricsInterceptor": "_metrics",
    "DEFAULT_MAX_RECEIVE_BYTES": "_server",
    "GrpcServer": "_server",
    "split_listen": "_server",
    "install_signal_handlers": "_signals",
    "bearer_token": "_secret",
    "Redactor": "_secret",
    "StreamRedactor": "_secret",
    "redact_url": "_secret",
    "same_secret": "_secret",
    "tune_collector_for_serving": "_collector",
    "outlive_caller": "_tasks",
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
    "DEFAULT_MAX_RECEIVE_BYTES",
    "ERROR_DOMAIN",
    "EVENT_LOOPS",
    "HTTP_IDLE_SECONDS",
    "INTERNAL_REASON",
    "AccessControl",
    "ErrorMapping",
    "GrpcServer",
    "Keepalive",
    "ListenError",
    "MetricsServer",
    "Redactor",
    "RpcMetricsInterceptor",
    "RpcStatusError",
    "StatusRule",
    "StreamRedactor",
    "abort",
    "add_access_arguments",
    "add_event_loop_argument",
    "addressed_to_loopback",
    "announce",
    "bearer_token",
    "default_event_loop",
    "discard_stdout",
    "error_status",
    "event_loop_problem",
    "header_secret",
    "http_runner_options",
    "http_server_logger",
    "install_signal_handlers",
    "is_loopback",
    "listen_error",
    "open_standard_fds",
    "outlive_caller",
    "parse_command_line",
    "raise_open_file_limit",
    "redact_url",
    "refuse_address_in_use",
    "run_on_loop",
    "running_event_loop",
    "same_secret",
    "split_listen",
    "stdout_failure",
    "tune_collector_for_serving",
    "variable_name",
]
