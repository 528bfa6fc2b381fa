"""Text from a bundle or a name under a root, as a terminal is to show it: its control
characters written as escapes.

A bundle's strings (a model name, a thread id, a conversation's text) and the names under a
root are anyone's. Printed as they are, an escape sequence in one drives the reader's terminal
(sets its title, clears it, writes its clipboard), and a newline in a name prints a line of its
own: a forged `FAILED:` line in a summary, a forged row in a table.
"""

from __future__ import annotations

import re

__all__ = ["json_shown", "one_line", "shown_lines"]

# C0 controls, DEL and C1 controls: what a terminal acts on instead of showing.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROLS_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Of those, what json.dumps(ensure_ascii=False) leaves raw: it escapes C0 only.
_RAW_IN_JSON = re.compile("[\x7f-\x9f]")


def _escape(match: re.Match[str]) -> str:
    char = match[0]
    return _NAMED.get(char) or f"\\x{ord(char):02x}"


def one_line(text: str) -> str:
    """text with every control character, newlines and tabs too, as an escape (`\\n`,
    `\\x1b`): for a line of ours that names or quotes it."""
    return _CONTROLS.sub(_escape, text)


def shown_lines(text: str) -> str:
    """text with its control characters as escapes but for newlines and tabs: for text that is
    lines of its own (a conversation's)."""
    return _CONTROLS_BUT_LINES.sub(_escape, text)


def json_shown(encoded: str) -> str:
    """JSON text (json.dumps with ensure_ascii=False) with DEL and the C1 controls written as
    `\\u` escapes too, as json.dumps writes the C0 ones: the same JSON value, and no raw
    character a terminal acts on (U+009B is a CSI, as ESC [ is)."""
    return _RAW_IN_JSON.sub(lambda match: f"\\u{ord(match[0]):04x}", encoded)
