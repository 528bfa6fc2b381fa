"""The server's log: one line per record on stderr, as text or JSON, with time and level."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
# Loggers of libraries whose INFO lines are noise next to the server's own.
_QUIET_LIBRARIES = ("grpc",)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record was logged with (`extra={"fields": {...}}`)."""
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _time(record: logging.LogRecord) -> str:
    seconds = int(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds)) + f"{record.msecs:03.0f}Z"


def _error(record: logging.LogRecord) -> str:
    """An exception as one line: operators get the cause, never a traceback."""
    error = record.exc_info[1] if record.exc_info else None
    return f"{type(error).__name__}: {error}" if error is not None else ""


# What makes a value need quotes: whitespace (what str.isspace() calls so, every code point
# alike), a quote or an equals sign. One search, where a Python step a character was most of a
# log line's cost.
_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _text_value(value: Any) -> str:
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """`2026-11-30T09:15:02.120Z INFO  agent_server.telemetry: turn ended status=COMPLETED`;
    `process` fields (a worker's `worker=K`) follow every line's own."""

    def __init__(self, process: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._process = dict(process or {})

    def format(self, record: logging.LogRecord) -> str:
        # Loaded at the first line, not with this module: `serve --help` builds its parser from
        # agent_server.config, which imports this module, and must not load the reducer.
        from trace_reducer.bundle._shown import one_line

        line = f"{_time(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = {**fields_of(record), **self._process}
        pairs = [f"{key}={_text_value(value)}" for key, value in fields.items()]
        if pairs:
            line += " " + " ".join(pairs)
        error = _error(record)
        # A provider's error message, a client's model name, a request path: anyone's text.
        # Its control characters are written as escapes (`\x1b`, `\n`): a line of the log
        # is one line, and one read in a terminal cannot drive it (retitle it, clear it).
        return one_line(f"{line} ({error})" if error else line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the record's fields and
    the `process` fields (a worker's `worker`)."""

    def __init__(self, process: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._process = dict(process or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in {**fields_of(record), **self._process}.items():
            entry.setdefault(key, value)
        error = _error(record)
        if error:
            entry["error"] = error
        # Loaded at the first line, as TextFormatter's one_line. json.dumps escapes the C0
        # controls only: DEL and C1 (U+009B, a CSI) were written raw, where the text log
        # escapes them, and drove a terminal that showed the log.
        from trace_reducer.bundle._shown import json_shown

        return json_shown(json.dumps(entry, ensure_ascii=False, default=str))


def configure(
    level: str = "info",
    fmt: str = "text",
    stream: TextIO | None = None,
    process: dict[str, Any] | None = None,
) -> None:
    """Send every log record at `level` or above to stderr in `fmt` ("text" or "json"), each
    with the `process` fields (which of `--workers` logged it)."""
    # Neither format shows a record's thread or process, so no record looks them up (each
    # line would pay for it; a server writes a few a turn).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else TextFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet = max(logging.WARNING, root.level)
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)
