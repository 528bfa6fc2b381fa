"""bench.tree_ab: each tree's child imports that tree's project, wherever it is run from."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import trace_reducer
from bench.tree_ab import run_in_tree

_THIS_TREE = Path(trace_reducer.__file__).resolve().parents[1]
_REPORT = 'import json, trace_reducer; print(json.dumps({"_from": trace_reducer.__file__, "x": 1}))'


def test_the_child_imports_the_tree_it_was_given_even_from_another_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other-tree"
    shutil.copytree(_THIS_TREE / "trace_reducer", other / "trace_reducer")
    # Run from this checkout, where a plain `python -c` would find its trace_reducer first.
    monkeypatch.chdir(_THIS_TREE)
    assert run_in_tree(other, _REPORT) == {"x": 1}


def test_a_tree_without_the_project_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_THIS_TREE)
    empty = tmp_path / "empty-tree"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="imported trace_reducer from"):
        run_in_tree(empty, _REPORT)
    assert os.getcwd() == str(_THIS_TREE)
