"""The aiohttp servers we run (the gateway, the served viewer): a request its HTTP parser refuses
is one warning line that quotes none of the request's bytes, a connection that sends no
request is closed, and one bound to loopback without a token answers only loopback's names."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

__all__ = [
    "HTTP_IDLE_SECONDS",
    "addressed_to_loopback",
    "http_runner_options",
    "http_server_logger",
    "is_loopback",
]

# A connection that sends no whole request head within this long of opening, or of its last
# answer, is closed. aiohttp's own bound is an hour: a client trickling a header line every few
# seconds (slowloris) held its connection, and a descriptor, that long.
HTTP_IDLE_SECONDS = 60.0

_QUOTES = ("'", '"')


def _reason(error: BaseException) -> str:
    """The parser's reason without the bytes it quotes: aiohttp's message goes on to show the
    offending line (`b'Authorization: Bearer …'`), which may hold a client's token."""
    message = str(getattr(error, "message", "") or "")
    first = message.strip().splitlines()[0] if message.strip() else ""
    cut = min((i for i in (first.find(q) for q in _QUOTES) if i >= 0), default=len(first))
    if first[cut - 1 : cut] == "b":
        cut -= 1
    reason = first[:cut].rstrip(" :,(")
    return reason or type(error).__name__


class _ParserErrorFilter(logging.Filter):
    """aiohttp logs a refused request as an ERROR with its traceback (and at DEBUG for a first
    request in another protocol); either becomes `refused a malformed HTTP request from PEER:
    REASON (400)` at WARNING, since the fault is the client's, not the server's."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = "refused a malformed HTTP request from %s: %s (%d)"
        record.args = (peer, _reason(error), error.code or 400)
        record.exc_info = None
        record.exc_text = None
        if record.levelno > logging.WARNING:
            record.levelno = logging.WARNING
            record.levelname = logging.getLevelName(logging.WARNING)
        return True


def http_server_logger(name: str) -> logging.Logger:
    """The logger to hand `web.AppRunner(logger=…)`: `name`'s, with parser refusals rewritten."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _ParserErrorFilter) for f in logger.filters):
        logger.addFilter(_ParserErrorFilter())
    return logger


def http_runner_options(name: str, idle_timeout: float = HTTP_IDLE_SECONDS) -> dict[str, Any]:
    """What `web.AppRunner(app, **…)` takes for a server clients we do not control reach: a
    client that goes away cancels its handler, no access log (an address may carry a token),
    parser refusals logged by `http_server_logger(name)`, and `idle_timeout` (seconds) for a
    request head to arrive, on a fresh connection or a kept-alive one (aiohttp's keep-alive
    timer, which runs from the connection's start and from each answer, and closes only a
    connection waiting for a request)."""
    return {
        "handler_cancellation": True,
        "access_log": None,
        "logger": http_server_logger(name),
        "keepalive_timeout": idle_timeout,
    }


def is_loopback(host: str) -> bool:
    """Whether host (a name or an address, IPv6 in brackets or not) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def addressed_to_loopback(host_header: str | None) -> bool:
    """Whether a request's `Host` names loopback (`localhost`, `*.localhost`, 127.0.0.0/8,
    `[::1]`, any port). A server on loopback without a token is reached by other names only
    through DNS rebinding: a web page whose own name the attacker points at 127.0.0.1 talks
    to it as its own origin, and could read its answers (the viewer's runs, the gateway's
    sessions) and spend the gateway's upstream key. No browser sends a request without a
    `Host`, so a request without one is let through."""
    if host_header is None:
        return True
    name = host_header.strip()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".").lower()
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)
