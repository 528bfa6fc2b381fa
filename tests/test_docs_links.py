"""Every relative link of README.md and docs/*.md reaches a file of the repository, and every
`#anchor` a heading of the page it names, as GitHub renders them: a reader following a link
from the README gets somewhere, even after a section moved to another page."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.docs import DOCS, REPO

# [text](target) outside code spans and fences; the target up to its first space or ')'.
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`[^`]*`")
_EXTERNAL = ("http://", "https://", "mailto:")


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), each
    space a hyphen; a code span keeps its text."""
    text = title.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets `-1`, `-2`, … as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            base = slug(match["title"])
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def links(doc: Path) -> list[tuple[int, str]]:
    """(line, target) of each relative link in a page's prose."""
    found = []
    fenced = False
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = match["target"]
            if not target.startswith(_EXTERNAL):
                found.append((number, target))
    return found


def test_slug_matches_githubs_rule() -> None:
    assert slug("One address, many processes: `--workers N`") == (
        "one-address-many-processes---workers-n"
    )
    assert slug("An open thread's memory") == "an-open-threads-memory"
    assert slug("Levers on replay (P1)") == "levers-on-replay-p1"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[here](#title) [gone](#nowhere) [file](missing.md)\n")
    assert links(page) == [(3, "#title"), (3, "#nowhere"), (3, "missing.md")]
    assert anchors(page) == {"title"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for number, target in links(doc):
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        where = f"{doc.relative_to(REPO)}:{number}: {target}"
        if not page.exists() or not page.is_relative_to(REPO):
            broken.append(f"{where} (no such file)")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)
