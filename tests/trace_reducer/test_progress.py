"""The long commands' progress into a pipe: lines only for runs that outlast the interval
(reduce-all's eager lines at the start and the end too), nothing with --quiet."""

from __future__ import annotations

import io

from trace_reducer.cli._progress import LineProgress, NoProgress, progress_for


def test_a_short_run_into_a_pipe_prints_nothing() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, "export-rl", interval=3600)
    progress.started(3)
    progress.advanced(3)
    progress.finished()
    assert stream.getvalue() == ""


def test_a_long_run_prints_as_it_goes_and_closes_with_a_last_line() -> None:
    stream = io.StringIO()
    # Every advance outlasts an interval of 0: each prints, as each 5 s would.
    progress = LineProgress(stream, "export-rl", interval=0)
    progress.started(4)
    progress.advanced(1)
    progress.advanced(3, bad=1)
    progress.finished()
    progress.finished()  # idempotent: an error path and the normal end both call it
    lines = stream.getvalue().splitlines()
    assert [line.split(" bundles")[0] for line in lines] == [
        "export-rl: 1/4",
        "export-rl: 4/4",
        "export-rl: 4/4",
    ]
    assert lines[-1].endswith("1 corrupt or failed")


def test_eager_lines_open_and_close_every_run() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, "reduce-all", interval=3600, eager=True)
    progress.started(2)
    progress.advanced(2)
    progress.finished()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("reduce-all: 0/2 bundles (0%)")
    assert lines[1].startswith("reduce-all: 2/2 bundles (100%)")


def test_quiet_and_pipes_choose_their_display() -> None:
    assert isinstance(progress_for("x", quiet=True, stream=io.StringIO()), NoProgress)
    assert isinstance(progress_for("x", stream=io.StringIO()), LineProgress)
