"""`trace-reducer reduce-all` over a local tree, in its process pool, as a user runs it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format

from rollout.trace.v1 import record_pb2, state_pb2
from tests.batch.conftest import (
    TRACE_REDUCER,
    Corpus,
    age,
    bundles_under,
    expected_state,
    many_copies,
    reduce_all,
)
from tests.trace_reducer.process import running
from trace_reducer import BundleWriter, read_bundle
from trace_reducer.batch._storage import integrity_from_state_json


def _counts(stdout: str) -> dict[str, int]:
    """The summary's `bundles:` and `integrity:` counts by name."""
    counts: dict[str, int] = {}
    for line in stdout.splitlines():
        if line.strip().startswith(("bundles:", "integrity:")):
            for name, value in re.findall(r"([A-Za-z ]+?) ([\d,]+)(?:,|$)", line.split(":", 1)[1]):
                counts[name.strip()] = int(value.replace(",", ""))
    return counts


def test_reduces_every_bundle_and_summarises(traces: Path, corpus: Corpus) -> None:
    bundles = bundles_under(traces)
    assert len(bundles) == corpus.threads
    result = reduce_all(str(traces), "--jobs", "2")
    assert result.returncode == 0, result.stderr
    for bundle in bundles:
        assert (bundle / "state.json").read_text() == expected_state(bundle)
    counts = _counts(result.stdout)
    assert counts["reduced"] == counts["CLEAN"] == len(bundles)
    assert counts["failed"] == counts["corrupt"] == counts["live"] == 0
    assert f"reduce-all: {len(bundles)} bundles under {traces}" in result.stdout
    assert "(pool, 2 workers)" in result.stdout
    records = sum(read_bundle_records(b) for b in bundles)
    assert f"({records:,} records, " in result.stdout
    assert len(re.findall(r"^  slowest: ", result.stdout, re.M)) == 5
    # Not a terminal: plain progress lines, the last one complete.
    progress = [line for line in result.stderr.splitlines() if line.startswith("reduce-all:")]
    assert progress[-1].startswith(f"reduce-all: {len(bundles)}/{len(bundles)} bundles (100%)")
    assert "Traceback" not in result.stderr


def read_bundle_records(bundle: Path) -> int:
    with read_bundle(bundle) as reader:
        for _ in reader.batches():
            pass
        return reader.integrity.records_read


def test_skips_up_to_date_bundles_unless_forced(traces: Path) -> None:
    bundles = bundles_under(traces)
    assert reduce_all(str(traces)).returncode == 0
    written = {b: (b / "state.json").stat().st_mtime_ns for b in bundles}

    again = reduce_all(str(traces))
    assert again.returncode == 0, again.stderr
    assert _counts(again.stdout)["up to date"] == len(bundles)
    assert _counts(again.stdout)["reduced"] == 0
    assert {b: (b / "state.json").stat().st_mtime_ns for b in bundles} == written

    # A bundle whose trace changed after its state.json is reduced again, and only it.
    changed = bundles[3]
    future = time.time() + 60
    os.utime(changed / "trace.binpb", (future, future))
    third = reduce_all(str(traces))
    assert _counts(third.stdout)["reduced"] == 1
    assert (changed / "state.json").stat().st_mtime_ns != written[changed]
    assert all((b / "state.json").stat().st_mtime_ns == written[b] for b in bundles if b != changed)

    forced = reduce_all(str(traces), "--force")
    assert _counts(forced.stdout)["reduced"] == len(bundles)


def _frames(trace: Path) -> list[tuple[int, int]]:
    """(offset, length) of every frame of a trace.binpb."""
    data = trace.read_bytes()
    frames, offset = [], 0
    while offset < len(data):
        size, shift, pos = 0, 0, offset
        while True:
            byte = data[pos]
            size |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if byte < 0x80:
                break
        frames.append((offset, pos - offset + size))
        offset = pos + size
    return frames


