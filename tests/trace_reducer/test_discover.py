"""The one bundle walk: what counts as a bundle, the order, what is never followed or opened,
and every command that finds bundles under a root finding the same ones through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trace_reducer.bundles import one_turn_bundle
from trace_reducer import bundle_paths, thread_bundles
from trace_reducer.batch._storage import LocalStore
from trace_reducer.bundle import holds_bundles, walk_bundles
from trace_reducer.export._rl import find_bundles
from trace_reducer.reduce._stored import list_recorded

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


def fake_bundle(directory: Path, *, state: bool = False, rewards: bool = False) -> Path:
    directory.mkdir(parents=True)
    (directory / "trace.binpb").write_bytes(b"")
    if state:
        (directory / "state.json").write_text("{}")
    if rewards:
        (directory / "rewards.binpb").write_bytes(b"")
    return directory


def names(root: Path, **options: object) -> list[str]:
    return [os.path.relpath(found.path, root) for found in walk_bundles(root, **options)]  # type: ignore[arg-type]


def test_bundles_come_depth_first_in_name_order_and_a_bundle_is_never_entered(
    tmp_path: Path,
) -> None:
    fake_bundle(tmp_path / "b")
    fake_bundle(tmp_path / "a" / "y")
    fake_bundle(tmp_path / "a" / "x")
    fake_bundle(tmp_path / "a-z")
    # Inside a bundle: never looked at.
    fake_bundle(tmp_path / "b" / "inner")
    (tmp_path / "empty").mkdir()
    (tmp_path / "note.txt").write_text("not a bundle")
    assert names(tmp_path) == ["a/x", "a/y", "a-z", "b"]
    # The order pathlib sorts paths in, and the order an fsspec root is listed in.
    assert names(tmp_path) == sorted(names(tmp_path), key=lambda name: Path(name).parts)
    # The agent's flat layout: only root's own subdirectories.
    assert names(tmp_path, recursive=False) == ["a-z", "b"]
    assert names(tmp_path, recursive=False, accept=lambda name: name.startswith("a")) == ["a-z"]


def test_times_come_from_the_files_found(tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path / "one", state=True, rewards=True)
    os.utime(bundle / "trace.binpb", (100, 100))
    os.utime(bundle / "state.json", (200, 200))
    os.utime(bundle / "rewards.binpb", (300, 300))
    fake_bundle(tmp_path / "two")
    one, two = walk_bundles(tmp_path)
    assert (one.name, one.trace_mtime, one.state_mtime, one.rewards_mtime) == (
        "one",
        100,
        200,
        300,
    )
    assert (two.state_mtime, two.rewards_mtime) == (None, None)


def test_no_symlink_is_followed_and_no_fifo_is_opened(tmp_path: Path) -> None:
    outside = fake_bundle(tmp_path / "outside" / "elsewhere", state=True)
    root = tmp_path / "root"
    root.mkdir()
    fake_bundle(root / "good")
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    (root / "linked-tree").symlink_to(outside.parent, target_is_directory=True)
    linked_file = root / "linked-file"
    linked_file.mkdir()
    (linked_file / "trace.binpb").symlink_to(outside / "trace.binpb")
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trace.binpb")
    state_link = fake_bundle(root / "state-link")
    (state_link / "state.json").symlink_to(outside / "state.json")
    # A FIFO opened for reading would block this test until its timeout.
    assert names(root) == ["good", "state-link"]
    assert next(f for f in walk_bundles(root) if f.name == "state-link").state_mtime is None
    # For the callers that report such a bundle as unreadable: there, with no trace time.
    irregular = {f.name: f.trace_mtime for f in walk_bundles(root, irregular=True)}
    assert set(irregular) == {"fifo", "good", "linked-file", "state-link"}
    assert irregular["fifo"] is None
    assert irregular["linked-file"] is None


def test_an_unlistable_directory_is_reported_and_passed_over(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root lists every directory")
    fake_bundle(tmp_path / "a")
    locked = tmp_path / "locked"
    fake_bundle(locked / "inside")
    locked.chmod(0)
    try:
        warnings: list[str] = []
        assert names(tmp_path, warn=warnings.append) == ["a"]
        assert len(warnings) == 1
        assert "cannot list" in warnings[0]
        assert "locked" in warnings[0]
    finally:
        locked.chmod(0o700)


def test_a_root_of_bundles_is_one_that_holds_some_or_nothing_at_all(tmp_path: Path) -> None:
    assert holds_bundles(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert not holds_bundles(tmp_path)
    fake_bundle(tmp_path / "notes" / "bundle")
    assert holds_bundles(tmp_path)


def test_every_caller_finds_the_same_bundles(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    made = sorted(one_turn_bundle(root, thread_id=f"thread_{n:032x}") for n in range(3))
    outside = one_turn_bundle(tmp_path / "outside", thread_id="thread_" + "f" * 32)
    (root / "20990101T000000Z-thread_link").symlink_to(outside, target_is_directory=True)
    fifo = root / "20990101T000000Z-thread_fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trace.binpb")
    expected = [str(path) for path in made]
    assert [str(path) for path in bundle_paths(root)] == expected  # --replay-from ROOT
    assert [str(path) for path in find_bundles([root])] == expected  # export-rl ROOT
    assert [summary.bundle_name for summary in list_recorded(root)] == [p.name for p in made]
    assert [str(path) for path in thread_bundles(root, "thread_" + "0" * 32)] == expected[:1]
    assert thread_bundles(root, "thread_link") == []
    assert thread_bundles(root, "thread_fifo") == []
    # reduce-all and list (and the served viewer, which lists through list) see the FIFO too,
    # and report it as a bundle that cannot be read.
    found = [entry.location for entry in LocalStore(str(root)).discover(print)]
    assert found == [*expected, str(fifo)]
    listed = subprocess.run(
        [TRACE_REDUCER, "list", str(root), "--json", "--sort", "started"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    runs = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(run["bundle"] for run in runs) == sorted(found)
    assert {run["bundle"]: run["status"] for run in runs}[str(fifo)] == "unreadable"
