"""The long commands' progress away from a terminal: reduce-all's lines (at the start, every
few seconds, at the end), the exports' silence, nothing with --quiet."""

from __future__ import annotations

import io

from trace_reducer.cli._progress import LineProgress, NoProgress, progress_for


def test_lines_open_advance_and_close_a_run() -> None:
    stream = io.StringIO()
    # Every advance outlasts an interval of 0: each prints, as each 5 s would.
    progress = LineProgress(stream, "reduce-all", interval=0)
    progress.started(4)
    progress.advanced(1)
    progress.advanced(3, bad=1)
    progress.finished()
    progress.finished()  # idempotent: an error path and the normal end both call it
    lines = stream.getvalue().splitlines()
    assert [line.split(" bundles")[0] for line in lines] == [
        "reduce-all: 0/4",
        "reduce-all: 1/4",
        "reduce-all: 4/4",
        "reduce-all: 4/4",
    ]
    assert lines[-1].endswith("1 corrupt or failed")


def test_between_intervals_only_the_start_and_the_end_print() -> None:
    stream = io.StringIO()
    progress = LineProgress(stream, "reduce-all", interval=3600)
    progress.started(2)
    progress.advanced(2)
    progress.finished()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("reduce-all: 0/2 bundles (0%)")
    assert lines[1].startswith("reduce-all: 2/2 bundles (100%)")


def test_each_command_and_stream_gets_its_display() -> None:
    pipe = io.StringIO()
    assert isinstance(progress_for("reduce-all", lines_into_pipes=True, stream=pipe), LineProgress)
    # The exports into a pipe: what a script reads is only what the command has to say.
    assert isinstance(progress_for("export-rl", stream=pipe), NoProgress)
    assert isinstance(progress_for("x", quiet=True, lines_into_pipes=True, stream=pipe), NoProgress)
