"""The page of two runs compared (`trace-reducer view A --diff B`): `diff`'s report as HTML."""

from __future__ import annotations

import html
import os
from pathlib import Path

from ..reduce._diff import diff_report, diff_runs
from ._view import _PLACEHOLDER, _asset, write_page

__all__ = ["DIFF_FILE_NAME", "render_diff", "write_diff"]

DIFF_FILE_NAME = "diff.html"

# The page (`_diff.html`): nothing on it runs or loads. Every text from a bundle is escaped,
# and its policy allows no script, frame, image or connection at all.


def _diff_line(line: str) -> str:
    kind = "hunk" if line.startswith("@@") else ""
    if not kind and line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
        kind = "add" if line.startswith("+") else "del"
    text = html.escape(line)
    return f'<span class="{kind}">{text}</span>' if kind else text + "\n"


def render_diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> str:
    """The page of `diff_runs(a, b)`; raises BundleError as diff_runs does."""
    result = diff_runs(a, b)
    lines = diff_report(result, str(a), str(b))
    body_start = len(lines) - len(result.first.request_diff) if result.first else len(lines)
    head, request_diff = lines[:body_start], lines[body_start:]
    runs = "<br>".join(f'<span class="run">{html.escape(line)}</span>' for line in head[:2])
    verdict, *details = head[2:]
    if result.first is not None and result.same_calls:
        # "calls 1-N are the same" (or "call 1 is") comes before the verdict it leads to.
        same, verdict, *details = head[2:]
        details.insert(0, same)
    values = dict(
        TITLE=html.escape(f"diff {Path(a).name} {Path(b).name}"),
        RUNS=runs,
        VERDICT_CLASS="same" if result.first is None else "different",
        VERDICT=html.escape(verdict),
        DETAILS="".join(f"<li>{html.escape(line.strip())}</li>" for line in details),
        REQUEST_DIFF=(
            '<h2>The two request bodies</h2>\n<pre id="request-diff">'
            + "".join(_diff_line(line) for line in request_diff)
            + "</pre>"
            if request_diff
            else ""
        ),
    )
    return _PLACEHOLDER.sub(lambda match: values[match[1]], _asset("_diff.html"))


def write_diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    mode: int = 0o666,
) -> Path:
    """Write the page of two runs compared to output (`mode` less the umask), replacing it
    whole."""
    return write_page(render_diff(a, b), output, mode=mode)
