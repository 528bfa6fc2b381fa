"""bench.tree_ab: each tree's child imports that tree's project, wherever it is run from."""

from __future__ import annotations

import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import trace_reducer
from bench._harness import spawn
from bench.jsonl_peer import write_codex_jsonl
from bench.tree_ab import _F1_CHILD, _P1_CHILD, _P1_CONTENDERS, _instructions, run_in_tree

from .trace_reducer.bundles import one_turn_bundle

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


@pytest.mark.parametrize("repeat", ["0", "2"])
def test_the_p1_child_times_every_contender_best_of_three_or_back_to_back(
    tmp_path: Path, repeat: str
) -> None:
    bundle = str(one_turn_bundle(tmp_path))
    write_codex_jsonl(Path(bundle), tmp_path / "0.jsonl")
    peer_file = str(_THIS_TREE / "bench" / "jsonl_peer.py")
    times = run_in_tree(_THIS_TREE, _P1_CHILD, peer_file, str(tmp_path), repeat, bundle)
    assert set(times) == {f"0 {name}" for name in _P1_CONTENDERS}
    assert all(seconds > 0 for seconds in times.values())


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
# Under valgrind the children run ~50 times slower: 16 s of CPU, which a loaded machine
# stretched past the suite's 60 s default.
@pytest.mark.timeout(300)
def test_instructions_grow_with_the_replays_counted(tmp_path: Path) -> None:
    bundle = str(one_turn_bundle(tmp_path))
    jsonl = tmp_path / "peer.jsonl"
    write_codex_jsonl(Path(bundle), jsonl)
    peer_file = str(_THIS_TREE / "bench" / "jsonl_peer.py")
    args = (peer_file, str(jsonl), bundle, "compact")
    # The two runs side by side: each is one interpreter under valgrind, on a core of its own.
    with ThreadPoolExecutor(max_workers=2) as pool:
        none, some = pool.map(lambda replays: _instructions(_THIS_TREE, *args, replays), "03")
    # Three more replays of a small bundle: more work, and far less than the interpreter's
    # start, which both runs share.
    assert 0 < some - none < none


@pytest.mark.parametrize("stack", ["agent", "aiohttp"])
def test_the_f1_child_reads_every_event_of_every_stream(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_THIS_TREE)
    floor_file = str(_THIS_TREE / "bench" / "provider_floor.py")
    argv = [sys.executable, "-m", "bench.provider_floor", "--serve", "--events", "7"]
    with spawn([*argv, "--interval", "0.001"]) as server:
        out = run_in_tree(_THIS_TREE, _F1_CHILD, floor_file, server.address, stack, "3")
    # Each stream: response.created, the 7 deltas, response.completed.
    assert out["events"] == 3 * (1 + 7 + 1)
    assert out["cpu_us"] > 0
