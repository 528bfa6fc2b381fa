"""The log of an aiohttp server we run: a request its HTTP parser refuses is one warning line
that quotes none of the request's bytes."""

from __future__ import annotations

import logging

__all__ = ["http_server_logger"]

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
