"""The trace-reducer command, run as a real subprocess."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.synthetic import Shape, write_conversation
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc
from rollout.trace.v1 import record_pb2, state_pb2
from tests.commands import interrupt_while_importing
from tests.ports import free_port
from trace_reducer import (
    decode_varint,
    expand_request_items,
    replay_bundle,
    request_body,
    state_to_json,
)
from trace_reducer.cli import EXIT_INTERRUPTED

from .bundles import COMPLETED, BundleBuilder, fork_of, one_turn_bundle, user_item

COMMAND = [sys.executable, "-m", "trace_reducer.cli"]


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=30, check=False
    )


def assert_one_clean_line(stderr: str) -> None:
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_reduce_writes_state_json_and_prints_its_path(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    result = run("reduce", bundle)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.strip() == str(bundle / "state.json")
    trace = json_format.Parse((bundle / "state.json").read_text(), state_pb2.RolloutTrace())
    assert trace.recording_complete
    assert trace == replay_bundle(bundle)


def test_reduce_to_a_path_to_stdout_and_from_the_file(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    expected = state_to_json(replay_bundle(bundle))
    out = tmp_path / "elsewhere.json"
    result = run("reduce", bundle / "trace.binpb", "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert out.read_text() == expected
    assert not (bundle / "state.json").exists()
    result = run("reduce", bundle, "--stdout")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    assert not (bundle / "state.json").exists()
    both = run("reduce", bundle, "--stdout", "-o", out)
    assert both.returncode == 2
    assert "Traceback" not in both.stderr


def test_request_prints_the_exact_body_of_a_call(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    result = run("request", bundle, "call-1")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["input"] == [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "answer once"}],
        }
    ]
    assert result.stdout.encode() == request_body(bundle, "call-1") + b"\n"
    pretty = run("request", bundle, "call-1", "--pretty")
    assert json.loads(pretty.stdout) == body
    assert pretty.stdout.count("\n") > 3
    missing = run("request", bundle, "call-404")
    assert missing.returncode == 2
    assert_one_clean_line(missing.stderr)
    assert "call-404" in missing.stderr
    # Was: only "no inference call 'call-404' in …", which left the user to find the ids.
    assert missing.stderr.rstrip().endswith("; its calls: call-1")


def test_unclosed_and_truncated_warn_and_succeed(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path, close=False)
    result = run("reduce", bundle)
    assert result.returncode == 0
    assert_one_clean_line(result.stderr)
    assert "warning: unclosed" in result.stderr
    assert (bundle / "state.json").exists()

    data = (bundle / "trace.binpb").read_bytes()
    torn = tmp_path / "torn.binpb"
    torn.write_bytes(data[:-3])
    result = run("reduce", torn, "--stdout")
    assert result.returncode == 0
    assert_one_clean_line(result.stderr)
    assert "warning: truncated" in result.stderr
    assert json.loads(result.stdout)["integrity"]["status"] == "INTEGRITY_STATUS_TRUNCATED"


@pytest.mark.parametrize("command", ["reduce", "view"])
def test_a_fork_whose_parent_is_missing_warns_and_succeeds(tmp_path: Path, command: str) -> None:
    parent = BundleBuilder(tmp_path, "parent")
    shared = user_item("the parent's words")
    parent.turn("turn-1", [shared])
    parent_dir = parent.close()
    fork = fork_of(tmp_path, parent_dir, [shared], "child")
    # Found beside the fork, the parent resolves it and nothing is said.
    result = run(command, fork)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""

    parent_dir.rename(tmp_path / "elsewhere")
    result = run(command, fork)
    assert result.returncode == 0, result.stderr
    assert_one_clean_line(result.stderr)
    assert said(result.stderr) == [
        f"warning: unresolved fork {fork}: fork of thread parent: its parent bundle "
        f"{parent_dir.name} was not found, 1 shared item(s) and 1 payload(s) are unresolved "
        "(give the parent bundle to resolve them)"
    ]


def corrupt_copy(tmp_path: Path) -> tuple[Path, int]:
    """A copy of a bundle with a byte flipped inside its 5th frame; returns it and that offset."""
    bundle = one_turn_bundle(tmp_path)
    data = bytearray((bundle / "trace.binpb").read_bytes())
    offset = 0
    for _ in range(4):
        size, start = decode_varint(data, offset) or (0, 0)
        offset = start + size
    data[offset + 3] ^= 0x40
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "trace.binpb").write_bytes(bytes(data))
    return damaged, offset


def test_corrupt_fails_with_offset_and_seq_unless_salvaged(tmp_path: Path) -> None:
    damaged, offset = corrupt_copy(tmp_path)
    result = run("reduce", damaged)
    assert result.returncode == 1
    assert_one_clean_line(result.stderr)
    assert f"byte {offset}" in result.stderr
    assert "seq 5" in result.stderr
    assert not (damaged / "state.json").exists()

    result = run("reduce", damaged, "--salvage")
    assert result.returncode == 0
    assert_one_clean_line(result.stderr)
    assert "warning: corrupt" in result.stderr
    state = json.loads((damaged / "state.json").read_text())
    assert state["integrity"]["records_read"] == "4"
    assert state["recording_complete"] is False


def test_contradicting_records_exit_1_naming_the_seq(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    seq = bundle.append(turn_started=record_pb2.TurnStarted(turn=1, thread=5, turn_id="x"))
    result = run("reduce", bundle.close())
    assert result.returncode == 1
    assert_one_clean_line(result.stderr)
    assert f"seq {seq}: unknown thread ordinal 5" in result.stderr


def bad_inputs(tmp_path: Path) -> dict[str, Path]:
    garbage_dir = tmp_path / "garbage-dir"
    garbage_dir.mkdir()
    (garbage_dir / "notes.txt").write_text("hello")
    (garbage_dir / "data.bin").write_bytes(bytes(range(256)))
    garbage_file = tmp_path / "garbage-file" / "trace.binpb"
    garbage_file.parent.mkdir()
    garbage_file.write_bytes(b"\x07not a protobuf frame at all" * 10)
    empty = tmp_path / "empty" / "trace.binpb"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    torn_header = tmp_path / "torn-header.binpb"
    torn_header.write_bytes((one_turn_bundle(tmp_path / "src") / "trace.binpb").read_bytes()[:9])
    return {
        "missing": tmp_path / "does-not-exist",
        "garbage directory": garbage_dir,
        "garbage trace.binpb": garbage_file.parent,
        "empty file": empty,
        "header cut short": torn_header,
    }


@pytest.mark.parametrize("command", ["reduce", "dump"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    for name, path in bad_inputs(tmp_path).items():
        result = run(command, path)
        assert result.returncode == 2, (name, result.stderr)
        assert_one_clean_line(result.stderr)
        assert result.stderr.startswith("trace-reducer: "), name
        assert str(path) in result.stderr, name
        assert not path.is_dir() or not (path / "state.json").exists()


def test_usage_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    for args in ([], ["explode"], ["reduce"], ["serve", "--listen", "nonsense"]):
        result = run(*args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr
    result = run("serve", "--bundle-root", tmp_path / "nope")
    assert result.returncode == 2
    assert_one_clean_line(result.stderr)
    for limit in ("0", "-5", "lots"):
        result = run("serve", "--bundle-root", tmp_path, "--max-upload-bytes", limit)
        assert result.returncode == 2, limit
        assert "Traceback" not in result.stderr
        assert "--max-upload-bytes" in result.stderr, limit


def test_an_output_where_nothing_can_be_written_is_bad_input(tmp_path: Path) -> None:
    # Was: exit 1 (reduce's "corrupt") once the work was done, where other bad input is 2.
    bundle = one_turn_bundle(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    missing = tmp_path / "no-such-dir"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    long_name = tmp_path / ("n" * 300) / "out"
    for args, said in (
        (["reduce", bundle, "-o", missing / "state.json"], f"no such directory: {missing}"),
        # Was: "cannot create dangling: File exists", exit 1, once the work was done.
        (["export-rl", bundle, "--format", "jsonl", "--out", dangling], "a symbolic link to"),
        (["view", tmp_path, "-o", dangling], "a symbolic link to nothing"),
        (["view", bundle, "-o", missing / "view.html"], f"no such directory: {missing}"),
        (["view", tmp_path, "-o", a_file], "not a directory"),
        (["view", tmp_path, "-o", a_file / "site"], f"not a directory: {a_file}"),
        (["export-rl", bundle, "--format", "jsonl", "--out", a_file], "not a directory"),
        (["export-rl", bundle, "--format", "jsonl", "--out", "/dev/full"], "not a directory"),
        # Was: `File name too long`, exit 1 (an OSError out of the check itself).
        (["export-rl", bundle, "--format", "jsonl", "--out", long_name], "File name too long"),
        (["view", tmp_path, "-o", long_name], "File name too long"),
        (["reduce", bundle, "-o", long_name], "File name too long"),
        # Was: exit 1 after the work: the permission check passed (as root it always does),
        # and /proc took no new file.
        (
            ["export-rl", bundle, "--format", "jsonl", "--out", "/proc/nope"],
            "cannot write in /proc",
        ),
        (["view", tmp_path, "-o", "/proc/nope"], "cannot write in /proc: it takes no new files"),
        (["view", bundle, "-o", "/proc/nope.html"], "cannot write in /proc"),
        (["reduce", bundle, "-o", "/proc/nope.json"], "cannot write in /proc"),
        (["reduce", bundle, "-o", "/proc/version"], "cannot write in /proc"),
        (["reduce-all", tmp_path, "--tables", "/proc/nope"], "cannot write in /proc"),
    ):
        result = run(*map(str, args))
        assert result.returncode == 2, (args, result.stderr)
        assert_one_clean_line(result.stderr)
        assert said in result.stderr, (args, result.stderr)
    assert not missing.exists()
    assert not (tmp_path / "gone").exists()
    assert a_file.read_text() == "keep me"
    assert not (bundle / "state.json").exists()


def test_an_input_that_is_no_bundle_or_root_is_named_for_what_it_is(tmp_path: Path) -> None:
    # Nothing is opened to find out, so no FIFO is waited on (the run's timeout fails a wait).
    bundle = one_turn_bundle(tmp_path / "root")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    cases: list[tuple[list[str | Path], str]] = [
        (["reduce", fifo], f"not a trace bundle ({fifo} is a FIFO, not a regular file)"),
        (["diff", bundle, dangling], f"({dangling} is a symbolic link to nothing, not a"),
        (
            ["reduce", bundle, "--parent", fifo],
            f"--parent {fifo}: not a trace bundle ({fifo} is a FIFO",
        ),
        # Was: "not a directory: ROOT", "--bundle-root is not a directory: ROOT".
        (["list", fifo], f"not a directory: {fifo} is a FIFO"),
        (["reduce-all", dangling], f"not a directory: {dangling} is a symbolic link to nothing"),
        (["serve", "--bundle-root", fifo], f"--bundle-root is not a directory: {fifo} is a FIFO"),
        (["serve", "--bundle-root", tmp_path / "gone"], "is missing"),
    ]
    for args, said in cases:
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert_one_clean_line(result.stderr)
        assert said in result.stderr, (args, result.stderr)


def test_export_rl_replaces_a_fifo_or_symlink_named_like_its_file(tmp_path: Path) -> None:
    # Was: a FIFO named samples.jsonl in --out hung the export for ever, and a symbolic link
    # was written through (the file it points to truncated and overwritten).
    bundle = one_turn_bundle(tmp_path / "root")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    for fmt, name in (("jsonl", "samples.jsonl"), ("verl", "verl.parquet")):
        for kind in ("fifo", "link"):
            out = tmp_path / f"{fmt}-{kind}"
            out.mkdir()
            if kind == "fifo":
                os.mkfifo(out / name)
            else:
                (out / name).symlink_to(outside)
            result = run("export-rl", bundle, "--format", fmt, "--out", out)
            assert result.returncode == 0, (fmt, kind, result.stderr)
            assert not (out / name).is_symlink(), (fmt, kind)
            assert (out / name).is_file(), (fmt, kind)
            assert sorted(p.name for p in out.iterdir()) == [name]
    assert outside.read_text() == "keep me"
    assert json.loads((tmp_path / "jsonl-fifo" / "samples.jsonl").read_text())["thread_id"]


def test_an_empty_path_is_not_the_current_directory(tmp_path: Path) -> None:
    # Was: `reduce-all ''` reduced every bundle under the current directory; `list ''`,
    # `serve --bundle-root ''` and `export-rl --out ''` used it quietly too.
    bundle = one_turn_bundle(tmp_path / "root")
    for args in (
        ["list", ""],
        ["reduce-all", ""],
        ["view", ""],
        ["export-rl", bundle, "--format", "jsonl", "--out", ""],
        ["export-rl", "", "--format", "jsonl", "--out", tmp_path / "out"],
        ["reduce", bundle, "--parent", ""],
        ["serve", "--bundle-root", ""],
    ):
        result = subprocess.run(
            [*COMMAND, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=bundle.parent,
        )
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert "the path is empty" in result.stderr, (args, result.stderr)
    assert sorted(p.name for p in bundle.iterdir()) == ["trace.binpb"]
    assert not (tmp_path / "out").exists()


def test_an_empty_bundle_path_is_not_the_bundle_it_is_run_in(tmp_path: Path) -> None:
    # Was: run inside a bundle, `reward ''` recorded a reward into it (`reward "$BUNDLE"` with
    # BUNDLE unset), and `reduce ''`, `dump ''`, `watch ''`, `diff '' B`, `view B --diff ''`
    # and `export-otlp ''` read it, while `view ''` and `list ''` were refused.
    bundle = one_turn_bundle(tmp_path / "root")
    other = str(bundle)
    for args in (
        ["reduce", ""],
        ["dump", ""],
        ["request", "", "inf-1"],
        ["watch", ""],
        ["reward", "", "--name", "correct", "--value", "1"],
        ["diff", "", other],
        ["diff", other, ""],
        ["view", other, "--diff", ""],
        ["export-otlp", "", "--endpoint", "http://127.0.0.1:1", "--timeout", "1"],
    ):
        result = subprocess.run(
            [*COMMAND, *args], capture_output=True, text=True, timeout=30, check=False, cwd=bundle
        )
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert "the path is empty" in result.stderr, (args, result.stderr)
        assert result.stdout == "", (args, result.stdout)
    assert sorted(p.name for p in bundle.iterdir()) == ["trace.binpb"]


def test_a_parent_that_is_no_bundle_is_said(tmp_path: Path) -> None:
    # Was: ignored, exit 0, the fork left unresolved without a word.
    bundle = one_turn_bundle(tmp_path / "root")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for parent in (tmp_path / "missing", fifo):
        for args in (
            ["reduce", bundle, "--parent", parent, "--stdout"],
            [
                "export-rl",
                bundle,
                "--format",
                "jsonl",
                "--out",
                tmp_path / "out",
                "--parent",
                parent,
            ],
        ):
            result = run(*map(str, args))
            assert result.returncode == 2, (args, result.stderr)
            assert_one_clean_line(result.stderr)
            assert f"--parent {parent}: " in result.stderr
    assert not (tmp_path / "out").exists()


def test_view_of_one_bundle_refuses_the_server_s_flags(tmp_path: Path) -> None:
    # Was: --listen ignored, the page written to view.html.
    bundle = one_turn_bundle(tmp_path / "root")
    for args in (
        ["view", bundle, "--listen", "127.0.0.1:0"],
        ["view", bundle, "--token-env", "TOKEN"],
        ["view", bundle, "--diff", bundle, "--listen", "127.0.0.1:0"],
        ["view", bundle.parent, "-o", tmp_path / "site", "--listen", "127.0.0.1:0"],
    ):
        result = run(*map(str, args))
        assert result.returncode == 2, (args, result.stderr)
        assert_one_clean_line(result.stderr)
    assert sorted(p.name for p in bundle.iterdir()) == ["trace.binpb"]
    assert not (tmp_path / "site").exists()


def test_dump_prints_one_line_per_record(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    turn = bundle.turn("turn-1", [{"role": "user", "content": "long " * 100}])
    bundle.turn_ended(turn, COMPLETED)
    directory = bundle.close()
    result = run("dump", directory)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    records = replay_bundle(directory).integrity.records_read
    assert len(lines) == records
    assert lines[0].split()[:1] == ["1"]
    assert " header " in lines[0]
    assert "footer" in lines[-1]
    payload_line = next(line for line in lines if "INPUT_ITEM" in line)
    assert "long long" in payload_line
    assert len(payload_line) < 250  # the 500-byte payload is abbreviated
    assert result.stderr.startswith("integrity: CLEAN")

    result = run("dump", directory, "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["seq"] for row in rows] == [str(n) for n in range(1, records + 1)]
    assert "header" in rows[0]
    assert "footer" in rows[-1]


@pytest.mark.parametrize("loop_args", [[], ["--event-loop", "asyncio"]])
def test_serve_answers_and_stops_on_sigterm(tmp_path: Path, loop_args: list[str]) -> None:
    bundle = one_turn_bundle(tmp_path)
    process = subprocess.Popen(
        [*COMMAND, "serve", "--listen", "127.0.0.1:0", "--bundle-root", str(tmp_path), *loop_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        address = line.split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            response = stub.ReduceBundle(reducer_pb2.ReduceBundleRequest(bundle=bundle.name))
            assert response.trace == replay_bundle(bundle)
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="rollout.reducer.v1.ReducerService")
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert process.stderr is not None
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_caps_uploads_as_configured(tmp_path: Path) -> None:
    data = (one_turn_bundle(tmp_path) / "trace.binpb").read_bytes()
    limit = ["--max-upload-bytes", str(len(data) - 1)]
    process = subprocess.Popen(
        [*COMMAND, "serve", "--listen", "127.0.0.1:0", "--bundle-root", str(tmp_path), *limit],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ReduceRecords(iter([reducer_pb2.ReduceRecordsRequest(chunk=data)]))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            answer = stub.ReduceRecords(iter([reducer_pb2.ReduceRecordsRequest(chunk=data[:-1])]))
            assert answer.trace.integrity.status == state_pb2.INTEGRITY_STATUS_TRUNCATED
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_requires_the_token_when_configured(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    process = subprocess.Popen(
        [
            *COMMAND,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--bundle-root",
            str(tmp_path),
            "--auth-token-env",
            "REDUCER_TEST_TOKEN",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REDUCER_TEST_TOKEN": "s3cret-token"},
    )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().split()[-1]
        request = reducer_pb2.ReduceBundleRequest(bundle=bundle.name)
        with grpc.insecure_channel(address) as channel:
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ReduceBundle(request)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = stub.ReduceBundle(
                request, metadata=(("authorization", "Bearer s3cret-token"),)
            )
            assert answer.trace.recording_complete
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
        assert process.stderr is not None
        assert "s3cret-token" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_reduce_compact_writes_the_compact_form(tmp_path: Path) -> None:
    bundle = write_conversation(tmp_path, Shape(turns=5, deltas_per_turn=2))
    result = run("reduce", bundle, "--compact", "--stdout")
    assert result.returncode == 0, result.stderr
    compact = json_format.Parse(result.stdout, state_pb2.RolloutTrace())
    assert compact == replay_bundle(bundle, compact=True)
    assert compact.inference_calls["call-2"].request_prefix_call_id == "call-1"
    expand_request_items(compact)
    assert compact == replay_bundle(bundle)
    result = run("reduce", bundle, "--compact")
    assert result.returncode == 0, result.stderr
    assert (bundle / "state.json").read_text() == state_to_json(replay_bundle(bundle, compact=True))


@pytest.mark.parametrize("command", ["reduce", "view"])
def test_an_output_that_is_not_a_regular_file_is_refused_not_replaced(
    tmp_path: Path, command: str
) -> None:
    bundle = one_turn_bundle(tmp_path)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    link = tmp_path / "link.json"
    link.symlink_to(elsewhere)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for target in (link, fifo, folder, Path("/dev/stdout")):
        result = run(command, bundle, "-o", target)
        assert result.returncode == 2, (target, result.stderr)
        assert_one_clean_line(result.stderr)
        assert f"-o {target}: " in result.stderr
    # Each is still what it was: nothing renamed over the name.
    assert link.is_symlink()
    assert elsewhere.read_text() == "keep me"
    assert fifo.is_fifo()
    assert folder.is_dir()
    assert not any(folder.iterdir())
    assert os.path.islink("/dev/stdout")
    result = run(command, bundle, "-o", "")
    assert result.returncode == 2
    assert "-o: the path is empty" in result.stderr
    assert not (bundle / "state.json").exists()
    assert not (bundle / "view.html").exists()


@pytest.mark.parametrize("command", ["reduce", "view"])
def test_an_output_onto_the_recording_is_refused(tmp_path: Path, command: str) -> None:
    bundle = one_turn_bundle(tmp_path)
    assert run("reward", bundle, "--name", "score", "--value", "1").returncode == 0
    other = one_turn_bundle(tmp_path / "other")
    alias = tmp_path / "alias.binpb"
    os.link(bundle / "trace.binpb", alias)  # the recording under a name of no bundle
    kept = {path: path.read_bytes() for path in (*bundle.iterdir(), other / "trace.binpb")}
    for target in (bundle / "trace.binpb", bundle / "rewards.binpb", alias, other / "trace.binpb"):
        result = run(command, bundle, "-o", target)
        assert result.returncode == 2, (target, result.stderr)
        assert_one_clean_line(result.stderr)
        assert f"-o {target}: a bundle's recording" in result.stderr
    assert {path: path.read_bytes() for path in kept} == kept
    # Nothing written beside them either (no state.json, no view.html).
    assert set(bundle.iterdir()) == {path for path in kept if path.parent == bundle}
    if command == "view":
        result = run("view", bundle, "--diff", other, "-o", other / "trace.binpb")
        assert result.returncode == 2, result.stderr
        assert (other / "trace.binpb").read_bytes() == kept[other / "trace.binpb"]


def test_reward_names_the_turns_and_items_it_may_be_given(tmp_path: Path) -> None:
    # Was: `… has no turn 'turn-9'` alone, where `request` answers an unknown call with the
    # calls the bundle holds.
    bundle = one_turn_bundle(tmp_path)
    wrong_turn = run("reward", bundle, "--name", "n", "--value", "1", "--turn", "turn-9")
    assert wrong_turn.returncode == 2
    assert wrong_turn.stderr == f"trace-reducer: {bundle} has no turn 'turn-9'; its turns: turn-1\n"
    wrong_item = run("reward", bundle, "--name", "n", "--value", "1", "--item", "msg-9")
    assert wrong_item.returncode == 2
    assert wrong_item.stderr == (
        f"trace-reducer: {bundle} has no item 'msg-9'; its item ids: msg-original\n"
    )
    assert not (bundle / "rewards.binpb").exists()


def test_a_reward_that_is_no_finite_number_is_refused_naming_its_flag(tmp_path: Path) -> None:
    # Was: `value and weight must be finite numbers`, naming neither, after the bundle was read.
    bundle = one_turn_bundle(tmp_path)
    for flags, said in (
        (["--value", "nan"], "argument --value: must be a finite number, got nan"),
        (["--value", "1", "--weight=-inf"], "argument --weight: must be a finite number"),
        (["--value", "1e999"], "argument --value: must be a finite number, got 1e999"),
        (["--value", "high"], "argument --value: expects a finite number, got 'high'"),
    ):
        result = run("reward", bundle, "--name", "n", *flags)
        assert result.returncode == 2, (flags, result.stderr)
        assert said in result.stderr, (flags, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (bundle / "rewards.binpb").exists()


def test_reward_writes_nothing_where_there_is_no_bundle(tmp_path: Path) -> None:
    inputs = bad_inputs(tmp_path)
    for name in ("garbage trace.binpb", "empty file"):
        path = inputs[name]
        result = run("reward", path, "--name", "score", "--value", "1")
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert_one_clean_line(result.stderr)
        assert "not a trace bundle" in result.stderr
        folder = path if path.is_dir() else path.parent
        assert not (folder / "rewards.binpb").exists(), name


def test_request_and_diff_say_a_bundle_is_damaged(tmp_path: Path) -> None:
    damaged, offset = corrupt_copy(tmp_path)
    result = run("request", damaged, "inf-nope")
    assert result.returncode == 2
    assert_one_clean_line(result.stderr)
    assert "before its damage (corrupt: bad frame at byte" in result.stderr
    assert f"byte {offset}" in result.stderr

    (tmp_path / "bad").mkdir()
    result = run("request", bad_inputs(tmp_path / "bad")["empty file"], "inf-nope")
    assert result.returncode == 2
    assert "not a trace bundle" in result.stderr

    result = run("diff", damaged, damaged)
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert [line.split(" is ")[0] for line in warnings] == ["warning: A", "warning: B"]
    assert all(f"byte {offset}" in line for line in warnings)
    clean = one_turn_bundle(tmp_path / "clean")
    result = run("diff", clean, clean)
    assert result.returncode == 0
    assert "warning" not in result.stdout


def test_a_broken_pipe_that_is_not_stdout_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from trace_reducer.cli import _main

    def breaks(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(_main, "_reduce", breaks)
    # stdout (capfd's file) is still there to write to: the broken pipe was another one.
    assert _main.main(["reduce", str(one_turn_bundle(tmp_path))]) == 1
    assert "trace-reducer: Broken pipe" in capfd.readouterr().err


def test_a_file_name_that_is_not_utf8_is_named_in_one_line(tmp_path: Path) -> None:
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/run\xff"))
    one_turn_bundle(tmp_path / "src").rename(odd)
    result = run("view", odd, "-o", tmp_path / "page.html")
    assert result.returncode == 2, result.stderr
    assert_one_clean_line(result.stderr)
    assert "not valid UTF-8" in result.stderr
    assert "run\\xff" in result.stderr


@pytest.mark.parametrize("command", ["list", "reduce-all", "view", "export-rl"])
def test_every_command_taking_a_root_says_it_passed_over_a_name_that_is_not_utf8(
    tmp_path: Path, command: str
) -> None:
    root = tmp_path / "root"
    good = one_turn_bundle(root / "good")
    one_turn_bundle(tmp_path / "src").rename(os.fsdecode(bytes(root) + b"/run\xff"))
    args: dict[str, list[str | Path]] = {
        "list": ["list", root],
        "reduce-all": ["reduce-all", root, "--jobs", "1"],
        "view": ["view", root, "-o", tmp_path / "site"],
        "export-rl": ["export-rl", root, "--format", "jsonl", "--out", tmp_path / "out"],
    }
    result = run(*args[command])
    assert result.returncode == 0, result.stderr
    assert said(result.stderr) == [
        f"warning: passed over {root}/run\\xff: its name is not valid UTF-8 (rename it)"
    ]
    # The bundle beside it is read as ever.
    if command == "list":
        assert len(result.stdout.splitlines()) == 2, result.stdout  # the header and its run
    elif command == "reduce-all":
        assert (good / "state.json").is_file()
    elif command == "view":
        assert len(list((tmp_path / "site" / "runs").iterdir())) == 1
    else:
        assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 1


def test_export_otlp_refuses_a_timeout_past_a_day(tmp_path: Path) -> None:
    result = run("export-otlp", one_turn_bundle(tmp_path), "--timeout", "1e300")
    assert result.returncode == 2, result.stderr
    assert_one_clean_line(result.stderr)
    assert "up to 86400" in result.stderr


def run_with_stdout(stdout: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """The command with its stdout "closed" (fd 1 not open), "full" (/dev/full) or "gone"
    (a pipe whose reader has already left, as `| head` leaves it)."""
    command = [*COMMAND, *map(str, args)]
    if stdout == "closed":
        command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if stdout == "full":
        target = os.open("/dev/full", os.O_WRONLY)
    else:
        reader, target = os.pipe()
        os.close(reader)
    try:
        return subprocess.run(
            command, stdout=target, stderr=subprocess.PIPE, text=True, timeout=60, check=False
        )
    finally:
        os.close(target)


def said(stderr: str) -> list[str]:
    """The lines the command said itself, as `trace-reducer: ...`, without the prefix."""
    prefix = "trace-reducer: "
    return [line.removeprefix(prefix) for line in stderr.splitlines() if line.startswith(prefix)]


def output_commands(tmp_path: Path) -> dict[str, list[str | Path]]:
    root = tmp_path / "root"
    bundle = one_turn_bundle(root)
    return {
        "reduce --stdout": ["reduce", bundle, "--stdout"],
        "reduce": ["reduce", bundle, "-o", tmp_path / "state.json"],
        "dump": ["dump", bundle],
        "list": ["list", root],
        "reduce-all": ["reduce-all", root, "--jobs", "1", "--force"],
        "diff": ["diff", bundle, bundle],
    }


@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_an_output_that_cannot_be_written_is_one_line_and_an_error(
    tmp_path: Path, stdout: str
) -> None:
    reasons = {"closed": "it is closed", "full": "No space left on device"}
    for name, args in output_commands(tmp_path).items():
        result = run_with_stdout(stdout, *args)
        # diff's 1 means "a difference": a report not written is its 2, as for diff(1).
        assert result.returncode == (2 if name == "diff" else 1), (name, result.stderr)
        assert "Traceback" not in result.stderr
        # reduce-all's progress lines aside, one line says what failed.
        assert said(result.stderr) == [f"cannot write to stdout: {reasons[stdout]}"], name


def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path: Path) -> None:
    for name, args in output_commands(tmp_path).items():
        result = run_with_stdout("gone", *args)
        assert result.returncode == (2 if name == "diff" else 1), (name, result.stderr)
        assert "Traceback" not in result.stderr
        assert said(result.stderr) == [], name


@pytest.mark.parametrize("stdout", ["closed", "full", "gone"])
def test_serve_serves_on_when_its_stdout_fails(tmp_path: Path, stdout: str) -> None:
    bundle = one_turn_bundle(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    command = [*COMMAND, "serve", "--listen", address, "--bundle-root", str(tmp_path)]
    if stdout == "closed":
        command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
        target = None
    elif stdout == "full":
        target = os.open("/dev/full", os.O_WRONLY)
    else:
        reader, target = os.pipe()
        os.close(reader)
    process = subprocess.Popen(command, stdout=target, stderr=subprocess.PIPE, text=True)
    if target is not None:
        os.close(target)
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            response = stub.ReduceBundle(reducer_pb2.ReduceBundleRequest(bundle=bundle.name))
            assert response.trace == replay_bundle(bundle)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert process.stderr is not None
        stderr = process.stderr.read()
        assert "Traceback" not in stderr
        assert "Exception ignored" not in stderr
        lines = said(stderr)
        if stdout == "gone":
            assert lines == []
        else:
            assert len(lines) == 1, stderr
            assert lines[0].startswith("cannot write to stdout: ")
            assert lines[0].endswith("; serving on")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_token_given_where_its_variable_goes_is_never_repeated(tmp_path: Path) -> None:
    # Was: "--token-env sk-…: the variable is not set", the token itself in the message.
    root = one_turn_bundle(tmp_path / "root").parent
    result = run("view", root, "--listen", "127.0.0.1:0", "--token-env", "sk-S3CRET-token")
    assert result.returncode == 2, result.stderr
    assert "S3CRET" not in result.stderr
    assert "--token-env takes the NAME of a variable, not its value" in result.stderr


def test_an_empty_token_variable_is_said_to_be_empty(tmp_path: Path) -> None:
    # Was: "--token-env VIEW_TOKEN: the variable is not set", of a variable set to "".
    root = one_turn_bundle(tmp_path / "root").parent
    for environment in ({"VIEW_TOKEN": ""}, {}):
        result = subprocess.run(
            [*COMMAND, "view", str(root), "--listen", "127.0.0.1:0", "--token-env", "VIEW_TOKEN"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "VIEW_TOKEN"} | environment,
        )
        assert result.returncode == 2, result.stderr
        assert_one_clean_line(result.stderr)
        assert "--token-env names VIEW_TOKEN, which is unset or empty" in result.stderr


def test_a_bundles_control_characters_never_reach_the_terminal(tmp_path: Path) -> None:
    # Was: printed as they are: an escape sequence in a model name or a message drove the
    # reader's terminal (`list`, `watch`, `diff`), and a newline in a bundle's name printed a
    # line of its own (a forged row, a forged `FAILED:` line of reduce-all's summary).
    root = tmp_path / "root"
    model = "m\x1b]0;OWNED\x07\x1b[31mRED\nFAKE-ROW  gpt  completed"
    builder = BundleBuilder(root, "thread-1", model=model)
    builder.turn("turn-1", [user_item("hi \x1b[2J\x9b31m")])
    bundle = builder.close()
    forged = root / "evil\nFAILED: forged"
    forged.mkdir()
    (forged / "trace.binpb").write_bytes(b"junk")
    outputs = {
        "list": run("list", root),
        "reduce-all": run("reduce-all", root, "--jobs", "1", "--live-window", "0"),
        "watch": run("watch", bundle),
        "diff": run("diff", bundle, forged),
        "reward": run("reward", forged, "--name", "x", "--value", "1"),
    }
    for command, result in outputs.items():
        said = result.stdout + result.stderr
        assert "Traceback" not in said, command
        for control in ("\x1b", "\x07", "\x9b"):
            assert control not in said, (command, said)
        assert not [line for line in said.splitlines() if line.startswith("FAILED: forged")]
        assert not [line for line in said.splitlines() if line.startswith("FAKE-ROW")], command
    table = outputs["list"].stdout.splitlines()
    assert len(table) == 3, table
    assert "m\\x1b]0;OWNED\\x07\\x1b[31mRED\\nFAKE-ROW" in table[1] + table[2]
    assert "user: hi \\x1b[2J\\x9b31m" in outputs["watch"].stdout
    summary = outputs["reduce-all"].stdout
    assert f"FAILED: {root}/evil\\nFAILED: forged: " in summary, summary


def test_a_url_given_to_a_command_of_local_paths_says_so_without_its_credentials(
    tmp_path: Path,
) -> None:
    # Was: `no such file or directory: http:/u:S3CRETPW@host/x`, exit 2: the URL mangled
    # into a path, and its password printed.
    bundle = one_turn_bundle(tmp_path)
    url = "http://u:S3CRETPW@127.0.0.1:9/x?sig=S3CRETQ"
    out = tmp_path / "out"
    for args in (
        ["reduce", url],
        ["dump", url],
        ["request", url, "call-1"],
        ["view", url],
        ["view", bundle, "--diff", "s3://AKIAXXXX:S3CRETPW@bucket/b"],
        ["watch", url],
        ["diff", bundle, url],
        ["reward", url, "--name", "x", "--value", "1"],
        ["export-rl", url, "--format", "jsonl", "--out", out],
        ["export-rl", bundle, "--parent", url, "--format", "jsonl", "--out", out],
        ["export-otlp", url],
        ["reduce", bundle, "--parent", url],
    ):
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "S3CRET" not in result.stdout + result.stderr, args
        assert "this command reads local paths only" in result.stderr, (args, result.stderr)
    assert not out.exists()
    # A local path that looks like one is still a path.
    odd = tmp_path / "http:" / "x"
    odd.parent.mkdir()
    one_turn_bundle(odd.parent).rename(odd)
    result = run("reduce", f"{tmp_path}/http://x", "--stdout")
    assert result.returncode == 0, result.stderr


def _small_files() -> None:
    # A write past 1,000 bytes fails with EFBIG, as on a full disk or past a quota.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))


def test_a_page_that_cannot_be_written_names_its_file(tmp_path: Path) -> None:
    # Was: `trace-reducer: File too large` (or `No space left on device`) naming no file.
    bundle = one_turn_bundle(tmp_path / "root")
    for args, target in (
        (["view", bundle, "-o", tmp_path / "page.html"], tmp_path / "page.html"),
        (["reduce", bundle, "-o", tmp_path / "state.json"], tmp_path / "state.json"),
        (["view", tmp_path / "root", "-o", tmp_path / "site"], None),
    ):
        result = subprocess.run(
            [*COMMAND, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            preexec_fn=_small_files,
        )
        assert result.returncode == 1, (args, result.stderr)
        assert_one_clean_line(result.stderr)
        if target is not None:
            assert result.stderr == f"trace-reducer: File too large: {target}\n"
        else:
            assert result.stderr.startswith(f"trace-reducer: File too large: {tmp_path}/site/")
    # Nothing half written, nor the file written beside it (nor the site's directory: a site
    # is put in place only once whole).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_a_stdout_that_cannot_encode_a_name_shows_it_escaped(tmp_path: Path) -> None:
    # Was: `internal error: UnicodeEncodeError: 'ascii' codec can't encode character '\xe9'`,
    # exit 1, on a stdout whose encoding has no byte for a name's character.
    root = tmp_path / "root"
    bundle = one_turn_bundle(root).rename(root / "été-thread_1")
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for args in (["reduce-all", root], ["diff", bundle, bundle], ["view", bundle], ["list", root]):
        result = subprocess.run(
            [*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=60, env=env
        )
        assert result.returncode == 0, (args, result.stderr)
        assert "internal error" not in result.stderr, args
        if args[0] != "list":  # its table names the thread, not the directory
            assert "\\xe9t\\xe9-thread_1" in result.stdout, (args, result.stdout)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_export_rl_of_a_root_leaves_out_the_bundles_it_cannot_reduce(
    tmp_path: Path, jobs: str
) -> None:
    # Was: one corrupt bundle (or one whose records contradict each other) stopped the export
    # of the whole root with exit 1 and no file, while a trace.binpb that is a FIFO or a link
    # was left out without a word. Now every other bundle is exported, each left out is named
    # with why in reduce-all's words, the summary counts them, and the exit code is 1.
    root = tmp_path / "root"
    good = [one_turn_bundle(root, thread_id=f"thread-{n}") for n in range(2)]
    damaged, _ = corrupt_copy(tmp_path)
    damaged.rename(root / "corrupt")
    contradicting = BundleBuilder(root, "contradicting")
    contradicting.append(turn_started=record_pb2.TurnStarted(turn=1, thread=5, turn_id="x"))
    contradicting.close()
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "trace.binpb")
    (root / "link").mkdir()
    (root / "link" / "trace.binpb").symlink_to(good[0] / "trace.binpb")
    out = tmp_path / f"out-{jobs}"

    result = run("export-rl", root, "--format", "jsonl", "--out", out, "--jobs", jobs)

    assert "Traceback" not in result.stderr
    assert "internal error" not in result.stderr
    assert result.returncode == 1, result.stderr
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(sample["thread_id"] for sample in samples) == ["thread-0", "thread-1"]
    assert result.stdout.rstrip().endswith("; 4 bundles not exported (1 corrupt, 3 failed)")
    said = "trace-reducer: warning: not exported: "
    left_out = [
        line.removeprefix(said) for line in result.stderr.splitlines() if line.startswith(said)
    ]
    assert len(left_out) == 4, result.stderr
    assert "--salvage" in result.stderr
    # The same bundles, in the same words, as reduce-all's summary says them.
    batch = run("reduce-all", root, "--jobs", "1")
    assert batch.returncode == 1
    for line in left_out:
        assert f"  {line}" in batch.stdout.splitlines(), (line, batch.stdout)

    salvaged = run("export-rl", root, "--format", "jsonl", "--out", out, "--salvage")
    assert salvaged.returncode == 1
    assert salvaged.stdout.rstrip().endswith("; 3 bundles not exported (0 corrupt, 3 failed)")
    assert "warning: corrupt bundle corrupt: bad frame at byte" in salvaged.stderr


def test_export_rl_of_a_file_not_named_trace_binpb_is_bad_input(tmp_path: Path) -> None:
    # Was: export-rl BUNDLE/notes.binpb exported the trace.binpb beside it, as if the bundle
    # had been given; a file anywhere else failed on the trace.binpb its directory lacks.
    bundle = one_turn_bundle(tmp_path)
    other = bundle / "notes.binpb"
    other.write_bytes(b"not a trace")
    result = run("export-rl", other, "--format", "jsonl", "--out", tmp_path / "out")
    assert result.returncode == 2, result.stdout
    assert_one_clean_line(result.stderr)
    assert f"{other} is no trace.binpb" in result.stderr
    assert not (tmp_path / "out" / "samples.jsonl").exists()
    given = run("export-rl", bundle / "trace.binpb", "--format", "jsonl", "--out", tmp_path / "out")
    assert given.returncode == 0, given.stderr


TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        # trace_reducer's own __init__ loaded the whole reducer, before the console script's
        # main or `-m`'s __main__ could catch anything: that was the traceback.
        ([TRACE_REDUCER, "--version"], "trace_reducer.bundle"),
        ([sys.executable, "-m", "trace_reducer", "--version"], "trace_reducer.bundle"),
        ([*COMMAND, "--version"], "trace_reducer.bundle"),
        ([TRACE_REDUCER, "list", "."], "google.protobuf"),
        ([sys.executable, "-m", "trace_reducer", "list", "."], "trace_reducer.cli._main"),
    ],
    ids=["script", "dash-m", "dash-m-cli", "script-protobuf", "dash-m-main"],
)
def test_a_ctrl_c_while_the_command_loads_exits_130_quietly(argv: list[str], module: str) -> None:
    done = interrupt_while_importing(argv, module)
    assert (done.returncode, done.stderr, done.stdout) == (EXIT_INTERRUPTED, "", "")


def test_export_rl_s_summary_marks_the_thousands_of_every_count(tmp_path: Path) -> None:
    from trace_reducer.cli._training import summary_line
    from trace_reducer.export._rl import Exported, Unreduced

    exported = Exported(
        tmp_path / "verl.parquet",
        samples=1536,
        exact=1536,
        skipped_threads=0,
        left_out=[],
        warnings=[],
        drifted=1200,
        unreduced=[Unreduced(f"b{n}", "unreadable") for n in range(1002)],
    )
    # Was: `wrote 1,536 samples (1536 with exact tokens, 1200 drifted)`.
    assert summary_line(exported) == (
        f"wrote 1,536 samples (1,536 with exact tokens, 1,200 drifted) to {tmp_path}/verl.parquet"
        "; 1,002 bundles not exported (0 corrupt, 1,002 failed)"
    )