def _damaged_copy(source: Path, root: Path, name: str) -> Path:
    target = root / "damaged" / name
    shutil.copytree(source, target)
    return target


def _contradicting_bundle(root: Path) -> Path:
    """A bundle whose records contradict each other: a turn of a thread never started."""
    writer = BundleWriter.create(root / "damaged", "thread-contradicting")
    writer.append(
        record_pb2.TraceRecord(turn_started=record_pb2.TurnStarted(turn=1, thread=7, turn_id="t"))
    )
    writer.close()
    return writer.bundle_dir


def test_damaged_bundles_are_reported_and_never_stop_the_batch(traces: Path) -> None:
    good = bundles_under(traces)
    source = good[0]
    trace_bytes = (source / "trace.binpb").read_bytes()
    frames = _frames(source / "trace.binpb")

    unclosed = _damaged_copy(source, traces, "unclosed")
    (unclosed / "trace.binpb").write_bytes(trace_bytes[: frames[-1][0]])
    truncated = _damaged_copy(source, traces, "truncated")
    (truncated / "trace.binpb").write_bytes(trace_bytes[: frames[-2][0] + 3])
    corrupt = _damaged_copy(source, traces, "corrupt")
    flipped = bytearray(trace_bytes)
    flipped[frames[5][0] + 4] ^= 0x10
    (corrupt / "trace.binpb").write_bytes(bytes(flipped))
    empty = _damaged_copy(source, traces, "empty")
    (empty / "trace.binpb").write_bytes(b"")
    contradicting = _contradicting_bundle(traces)
    # Its state.json cannot be written (a directory is in the way).
    unwritable = _damaged_copy(source, traces, "unwritable")
    (unwritable / "state.json").mkdir()
    for bundle in (unclosed, truncated, corrupt, empty, contradicting, unwritable):
        age(bundle / "trace.binpb", 3600)
    # Still being written: no footer yet, and touched just now.
    live = _damaged_copy(source, traces, "live")
    (live / "trace.binpb").write_bytes(trace_bytes[: frames[-1][0]])

    result = reduce_all(str(traces), "--jobs", "2")
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr + result.stdout
    counts = _counts(result.stdout)
    assert counts["reduced"] == len(good) + 2
    assert (counts["corrupt"], counts["live"], counts["failed"]) == (1, 1, 3)
    assert (counts["CLEAN"], counts["UNCLOSED"], counts["TRUNCATED"], counts["CORRUPT"]) == (
        len(good),
        1,
        1,
        1,
    )
    for bundle in [*good, unclosed, truncated]:
        assert (bundle / "state.json").read_text() == expected_state(bundle)
    for bundle in (corrupt, live, empty, contradicting):
        assert not (bundle / "state.json").exists()

    with read_bundle(corrupt) as reader:
        for _ in reader.batches():
            pass
        damage = reader.integrity
    assert damage.bad_frame_offset == frames[5][0]
    assert (
        f"CORRUPT at byte {damage.bad_frame_offset} (seq {damage.bad_frame_seq}): {corrupt}: "
        in result.stdout
    )
    assert f"live (still being written, not reduced): {live}" in result.stdout
    assert f"FAILED: {empty}: not a trace bundle" in result.stdout
    assert f"FAILED: {contradicting}: records contradict each other: seq 2" in result.stdout
    assert f"FAILED: {unwritable}: Is a directory: " in result.stdout
    assert not list(unwritable.glob(".state.json.*"))
    assert "--salvage reduces them" in result.stdout

    # Salvaged, the corrupt bundle reduces up to the damage; only the unreadable fail now.
    shutil.rmtree(empty)
    shutil.rmtree(contradicting)
    shutil.rmtree(unwritable)
    salvaged = reduce_all(str(traces), "--salvage")
    assert salvaged.returncode == 0, salvaged.stdout
    assert _counts(salvaged.stdout)["salvaged"] == 1
    assert "(salvaged)" in salvaged.stdout
    state = json_format.Parse((corrupt / "state.json").read_text(), state_pb2.RolloutTrace())
    assert state.integrity.status == state_pb2.INTEGRITY_STATUS_CORRUPT
    assert state.integrity.records_read == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/missing"], "no such file or directory"),
        (["{tmp}/file.txt"], "not a directory"),
        (["{tmp}/empty-dir"], "no trace bundles"),
        (["{tmp}/empty-dir", "--storage-option", "novalue"], "expects KEY=VALUE"),
        (["{tmp}/empty-dir", "--jobs", "0"], "must be from 1 to 1024, got 0"),
        (["{tmp}/empty-dir", "--jobs", "99999999999999999999"], "must be from 1 to 1024"),
        (["{tmp}/empty-dir", "--jobs", "many"], "expects a whole number, got 'many'"),
        (["{tmp}/a-bundle"], "is a bundle, not a root of bundles"),
        (["{tmp}/empty-dir", "--tables", ""], "the path is empty"),
        (["{tmp}/empty-dir", "--live-window", "nan"], "must be a finite number from 0"),
        (["{tmp}/empty-dir", "--live-window", "-5"], "must be a finite number from 0"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "file.txt").write_text("not bundles")
    (tmp_path / "empty-dir" / "sub").mkdir(parents=True)
    (tmp_path / "empty-dir" / "sub" / "notes.txt").write_text("nothing here")
    (tmp_path / "a-bundle").mkdir()
    (tmp_path / "a-bundle" / "trace.binpb").write_bytes(b"")
    result = reduce_all(*(a.format(tmp=tmp_path) for a in args))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # One line of ours (argparse's errors come after its usage text, as for every command).
    lines = [line for line in result.stderr.splitlines() if line.startswith("trace-reducer")]
    assert len(lines) == 1, result.stderr


