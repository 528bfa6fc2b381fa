"""The golden corpus reduces to the very bytes it reduced to when it was recorded.

`record.py` made the bundles (forks and forks of forks, rewards, tools, engine tokens, a failed
and an interrupted turn, a torn tail, a corrupt frame, a torn rewards file) and the `state.json`
`trace-reducer reduce` wrote for each before the reducer was restructured; any change to how a
bundle reduces shows up here as a diff.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trace_reducer import STATE_FILE_NAME
from trace_reducer.cli import main as trace_reducer

from .record import BUNDLES, ROOT_MARK, SALVAGE_FILE, STATES

NAMES = sorted(p.name for p in BUNDLES.iterdir())
SALVAGE = set(json.loads(SALVAGE_FILE.read_text()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy: reducing writes beside the bundle, and the committed tree stays as recorded."""
    root = tmp_path_factory.mktemp("golden") / "bundles"
    shutil.copytree(BUNDLES, root)
    return root


def test_the_corpus_has_what_it_promises() -> None:
    states = [json.loads((STATES / f"{name}.json").read_text()) for name in NAMES]
    forks = [s for s in states if "fork" in s]
    parents = {s["fork"]["parent_thread_id"] for s in forks}
    assert any(s["root_thread_id"] in parents for s in forks), "no fork of a fork"
    assert all(s["fork"]["resolved"] for s in forks)
    assert sum(len(s.get("rewards", [])) for s in states) >= 8
    assert any(s.get("tool_calls") for s in states)
    assert any(
        c.get("output_tokens", {}).get("ids") for s in states for c in s["inference_calls"].values()
    )
    integrities = {s["integrity"]["status"] for s in states}
    assert {"INTEGRITY_STATUS_TRUNCATED", "INTEGRITY_STATUS_CORRUPT"} <= integrities
    assert SALVAGE


@pytest.mark.parametrize("name", NAMES)
def test_reduce_writes_the_recorded_bytes(corpus: Path, name: str) -> None:
    flags = ["--salvage"] if name in SALVAGE else []
    assert trace_reducer(["reduce", str(corpus / name), *flags]) == 0
    written = (corpus / name / STATE_FILE_NAME).read_bytes()
    written = written.replace(str(corpus).encode(), ROOT_MARK.encode())
    # A change meant to show in state.json: `python -m tests.golden.record --states`, and review.
    assert written == (STATES / f"{name}.json").read_bytes()
