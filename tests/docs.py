"""The fenced blocks of README.md and docs/*.md, each with the marker comment above it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOCS", "REPO", "Block", "block", "blocks", "code_blocks", "shell_blocks"]

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")
# `<!-- example: name -->`, `<!-- commands: name -->`, `<!-- usage -->`, `<!-- not run: why -->`.
_MARKER = re.compile(r"^\s*<!-- (?P<kind>[a-z][a-z ]*?)(?::\s*(?P<value>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (kind and value) and its text."""

    doc: Path
    line: int  # of the opening fence, 1-based
    language: str
    kind: str | None
    value: str | None
    text: str

    @property
    def where(self) -> str:
        doc = self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc
        return f"{doc}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order (an indented fence counts too)."""
    lines = doc.read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent = opening["indent"]
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "".join(f"{line.removeprefix(indent)}\n" for line in lines[index + 1 : end])
        marker = _MARKER.match(lines[index - 1]) if index else None
        found.append(
            Block(
                doc=doc,
                line=index + 1,
                language=opening["language"],
                kind=marker["kind"] if marker else None,
                value=marker["value"] if marker else None,
                text=body,
            )
        )
        index = end + 1
    return found


def shell_blocks(docs: list[Path] = DOCS) -> list[Block]:
    return [found for doc in docs for found in blocks(doc) if found.language in SHELL_LANGUAGES]


def code_blocks(docs: list[Path] = DOCS) -> list[Block]:
    """The blocks that name their language: commands, code, configuration, queries (a fence
    without one holds a picture of files or bytes, not something to run)."""
    return [found for doc in docs for found in blocks(doc) if found.language]


def block(name: str, language: str, doc: str = "README.md", kind: str = "example") -> str:
    """The text of the block marked `<!-- kind: name -->` in doc, in that language."""
    matches = [
        found
        for found in blocks(REPO / doc)
        if found.kind == kind and found.value == name and found.language == language
    ]
    assert len(matches) == 1, f"{doc} has {len(matches)} {language} blocks marked {kind}: {name}"
    return matches[0].text