def _wait_for(condition: object, deadline: float, what: str) -> None:
    assert callable(condition)
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_ctrl_c_stops_cleanly_without_half_written_state(traces: Path, tmp_path: Path) -> None:
    root = many_copies(traces, tmp_path, 3000)
    tables = tmp_path / "tables"
    # A terminal's Ctrl-C goes to the whole foreground process group: driver and workers.
    process = subprocess.Popen(
        [TRACE_REDUCER, "reduce-all", str(root), "--jobs", "2", "--tables", str(tables)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(
            lambda: any(root.glob("*/state.json")), time.monotonic() + 120, "a first state.json"
        )
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr
    assert "interrupted after" in stdout
    states = list(root.glob("*/state.json"))
    assert 0 < len(states) < 3000
    assert not list(root.rglob("*.tmp"))
    for state in states:
        assert state.read_text() == expected_state(state.parent)
    # No tables from half a batch, and no staging left behind.
    assert not tables.exists() or not list(tables.iterdir())
    assert "tables: not written" in stdout


def _descendants(pid: int) -> dict[int, int]:
    """pid -> parent pid of every process below pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    below: dict[int, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in below:
                below[child] = ppid
                frontier.append(child)
    return below


def _pool_workers(process: subprocess.Popen[str]) -> list[int]:
    """A command's pool workers: the forkserver's children, the command's grandchildren."""
    assert process.poll() is None, process.communicate()
    return [pid for pid, parent in _descendants(process.pid).items() if parent != process.pid]


def _with_a_worker_killed(
    argv: list[str | Path], started: Callable[[], bool], stop: signal.Signals = signal.SIGKILL
) -> tuple[int, str, str]:
    """Run argv (a pool of 2), SIGKILL (or `stop`) one of its workers once `started`, as the
    OOM killer would, and wait for it: its exit code, stdout and stderr."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(
            lambda: started() and _pool_workers(process), time.monotonic() + 120, "the pool at work"
        )
        os.kill(_pool_workers(process)[0], stop)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, stdout, stderr


def test_a_worker_killed_mid_batch_does_not_stop_it(traces: Path, tmp_path: Path) -> None:
    root = many_copies(traces, tmp_path, 3000)
    code, stdout, stderr = _with_a_worker_killed(
        [TRACE_REDUCER, "reduce-all", str(root), "--jobs", "2"],
        lambda: any(root.glob("*/state.json")),
    )
    assert code == 0, stdout + stderr
    assert "the pool was restarted 1 time\n" in stderr
    assert _counts(stdout)["reduced"] == 3000
    assert len(list(root.glob("*/state.json"))) == 3000


def test_a_worker_killed_mid_export_does_not_stop_it(traces: Path, tmp_path: Path) -> None:
    root = many_copies(traces, tmp_path, 3000)
    out = tmp_path / "export"
    code, stdout, stderr = _with_a_worker_killed(
        [TRACE_REDUCER, "export-rl", str(root), "--jobs", "2", "--format", "jsonl", "--out", out],
        lambda: True,
    )
    # Was: `internal error: BrokenProcessPool`, exit 1, no file (export-rl had a pool of its own).
    assert code == 0, stdout + stderr
    assert "the pool was restarted 1 time\n" in stderr
    assert "internal error" not in stderr
    assert "not exported" not in stderr
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert f"wrote {len(lines):,} samples" in stdout
    assert len({json.loads(line)["bundle"] for line in lines}) == len(lines)


def test_a_worker_sent_sigterm_finishes_the_batch(traces: Path, tmp_path: Path) -> None:
    # SIGTERM stops a run through its driver (a service manager sends it to every process):
    # was, a worker given one died mid-bundle and the pool was restarted.
    root = many_copies(traces, tmp_path, 3000)
    code, stdout, stderr = _with_a_worker_killed(
        [TRACE_REDUCER, "reduce-all", str(root), "--jobs", "2"],
        lambda: any(root.glob("*/state.json")),
        signal.SIGTERM,
    )
    assert code == 0, stdout + stderr
    assert "restarted" not in stderr
    assert _counts(stdout)["reduced"] == 3000
    assert not list(root.rglob("*.tmp"))


@pytest.mark.parametrize("command", ["reduce-all", "export-rl"])
@pytest.mark.parametrize("group", [False, True], ids=["driver", "group"])
def test_sigterm_mid_batch_stops_it_as_ctrl_c_does(
    traces: Path, tmp_path: Path, command: str, group: bool
) -> None:
    # Was: SIGTERM (kill, a job scheduler) killed the driver alone; its pool's workers waited
    # for good on pipes no one read, holding the command's stdout and stderr open, so a
    # pipeline or a caller reading its output never ended. And sent to every process (a
    # service manager stopping the service), it killed the workers mid-bundle: a
    # `.state.json.<hex>.tmp` left behind, the pool restarted.
    root = many_copies(traces, tmp_path, 3000)
    out = tmp_path / "export"
    argv: list[str | Path] = [TRACE_REDUCER, command, root, "--jobs", "2"]
    started: Callable[[], bool] = lambda: any(root.glob("*/state.json"))  # noqa: E731
    if command == "export-rl":
        argv += ["--format", "jsonl", "--out", out]
        started = lambda: True  # noqa: E731 - its first output is its last
    stdout_file, stderr_file = tmp_path / "stdout", tmp_path / "stderr"
    with stdout_file.open("w") as stdout, stderr_file.open("w") as stderr:
        process = subprocess.Popen(
            argv, stdout=stdout, stderr=stderr, text=True, start_new_session=group
        )
    workers: list[int] = []
    try:
        _wait_for(
            lambda: started() and len(_pool_workers(process)) == 2,
            time.monotonic() + 120,
            "the pool at work",
        )
        workers = _pool_workers(process)
        if group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        left = [pid for pid in workers if running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    said = stdout_file.read_text() + stderr_file.read_text()
    assert left == [], f"workers still running after their command exited: {left}"
    assert code == 143, said
    assert "Traceback" not in said
    assert "restarted" not in said
    assert not list(root.rglob("*.tmp"))
    for state in root.glob("*/state.json"):
        assert state.read_text() == expected_state(state.parent)
    if command == "reduce-all":
        assert "interrupted after" in said
    else:
        assert not out.exists()  # no export of part of the bundles


def test_progress_bar_on_a_terminal(traces: Path) -> None:
    count = len(bundles_under(traces))
    controller, terminal = pty.openpty()
    # A terminal 120 columns wide (a fresh pty reports 0 x 0).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        [TRACE_REDUCER, "reduce-all", str(traces), "--jobs", "1"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
    )
    os.close(terminal)
    output = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 60)
        assert ready, "no output from reduce-all for 60 s"
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=60) == 0
    text = output.decode("utf-8", "replace")
    assert re.search(rf"reduce-all: 100%\|.*\| {count}/{count} \[", text), text
    assert "bundle/s" in text
    # The bar replaces the plain lines; the summary still follows.
    assert f"reduce-all: {count}/{count} bundles (100%)" not in text
    assert f"reduce-all: {count} bundles under" in text


def _corrupt_copy(traces: Path) -> Path:
    source = bundles_under(traces)[0]
    corrupt = traces / "damaged" / "corrupt"
    shutil.copytree(source, corrupt)
    data = bytearray((corrupt / "trace.binpb").read_bytes())
    data[_frames(corrupt / "trace.binpb")[5][0] + 4] ^= 0x10
    (corrupt / "trace.binpb").write_bytes(bytes(data))
    age(corrupt / "trace.binpb", 3600)
    return corrupt


@pytest.mark.parametrize("salvaged_by", ["reduce-all --salvage", "reduce --salvage"])
def test_a_corrupt_bundle_salvaged_before_still_fails_a_run_that_does_not_salvage(
    salvaged_by: str, traces: Path, tmp_path: Path
) -> None:
    good = bundles_under(traces)
    corrupt = _corrupt_copy(traces)
    assert reduce_all(str(traces)).returncode == 1
    if salvaged_by == "reduce-all --salvage":
        assert reduce_all(str(traces), "--salvage").returncode == 0
    else:
        done = subprocess.run(
            [TRACE_REDUCER, "reduce", str(corrupt), "--salvage"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    assert (corrupt / "state.json").exists()

    every = len(good) + 1
    plain = reduce_all(str(traces))
    with_tables = reduce_all(str(traces), "--tables", str(tmp_path / "tables"))
    for result in (plain, with_tables):
        # Every bundle found is counted by integrity, up to date or not, tables or not.
        assert result.returncode == 1, result.stdout + result.stderr
        counts = _counts(result.stdout)
        assert counts["up to date"] == every
        assert (counts["CLEAN"], counts["CORRUPT"]) == (len(good), 1)
        assert re.search(
            rf"^  CORRUPT at byte \d+ \(seq \d+\): {corrupt}: .*\(salvaged before\)$",
            result.stdout,
            re.M,
        )
        assert "  corrupt bundles salvaged before are still corrupt: --salvage" in result.stdout

    salvaging = reduce_all(str(traces), "--salvage")
    assert salvaging.returncode == 0, salvaging.stdout
    assert (_counts(salvaging.stdout)["up to date"], _counts(salvaging.stdout)["CORRUPT"]) == (
        every,
        1,
    )
    assert "(salvaged before)" in salvaging.stdout
    assert "still corrupt" not in salvaging.stdout


def test_up_to_date_integrities_come_from_list_s_index_when_it_is_current(traces: Path) -> None:
    good = bundles_under(traces)
    corrupt = _corrupt_copy(traces)
    assert reduce_all(str(traces), "--salvage").returncode == 0
    listed = subprocess.run(
        [TRACE_REDUCER, "list", str(traces)], capture_output=True, text=True, check=False
    )
    assert listed.returncode == 0, listed.stderr
    # A state.json changed behind the index's back (its time kept): the index is believed, so
    # it was not read. A CORRUPT bundle's state.json is read still, for the damage it names.
    stale = good[0] / "state.json"
    written = stale.stat()
    stale.write_text("{}")
    os.utime(stale, ns=(written.st_atime_ns, written.st_mtime_ns))

    indexed = reduce_all(str(traces))
    assert indexed.returncode == 1, indexed.stdout + indexed.stderr
    counts = _counts(indexed.stdout)
    assert (counts["up to date"], counts["reduced"]) == (len(good) + 1, 0)
    assert (counts["CLEAN"], counts["CORRUPT"]) == (len(good), 1)
    assert re.search(rf"^  CORRUPT at .*: {corrupt}: .*\(salvaged before\)$", indexed.stdout, re.M)

    # Without the index every up-to-date state.json is read for its integrity: the one that
    # cannot be is rebuilt from its bundle.
    (traces / ".trace-list.json").unlink()
    read = reduce_all(str(traces))
    assert read.returncode == 1, read.stdout + read.stderr
    counts = _counts(read.stdout)
    assert (counts["up to date"], counts["reduced"]) == (len(good), 1)
    assert (counts["CLEAN"], counts["CORRUPT"]) == (len(good), 1)
    assert stale.read_text() == expected_state(good[0])


def test_an_integrity_is_read_without_parsing_the_rest_of_its_state(traces: Path) -> None:
    assert reduce_all(str(traces)).returncode == 0
    for bundle in bundles_under(traces):
        text = (bundle / "state.json").read_text()
        whole = json_format.Parse(text, state_pb2.RolloutTrace()).integrity
        assert integrity_from_state_json(text.encode()) == whole
        # Laid out otherwise (one line, keys in another order), it is parsed whole.
        other = json.dumps(dict(reversed(json.loads(text).items())))
        assert integrity_from_state_json(other.encode()) == whole


_READ_UNDER_A_CAP = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (160 << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
from trace_reducer.batch._storage import LocalStore
try:
    print(LocalStore(sys.argv[1]).read_head(sys.argv[1]).integrity.records_read)
except ValueError:
    print("refused")
"""


def test_an_integrity_is_read_in_bounded_memory_however_large_the_state(tmp_path: Path) -> None:
    # A state.json of 256 MiB (sparse: no disk used) read by a process allowed 160 MiB: the
    # integrity at its end is found a chunk at a time; without one, the file is refused (its
    # bundle is then reduced again), not read whole (was: the whole file read, MemoryError).
    state = tmp_path / "state.json"
    at_end = (
        b'{\n  "integrity": {\n    "recordsRead": "7",\n'
        b'    "status": "INTEGRITY_STATUS_CLEAN"\n  }\n}\n'
    )
    for tail, expected in ((at_end, "7"), (b"", "refused")):
        with state.open("wb") as file:
            file.truncate(256 << 20)
            file.seek(256 << 20)
            file.write(tail)
        done = subprocess.run(
            [sys.executable, "-c", _READ_UNDER_A_CAP, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.stdout.strip() == expected, done.stderr


def test_tables_where_none_can_be_written_are_refused_before_any_work(
    traces: Path, tmp_path: Path
) -> None:
    # Was: every bundle reduced (its state.json written), then "cannot write the tables",
    # exit 1: hours of a large batch for a slip in the path.
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for tables, said in (
        (a_file, "not a directory"),
        (a_file / "tables", f"not a directory: {a_file}"),
        (fifo, "not a directory"),
        (tmp_path / ("n" * 300) / "tables", "File name too long"),
    ):
        result = reduce_all(str(traces), "--tables", str(tables))
        assert result.returncode == 2, (tables, result.stderr)
        assert [line for line in result.stderr.splitlines() if line.startswith("trace-")] == [
            f"trace-reducer: --tables {tables}: {said}"
        ], result.stderr
        assert result.stdout == ""
    assert not list(traces.rglob("state.json"))
    assert a_file.read_text() == "keep me"


def _plant_states_not_their_own(bundles: list[Path]) -> dict[Path, str]:
    """Three state.json files newer than their trace.binpb that are not its reduction, and the
    words the summary gives each."""
    (bundles[0] / "state.json").write_text("not json at all\n")
    (bundles[1] / "state.json").write_text((bundles[2] / "state.json").read_text())
    (bundles[3] / "state.json").write_text(
        '{\n  "integrity": {\n    "status": "INTEGRITY_STATUS_CLEAN"\n  }\n}\n'
    )
    return {
        bundles[0]: "is not one reduce writes",
        bundles[1]: "is another bundle's (its trace id differs)",
        bundles[3]: "names no trace",
    }


def test_a_state_json_newer_than_its_bundle_but_not_its_reduction_is_rebuilt(
    traces: Path,
) -> None:
    # Was: newer than trace.binpb was enough. Garbage was rebuilt only when no index of
    # `list` vouched for it; another bundle's state.json, or a stub naming an integrity, was
    # counted up to date and kept, and `list` and the viewer showed the other bundle's run.
    bundles = bundles_under(traces)
    assert reduce_all(str(traces)).returncode == 0
    for listed_first in (False, True):
        planted = _plant_states_not_their_own(bundles)
        if listed_first:
            listed = subprocess.run(
                [TRACE_REDUCER, "list", str(traces), "--json"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert listed.returncode == 0, listed.stderr
            runs = {json.loads(line)["bundle"]: json.loads(line) for line in listed.stdout.split()}
            shown = runs[str(bundles[1])]["thread_id"]
            assert shown == read_bundle_header(bundles[1]).thread_id
        again = reduce_all(str(traces))
        assert again.returncode == 0, again.stdout + again.stderr
        counts = _counts(again.stdout)
        assert (counts["reduced"], counts["up to date"]) == (3, len(bundles) - 3), again.stdout
        said = re.findall(r"^  reduced again, its state\.json (.*): (.*)$", again.stdout, re.M)
        assert sorted(said, key=lambda pair: pair[1]) == sorted(
            ((why, str(bundle)) for bundle, why in planted.items()), key=lambda pair: pair[1]
        )
        for bundle in planted:
            assert (bundle / "state.json").read_text() == expected_state(bundle)


def read_bundle_header(bundle: Path) -> record_pb2.Header:
    with read_bundle(bundle) as reader:
        return next(iter(reader)).header


def test_a_rewards_sidecar_it_cannot_read_is_said_as_export_rl_says_it(tmp_path: Path) -> None:
    # Was: a FIFO or a symbolic link as rewards.binpb was said only in state.json's integrity
    # detail; the summary said CLEAN, exit 0, and nothing else, where export-rl warned.
    from tests.trace_reducer.bundles import one_turn_bundle

    root = tmp_path / "root"
    fifo, link = one_turn_bundle(root / "fifo"), one_turn_bundle(root / "link")
    os.mkfifo(fifo / "rewards.binpb")
    (tmp_path / "elsewhere.binpb").write_bytes(b"")
    (link / "rewards.binpb").symlink_to(tmp_path / "elsewhere.binpb")
    result = reduce_all(str(root))
    assert result.returncode == 0, result.stderr
    warned = [line.strip() for line in result.stdout.splitlines() if "warning:" in line]
    assert warned == [
        f"warning: clean bundle {fifo}: rewards.binpb is not a regular file",
        f"warning: clean bundle {link}: rewards.binpb is a symbolic link, which is not followed",
    ]
    exported = subprocess.run(
        [
            TRACE_REDUCER,
            "export-rl",
            str(root),
            "--format",
            "jsonl",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr
    for bundle, line in ((fifo, warned[0]), (link, warned[1])):
        # The same words, the bundle named by its directory's name as export-rl names it.
        assert line.replace(str(bundle), bundle.name) in exported.stderr
