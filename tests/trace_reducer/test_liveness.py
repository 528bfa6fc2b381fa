"""A bundle's writer holds its file locked: readers tell a run being written from one whose
writer is gone (killed, or its recording failed), however long either has been quiet."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1 import state_pb2
from tests.trace_reducer.bundles import BundleBuilder, user_item
from tests.trace_reducer.conftest import TRACE_REDUCER
from trace_reducer import follow_bundle
from trace_reducer.batch._listing import list_runs
from trace_reducer.bundle import (
    LIVE_WINDOW,
    BundleWriter,
    being_written,
    writer_holds_file,
)
from trace_reducer.view import _watch

_AN_HOUR_AGO = 3600.0


def _writer(root: Path, thread_id: str = "thr_quiet") -> BundleWriter:
    """A bundle with a turn under way, its writer still open."""
    bundle = BundleBuilder(root, thread_id)
    bundle.turn("turn-1", [user_item("answer once")])
    return bundle.writer


def _quiet(writer: BundleWriter) -> None:
    """As if nothing had been written for an hour."""
    past = os.stat(writer.file_path).st_mtime - _AN_HOUR_AGO
    os.utime(writer.file_path, (past, past))


def test_the_rule() -> None:
    now = 1_000_000.0
    old = now - LIVE_WINDOW - 1
    recent = now - 1
    assert being_written(True, old, now)
    assert being_written(True, None, now)
    assert being_written(False, recent, now)
    assert being_written(None, recent, now)
    assert not being_written(False, old, now)
    assert not being_written(None, old, now)
    assert not being_written(None, None, now)
    assert not being_written(False, recent, now, window=0.5)


def test_a_writer_holds_its_file_until_it_closes_fails_or_is_abandoned(tmp_path: Path) -> None:
    closed = _writer(tmp_path, "thr_closed")
    assert writer_holds_file(closed.file_path) is True
    closed.close()
    assert writer_holds_file(closed.file_path) is False

    abandoned = _writer(tmp_path, "thr_abandoned")
    assert writer_holds_file(abandoned.file_path) is True
    abandoned.abandon()
    assert writer_holds_file(abandoned.file_path) is False

    failed = _writer(tmp_path, "thr_failed")
    failed._fail()
    # The file is still open, but nothing more will be written to it.
    assert not failed.closed
    assert writer_holds_file(failed.file_path) is False
    failed.abandon()


def test_a_writer_killed_with_sigkill_holds_nothing(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from trace_reducer.bundle import BundleWriter\n"
            "writer = BundleWriter.create(sys.argv[1], 'thr_killed')\n"
            "print(writer.file_path, flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        path = Path(child.stdout.readline().strip())
        assert writer_holds_file(path) is True
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert writer_holds_file(path) is False


def test_no_lock_is_seen_through_a_symbolic_link(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    link = tmp_path / "link.binpb"
    link.symlink_to(writer.file_path)
    assert writer_holds_file(link) is None
    writer.close()


async def _follow(path: Path) -> list[_watch.WatchUpdate]:
    return [update async for update in follow_bundle(path)]


async def test_a_watch_ends_when_the_writer_is_gone(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _quiet(writer)
    writer.abandon()
    async with asyncio.timeout(30):
        updates = await _follow(writer.file_path)
    last = updates[-1]
    assert last.final
    assert last.records_read == writer.record_count
    assert last.trace.integrity.status == state_pb2.INTEGRITY_STATUS_UNCLOSED
    assert not last.trace.recording_complete
    assert "the recording stopped without completing (no writer holds it open)" in (
        last.trace.integrity.detail
    )


async def test_a_quiet_bundle_whose_writer_is_there_is_followed_to_its_footer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _writer(tmp_path)
    _quiet(writer)
    monkeypatch.setattr(_watch, "WRITER_CHECK_INTERVAL", 0.0)
    checked = asyncio.Event()
    checks = 0
    check_writer = _watch._Follower.check_writer

    def counted(follower: _watch._Follower, window: float) -> None:
        nonlocal checks
        check_writer(follower, window)
        checks += 1
        if checks == 5:
            checked.set()

    monkeypatch.setattr(_watch._Follower, "check_writer", counted)
    follow = asyncio.create_task(_follow(writer.file_path))
    async with asyncio.timeout(30):
        await checked.wait()
        # Five looks at a bundle quiet for an hour, and it is still followed: its writer is here.
        assert not follow.done()
        writer.close()
        updates = await follow
    assert updates[-1].final
    assert updates[-1].trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert all(not update.final for update in updates[:-1])


def test_watch_of_a_bundle_whose_writer_died_ends_with_exit_1(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _quiet(writer)
    writer.abandon()
    result = subprocess.run(
        [str(TRACE_REDUCER), "watch", str(writer.bundle_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(
        f"trace-reducer: {writer.bundle_dir}: UNCLOSED ({writer.record_count} records, "
    )
    assert line.endswith("the recording stopped without completing (no writer holds it open)")


def test_list_and_reduce_all_call_a_quiet_run_live_while_its_writer_holds_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "traces"
    writer = _writer(root)
    _quiet(writer)

    def listed_status() -> str:
        [run] = list_runs(str(root)).runs
        return str(json.loads(run.json_line())["status"])

    def reduce_all() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(TRACE_REDUCER), "reduce-all", str(root)], capture_output=True, text=True
        )

    assert listed_status() == "live"
    held = reduce_all()
    assert held.returncode == 0, held.stdout + held.stderr
    assert f"live (still being written, not reduced): {writer.bundle_dir}" in held.stdout
    assert not (writer.bundle_dir / "state.json").exists()

    writer.abandon()
    assert listed_status() == "running"
    gone = reduce_all()
    assert gone.returncode == 0, gone.stdout + gone.stderr
    state = json.loads((writer.bundle_dir / "state.json").read_text())
    assert state["integrity"]["status"] == "INTEGRITY_STATUS_UNCLOSED"
