"""The golden corpus reduces to the very bytes it reduced to when it was recorded.

`record.py` made the bundles (forks and forks of forks, rewards, tools, engine tokens, a failed
and an interrupted turn, a torn tail, a corrupt frame, a torn rewards file) and the `state.json`
`trace-reducer reduce` wrote for each before the reducer was restructured; any change to how a
bundle reduces shows up here as a diff.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trace_reducer import STATE_FILE_NAME
from trace_reducer.cli import main as trace_reducer

from .record import BUNDLES, ROOT_MARK, SALVAGE_FILE, STATES

NAMES = sorted(p.name for p in BUNDLES.iterdir())
SALVAGE = set(json.loads(SALVAGE_FILE.read_text()))


def _copy(parent: Path) -> Path:
    """A copy: reducing writes beside the bundle, and the committed tree stays as recorded."""
    root = parent / "bundles"
    shutil.copytree(BUNDLES, root)
    return root


def _state_of(root: Path, name: str) -> bytes:
    """The state.json written for bundle `name` under root, the root marked as recorded."""
    written = (root / name / STATE_FILE_NAME).read_bytes()
    return written.replace(str(root).encode(), ROOT_MARK.encode())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _copy(tmp_path_factory.mktemp("golden"))


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
    # A change meant to show in state.json: `python -m tests.golden.record --states`, and review.
    assert _state_of(corpus, name) == (STATES / f"{name}.json").read_bytes()


def _reduce_all(root: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = trace_reducer(
        ["reduce-all", str(root), "--salvage", "--live-window", "0", "--jobs", "1"]
    )
    out = capsys.readouterr()
    assert code == 0, out
    return out.out + out.err


def test_reduce_all_writes_what_reduce_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same state.json, byte for byte: rewards attached, forks (of forks) resolved."""
    root = _copy(tmp_path)
    _reduce_all(root, capsys)
    for name in NAMES:
        assert _state_of(root, name) == (STATES / f"{name}.json").read_bytes(), name


def test_a_reward_recorded_after_a_reduce_is_reduced_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(tmp_path)
    _reduce_all(root, capsys)
    assert f"up to date {len(NAMES)}," in _reduce_all(root, capsys)  # nothing changed
    rewarded = root / NAMES[0]
    state = rewarded / STATE_FILE_NAME
    # The reduce happened a minute before the reward (not within one tick of the clock).
    stamp = state.stat()
    os.utime(state, (stamp.st_atime - 60, stamp.st_mtime - 60))
    rewards_before = len(json.loads(state.read_text()).get("rewards", []))
    assert trace_reducer(["reward", str(rewarded), "--name", "late", "--value", "1"]) == 0
    report = _reduce_all(root, capsys)
    assert f"reduced 1, salvaged 0, corrupt 0, live 0, up to date {len(NAMES) - 1}," in report
    rewards = json.loads(state.read_text())["rewards"]
    assert len(rewards) == rewards_before + 1
    assert rewards[-1]["name"] == "late"
    # And it is what `reduce` writes now.
    expected = tmp_path / "expected.json"
    assert trace_reducer(["reduce", str(rewarded), "-o", str(expected)]) == 0
    assert state.read_bytes() == expected.read_bytes()
