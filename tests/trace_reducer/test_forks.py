"""Finding a fork's parent bundle (trace_reducer.reduce._forks.BundleForkResolver)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from trace_reducer import replay_bundle

from .bundles import BundleBuilder, fork_of, one_turn_bundle, user_item

UNRELATED = 5


def test_a_parent_named_by_the_fork_is_opened_without_listing_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: every fork listed its whole root before opening the parent it names, so reducing a
    # root of N forks (reduce-all, view ROOT -o, a cold list) read N * N entries: at 1,728
    # rollouts, 40 % of a fork's reduction; at 100,000 in one root, hours.
    root = tmp_path / "root"
    for number in range(UNRELATED):
        one_turn_bundle(root, thread_id=f"lone-{number}")
    parent = BundleBuilder(root, "parent")
    shared = user_item("the parent's words")
    parent.turn("turn-1", [shared])
    fork = fork_of(root, parent.close(), [shared], "child")
    listed: list[str] = []
    scandir = os.scandir

    def spy(path: Any = ".") -> Any:
        listed.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", spy)
    trace = replay_bundle(fork)
    assert trace.fork.resolved
    assert not trace.integrity.fork_unresolved
    assert os.fspath(root) not in listed


def test_a_parent_renamed_is_still_found_by_its_thread(tmp_path: Path) -> None:
    # The listing stays the fallback: a parent whose bundle is no longer where the fork says
    # (a copy under another time stamp) is found by its thread id.
    root = tmp_path / "root"
    parent = BundleBuilder(root, "parent")
    shared = user_item("the parent's words")
    parent.turn("turn-1", [shared])
    parent_dir = parent.close()
    fork = fork_of(root, parent_dir, [shared], "child")
    parent_dir.rename(root / "20000101T000000Z-parent")
    trace = replay_bundle(fork)
    assert trace.fork.resolved
    assert not trace.integrity.fork_unresolved
