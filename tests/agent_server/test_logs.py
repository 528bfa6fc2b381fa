"""The server's log lines: a value quoted exactly when it must be, and the time of each line."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime

from agent_server.logs import JsonFormatter, TextFormatter
from trace_reducer.bundle._shown import one_line

_LINE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z INFO    agent_server: said ?(.*)")


def _line(created: float, **fields: object) -> re.Match[str]:
    record = logging.LogRecord("agent_server", logging.INFO, "x", 1, "said", None, None)
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    record.fields = fields
    line = _LINE.fullmatch(TextFormatter().format(record))
    assert line is not None
    return line


def test_a_value_is_quoted_when_it_holds_whitespace_a_quote_or_an_equals_sign() -> None:
    # Every code point str.isspace() calls whitespace, and a sample of those it does not.
    special = [chr(c) for c in range(0x110000) if chr(c).isspace()] + ['"', "="]
    plain = ["a", "é", "日", "\u200b", "\x00", "_", "-", ":", "{", "\ufeff"]
    for character in special + plain:
        value = f"x{character}y"
        pair = _line(0.0, field=value).group(2)
        quoted = character in special
        shown = json.dumps(value, ensure_ascii=False) if quoted else value
        # Control characters (NUL, NEL among them) as escapes, quoted or not.
        assert pair == f"field={one_line(shown)}"
    assert _line(0.0, field="").group(2) == 'field=""'


def test_a_lines_time_is_its_records_to_the_millisecond() -> None:
    for created in (0.0, 1.0009, 1_765_000_000.123456, 1_765_000_000.9999, 86_399.5):
        stamp = _line(created).group(1)
        moment = datetime.fromtimestamp(int(created), UTC)
        millis = int((created - int(created)) * 1000)
        assert stamp == f"{moment:%Y-%m-%dT%H:%M:%S}.{millis:03d}"


def test_escape_sequences_in_a_message_or_a_value_are_written_as_escapes() -> None:
    """A provider's error (`error=`) with no white space to quote it came out as it was sent:
    `ESC ]0;…BEL` retitled the terminal the log was read in, `ESC [2J` cleared it."""
    record = logging.LogRecord(
        "agent_server", logging.WARNING, "x", 1, "failed on %s", ("/a\x1b[2J\nforged",), None
    )
    record.fields = {"error": "\x1b]0;pwned\x07", "code": "x\x9b31m"}
    line = TextFormatter().format(record)
    assert line.endswith(
        "agent_server: failed on /a\\x1b[2J\\nforged error=\\x1b]0;pwned\\x07 code=x\\x9b31m"
    )
    assert not any(character in line for character in "\x1b\x07\x9b\n")


def test_the_json_log_escapes_every_control_character_the_text_log_does() -> None:
    record = logging.LogRecord(
        "agent_server", logging.WARNING, "x", 1, "failed on %s", ("/a\x9b2J\x1b[2J\n",), None
    )
    record.fields = {"code": "x\x9b31m\x85\x7f", "model": "m\x9d0;pwned\x9c"}
    line = JsonFormatter().format(record)
    # Was: U+009B (a CSI, as ESC [ is), U+009D (an OSC), NEL and DEL written raw, where the text
    # log writes them as escapes; json.dumps escapes only the C0 controls.
    shown = TextFormatter().format(record)
    assert not re.search("[\x00-\x1f\x7f-\x9f]", line)
    assert not re.search("[\x00-\x1f\x7f-\x9f]", shown)
    assert "\\u009b" in line
    assert "\\u009d" in line
    # The same values, read back.
    entry = json.loads(line)
    assert entry["message"] == "failed on /a\x9b2J\x1b[2J\n"
    assert (entry["code"], entry["model"]) == ("x\x9b31m\x85\x7f", "m\x9d0;pwned\x9c")
