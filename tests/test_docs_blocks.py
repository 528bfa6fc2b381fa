"""Every code block of README.md and docs/*.md (every fence that names its language: shell,
Python, TypeScript, TOML, YAML, SQL) is run by a test, checked as a usage synopsis, or says why it
cannot run here: a new block without one of these markers fails this test.

The markers, on the line above the fence:

* `<!-- example: NAME -->`, `<!-- command: NAME -->`, `<!-- commands: NAME -->`: a test runs the
  block (it names NAME, and the document, in its source);
* `<!-- usage -->`: a synopsis; `tests/test_cli_help.py` checks each flag it shows against the
  command's parser;
* `<!-- not run: REASON -->`: what it needs that a test machine lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs import DOCS, REPO, Block, code_blocks

RUN = frozenset({"example", "command", "commands"})
THIS = Path(__file__).resolve()


def _test_sources() -> dict[Path, str]:
    tests = REPO / "tests"
    return {
        path: path.read_text()
        for path in sorted(tests.rglob("*.py"))
        if path not in (THIS, tests / "docs.py")
    }


def _named_by(found: Block, sources: dict[Path, str]) -> list[Path]:
    """The test files that name both the block's document and its marker's name."""
    name = found.value or ""
    spellings = (f'"{name}"', f"'{name}'", f": {name} -->")
    document = found.doc.stem  # README.md is usually read through a README constant
    return [
        path
        for path, source in sources.items()
        if document in source and any(spelling in source for spelling in spellings)
    ]


def unaccounted(docs: list[Path], sources: dict[Path, str]) -> list[str]:
    """One line per code block that no test runs and nothing excuses."""
    problems = []
    for found in code_blocks(docs):
        if found.kind in RUN:
            if not found.value:
                problems.append(f"{found.where}: <!-- {found.kind}: --> without a name")
            elif not _named_by(found, sources):
                problems.append(
                    f"{found.where}: no test under tests/ names {found.doc.stem} and "
                    f"{found.kind} {found.value!r}"
                )
        elif found.kind == "usage":
            continue
        elif found.kind == "not run":
            if not (found.value or "").strip():
                problems.append(f"{found.where}: <!-- not run: --> needs its reason")
        else:
            problems.append(
                f"{found.where}: a {found.language} block without a marker (example/command/"
                "commands: NAME run by a test, usage, or not run: REASON)"
            )
    return problems


def test_every_code_block_of_the_docs_is_run_or_excused() -> None:
    problems = unaccounted(DOCS, _test_sources())
    assert not problems, "\n".join(problems)


def test_the_markers_are_kept_to() -> None:
    """Every kind of marker the docs use above a code block is one this test knows (the
    training schemas' markers sit above tables, not code)."""
    kinds = {found.kind for found in code_blocks() if found.kind}
    assert kinds <= RUN | {"usage", "not run"}, kinds


def test_an_unmarked_or_unrun_block_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "guide.md"
    doc.write_text(
        "Run it:\n\n```sh\nmake thing\n```\n\n"
        "<!-- example: named-nowhere -->\n```sh\necho hi\n```\n\n"
        "<!-- example: named -->\n```bash\necho named\n```\n\n"
        "<!-- not run: -->\n```sh\necho why\n```\n\n"
        "<!-- not run: needs a GPU -->\n```sh\nnvidia-smi\n```\n\n"
        "  <!-- usage -->\n  ```sh\n  tool [--flag]\n  ```\n\n"
        "```python\nprint('unmarked too')\n```\n"
        "```\na/\n  b.txt   a picture of files, not code\n```\n"
    )
    sources = {tmp_path / "test_guide.py": "block('named', 'bash', doc='guide.md')"}
    problems = unaccounted([doc], sources)
    assert [problem.split(": ", 1)[0] for problem in problems] == [
        f"{doc}:3",
        f"{doc}:8",
        f"{doc}:18",
        f"{doc}:32",
    ]
    assert "without a marker" in problems[0]
    assert "'named-nowhere'" in problems[1]
    assert "reason" in problems[2]


_FENCE_LINE = re.compile(r"^\s*```")
_ROW = re.compile(r"^\s*\|")
_SEPARATOR = re.compile(r"^\s*\|(\s*:?-+:?\s*\|)+\s*$")


def split_tables(doc: Path) -> list[str]:
    """One line per table row that belongs to no table: a `|` line after a blank line or text
    that is no header (the next line no `|---|` separator), as a row after a blank line in the
    middle of a table is, which Markdown shows as a paragraph of pipes."""
    lines = doc.read_text().splitlines()
    problems = []
    fenced = False
    for index, line in enumerate(lines):
        if _FENCE_LINE.match(line):
            fenced = not fenced
            continue
        if fenced or not _ROW.match(line) or (index and _ROW.match(lines[index - 1])):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if not _SEPARATOR.match(following):
            problems.append(f"{doc.name}:{index + 1}: a table row outside any table")
    return problems


def test_every_table_row_is_in_its_table() -> None:
    # Was: docs/operating.md's metrics table broken by a blank line before its last four rows,
    # and docs/tables.md's `error` column after a paragraph below the `bundles` table.
    problems = [problem for doc in DOCS for problem in split_tables(doc)]
    assert not problems, "\n".join(problems)


def test_a_row_cut_off_from_its_table_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "guide.md"
    doc.write_text(
        "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n\ntext\n| 5 | 6 |\n\n"
        "```\n| not | a table |\n```\n\n| c | d |\n| :-- | --: |\n| 7 | 8 |\n"
    )
    assert split_tables(doc) == [
        "guide.md:5: a table row outside any table",
        "guide.md:8: a table row outside any table",
    ]
