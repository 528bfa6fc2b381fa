"""reduce-all over fsspec URLs: S3 (moto's real S3 server on loopback, through s3fs),
file:// and memory://."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch.conftest import (
    TRACE_REDUCER,
    Corpus,
    bundles_under,
    expected_state,
    reduce_all,
)
from tests.docs import block
from trace_reducer import cli
from trace_reducer.batch._rows import TABLES

fsspec = pytest.importorskip("fsspec", reason="URL roots need fsspec (the batch extra)")
s3fs = pytest.importorskip("s3fs", reason="s3:// roots need s3fs (the batch extra)")
moto_server = pytest.importorskip(
    "moto.server", reason="the S3 tests need moto (the test dependency group)"
)
pq = pytest.importorskip("pyarrow.parquet", reason="--tables needs pyarrow (the batch extra)")

# Credentials botocore accepts without looking anywhere else; moto checks none of them.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "rollout-bundles"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server, in this process, on a free loopback port."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in AWS_ENV.items():
            patch.setenv(key, value)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def _s3(endpoint: str) -> Any:
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, **_keys())
    fs.invalidate_cache()
    return fs


def _keys() -> dict[str, str]:
    return {"key": AWS_ENV["AWS_ACCESS_KEY_ID"], "secret": AWS_ENV["AWS_SECRET_ACCESS_KEY"]}


def _files(fs: Any, root: str) -> dict[str, bytes]:
    names = fs.find(root)
    return {name.removeprefix(root).lstrip("/"): fs.cat_file(name) for name in names}


def _local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_bundles_in_an_s3_bucket(
    s3_endpoint: str, traces: Path, corpus: Corpus, tmp_path: Path
) -> None:
    fs = _s3(s3_endpoint)
    fs.mkdir(BUCKET)
    fs.put(f"{traces}/", f"{BUCKET}/runs/", recursive=True)
    url = f"s3://{BUCKET}/runs"
    option = ["--storage-option", f"endpoint_url={s3_endpoint}"]

    first = reduce_all(url, *option, "--tables", str(tmp_path / "tables"), env=AWS_ENV)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"reduce-all: {corpus.threads} bundles under {url} " in first.stdout
    fs.invalidate_cache()
    for bundle in bundles_under(traces):
        written = fs.cat_file(f"{BUCKET}/runs/{bundle.name}/state.json")
        assert written.decode() == expected_state(bundle)
    paths = pq.read_table(tmp_path / "tables" / "bundles").column("bundle_path").to_pylist()
    assert sorted(paths) == sorted(f"{url}/{b.name}" for b in bundles_under(traces))

    # The endpoint as botocore's own setting works as well; nothing is stale, nothing re-done.
    second = reduce_all(url, env={**AWS_ENV, "AWS_ENDPOINT_URL": s3_endpoint})
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"up to date {corpus.threads}" in second.stdout
    assert "reduced 0" in second.stdout

    # Tables can go to the bucket too: the same bytes as on local disk.
    third = reduce_all(url, *option, "--tables", f"s3://{BUCKET}/tables", env=AWS_ENV)
    assert third.returncode == 0, third.stdout + third.stderr
    fs.invalidate_cache()
    assert _files(fs, f"{BUCKET}/tables") == _local_files(tmp_path / "tables")

    # A damaged object is reported by its URL and gets no state.json.
    source = bundles_under(traces)[0]
    data = bytearray((source / "trace.binpb").read_bytes())
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{BUCKET}/runs/zz-corrupt/trace.binpb", bytes(data))
    damaged = reduce_all(url, *option, env=AWS_ENV)
    assert damaged.returncode == 1
    assert f"{url}/zz-corrupt: bad frame at byte" in damaged.stdout
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/runs/zz-corrupt/state.json")


def test_file_urls(traces: Path) -> None:
    result = reduce_all(f"file://{traces}")
    assert result.returncode == 0, result.stderr
    for bundle in bundles_under(traces):
        assert (bundle / "state.json").read_text() == expected_state(bundle)


def test_ctrl_c_as_the_tables_replace_the_old_leaves_them_whole(
    traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: a Ctrl-C (or SIGTERM) between a table's old files removed and its new ones moved in
    # stopped the swap there, and the staged files were removed: tables half gone.
    memory = fsspec.filesystem("memory")
    memory.put(f"{traces}/", "/swap-test/", recursive=True)
    tables = tmp_path / "t"
    moved = fsspec.implementations.local.LocalFileSystem.mv

    def ctrl_c_on_the_first_move(self: Any, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.undo()
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, as the swap starts
        return moved(self, *args, **kwargs)

    try:
        assert cli.main(["reduce-all", "memory://swap-test", "--tables", str(tables)]) == 0
        before = {table.name: pq.read_table(table).num_rows for table in tables.iterdir()}
        monkeypatch.setattr(
            fsspec.implementations.local.LocalFileSystem, "mv", ctrl_c_on_the_first_move
        )
        code = cli.main(["reduce-all", "memory://swap-test", "--force", "--tables", str(tables)])
    finally:
        memory.rm("/swap-test", recursive=True)
    assert code == 130
    after = {table.name: pq.read_table(table).num_rows for table in tables.iterdir()}
    assert after == before
    assert sorted(after) == sorted(TABLES)


def test_memory_urls_are_reduced_in_process(
    traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = fsspec.filesystem("memory")
    memory.put(f"{traces}/", "/batch-test/", recursive=True)
    try:
        assert cli.main(["reduce-all", "memory://batch-test", "--tables", str(tmp_path / "t")]) == 0
        out = capsys.readouterr().out
        assert "(in-process, 1 worker)" in out
        for bundle in bundles_under(traces):
            written = memory.cat_file(f"/batch-test/{bundle.name}/state.json").decode()
            assert written == expected_state(bundle)
        assert pq.read_table(tmp_path / "t" / "threads").num_rows == len(bundles_under(traces))

        assert cli.main(["reduce-all", "memory://batch-test", "--ray"]) == 2
        assert "exists in this process only" in capsys.readouterr().err
    finally:
        memory.rm("/batch-test", recursive=True)


def test_the_readme_s3_command(s3_endpoint: str, traces: Path, corpus: Corpus) -> None:
    """README.md's object-storage line as written, the bucket on moto, found through
    AWS_ENDPOINT_URL as the README says."""
    [line] = block("s3", "sh").splitlines()
    program, command, *args = shlex.split(line)
    assert (program, command) == ("trace-reducer", "reduce-all")
    fs = _s3(s3_endpoint)
    fs.mkdir("rollouts")
    fs.put(f"{traces}/", "rollouts/2026-11/", recursive=True)
    result = reduce_all(*args, env={**AWS_ENV, "AWS_ENDPOINT_URL": s3_endpoint})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"reduce-all: {corpus.threads} bundles under s3://rollouts/2026-11 " in result.stdout
    fs.invalidate_cache()
    for bundle in bundles_under(traces):
        written = fs.cat_file(f"rollouts/2026-11/{bundle.name}/state.json")
        assert written.decode() == expected_state(bundle)
    assert fs.find("rollouts/tables/2026-11/bundles")


def _trace_reducer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TRACE_REDUCER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **AWS_ENV},
        check=False,
    )


def _our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("trace-reducer")]


@pytest.mark.parametrize("command", ["list", "reduce-all"])
@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("bogus://x", "cannot open bogus://x: Protocol not known: bogus"),
        ("s3://", "cannot open s3://: Cannot traverse all of S3"),
    ],
)
def test_a_url_no_store_can_open_is_one_line_and_exit_2(
    command: str, root: str, message: str
) -> None:
    # Was, for list: `internal error: ValueError: ...`, exit 1.
    if command == "reduce-all" and root == "s3://":
        message = message.replace("cannot open", "cannot list")  # s3fs opens, then refuses
    result = _trace_reducer(command, root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert _our_lines(result.stderr) == [f"trace-reducer: {message}"]


@pytest.mark.parametrize("command", ["list", "reduce-all"])
def test_a_root_url_s_credentials_are_never_shown(command: str) -> None:
    # Was: the URL as given, in our line and again inside botocore's message.
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    secrets = ("S3CRETPW", "S3CRETQ", "AKIAXXXX", "S3CRETNOEQ", "S3CRETOPT")
    option = "--storage-option"
    cases = [
        [command, "s3://AKIAXXXX:S3CRETPW@bucket/prefix"],
        [command, f"http://user:S3CRETPW@127.0.0.1:{closed}/x?sig=S3CRETQ"],
        [command, "s3://bucket/prefix", option, "S3CRETNOEQ"],
        [command, "http://user:S3CRETPW@[::1/x"],  # a URL that does not parse
        # Options botocore quotes back: an endpoint it cannot parse, credentials it refuses.
        [command, "s3://bucket/prefix", option, "endpoint_url=http://[::1/?sig=S3CRETQ"],
        [command, "s3://bucket/prefix", option, "endpoint_url=no-scheme/?sig=S3CRETQ"],
        [
            command,
            "s3://bucket/prefix",
            option,
            f"endpoint_url=http://127.0.0.1:{closed}",
            option,
            "key=AKIAXXXX",
            option,
            "secret=S3CRETOPT",
        ],
    ]
    for args in cases:
        result = _trace_reducer(*args)
        assert "Traceback" not in result.stderr
        shown = result.stdout + result.stderr
        assert not [secret for secret in secrets if secret in shown], (args, shown)
        assert result.returncode == 2, (args, result.stderr)
        assert len(_our_lines(result.stderr)) == 1, (args, result.stderr)


@pytest.mark.parametrize("command", ["list", "reduce-all"])
def test_a_url_root_nothing_answers_says_so(command: str) -> None:
    # Was, for list: an empty table and exit 0 (fsspec's walk passes over what it cannot
    # read); for reduce-all: "no trace bundles under ...".
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    root = f"http://127.0.0.1:{closed}/traces"
    result = _trace_reducer(command, root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = _our_lines(result.stderr)
    assert line.startswith(f"trace-reducer: cannot list {root}: Cannot connect to host"), line


def test_a_store_that_refuses_the_state_json_says_so(tmp_path: Path) -> None:
    # An HTTP root whose server takes no PUT (http.server's own answers 501): each bundle
    # failed as an "internal error: ClientResponseError", as if the reducer had broken.
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    root = tmp_path / "served"
    root.mkdir()
    golden = Path(__file__).resolve().parents[1] / "golden" / "bundles"
    bundle = next(path for path in sorted(golden.iterdir()) if path.name.startswith("2026"))
    (root / bundle.name).mkdir()
    (root / bundle.name / "trace.binpb").write_bytes((bundle / "trace.binpb").read_bytes())

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        result = subprocess.run(
            [TRACE_REDUCER, "reduce-all", url], capture_output=True, text=True, timeout=120
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1, result.stderr
    assert "internal error" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    state = f"{url}{bundle.name}/state.json"
    said = result.stdout + result.stderr
    failed = [line for line in said.splitlines() if "FAILED:" in line]
    assert failed, said
    assert f"cannot write {state}: ClientResponseError: 501" in failed[0]


@pytest.mark.parametrize("command", ["list", "reduce-all"])
def test_an_http_root_that_accepts_and_never_answers_times_out(command: str) -> None:
    # Was: every request waited aiohttp's default 300 s (fsspec's HTTP file system sets no
    # timeout), and `--storage-option timeout=…` failed with "'>' not supported between
    # instances of 'str' and 'int'".
    with socket.socket() as silent:  # the kernel accepts its connections; nothing answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        root = f"http://user:S3CRETPW@127.0.0.1:{silent.getsockname()[1]}/traces?sig=S3CRETQ"
        result = _trace_reducer(command, root, "--storage-option", "timeout=0.2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "S3CRET" not in result.stdout + result.stderr
    [line] = _our_lines(result.stderr)
    assert line.endswith(
        "/traces?sig=...: no answer within 0.2 s (--storage-option timeout=SECONDS to wait longer)"
    ), line
    assert line.startswith("trace-reducer: cannot list http://"), line


def test_an_http_roots_timeout_is_30_seconds_unless_said_otherwise() -> None:
    from trace_reducer.batch._storage import HTTP_TIMEOUT, FsspecStore

    assert HTTP_TIMEOUT == 30
    assert FsspecStore("http://127.0.0.1:9/x", ()).timeout == HTTP_TIMEOUT
    assert FsspecStore("https://127.0.0.1:9/x", (("timeout", "2.5"),)).timeout == 2.5
    assert FsspecStore("memory://x", ()).timeout is None
    for bad in ("0", "-1", "nan", "inf", "soon"):
        result = _trace_reducer(
            "list", "http://127.0.0.1:9/x", "--storage-option", f"timeout={bad}"
        )
        assert result.returncode == 2, (bad, result.stderr)
        assert _our_lines(result.stderr) == [
            "trace-reducer: cannot open http://127.0.0.1:9/x: --storage-option timeout=SECONDS "
            f"expects a number of seconds above 0, got {bad!r}"
        ]


def test_a_bundle_an_http_root_lists_and_never_serves_says_it_timed_out(tmp_path: Path) -> None:
    # Was: its request waited 300 s; and once it timed out, fsspec's FileNotFoundError named
    # the URL and nothing else ("FAILED: URL: URL/trace.binpb").
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    root = tmp_path / "served"
    golden = Path(__file__).resolve().parents[1] / "golden" / "bundles"
    bundle = next(path for path in sorted(golden.iterdir()) if path.name.startswith("2026"))
    (root / bundle.name).mkdir(parents=True)
    (root / bundle.name / "trace.binpb").write_bytes((bundle / "trace.binpb").read_bytes())
    released = threading.Event()

    class Silent(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def send_head(self) -> Any:
            if self.path.endswith("/trace.binpb"):
                released.wait()  # until the test is over: the client gives up first
            return super().send_head()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Silent, directory=root))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        result = _trace_reducer("reduce-all", url, "--storage-option", "timeout=0.2")
    finally:
        released.set()
        server.shutdown()
        server.server_close()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    failed = [line for line in result.stdout.splitlines() if "FAILED:" in line]
    assert failed == [
        f"  FAILED: {url}{bundle.name}: no answer within 0.2 s "
        "(--storage-option timeout=SECONDS to wait longer)"
    ], result.stdout


def test_tables_at_a_url_no_store_can_open_is_one_line_and_exit_2_before_any_work(
    traces: Path,
) -> None:
    # Was: `internal error: ValueError: Protocol not known: bogus`, exit 1 (and, with the
    # batch extra half installed, `internal error: ModuleNotFoundError` for fsspec).
    result = reduce_all(str(traces), "--tables", "bogus://tables")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert _our_lines(result.stderr) == [
        "trace-reducer: cannot open bogus://tables: Protocol not known: bogus"
    ]
    assert not [bundle for bundle in bundles_under(traces) if (bundle / "state.json").exists()]


def test_tables_a_store_refuses_are_one_warning_and_exit_1(traces: Path, tmp_path: Path) -> None:
    # Was, once every bundle was reduced: `internal error: NoCredentialsError: Unable to
    # locate credentials` (an s3:// store and no AWS credentials anywhere), `internal error:
    # NotImplementedError: ` (fsspec's read-only http:// file system).
    nowhere = str(tmp_path / "no-such-file")
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env |= {
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with socket.socket() as held:  # a loopback port nothing listens on
        held.bind(("127.0.0.1", 0))
        closed = held.getsockname()[1]
        cases = [
            (
                [
                    "s3://bucket/tables",
                    "--storage-option",
                    f"endpoint_url=http://127.0.0.1:{closed}",
                ],
                "s3://bucket/tables: Unable to locate credentials",
            ),
            ([f"http://127.0.0.1:{closed}/tables"], f"http://127.0.0.1:{closed}/tables: "),
        ]
        for args, said in cases:
            result = subprocess.run(
                [TRACE_REDUCER, "reduce-all", str(traces), "--force", "--tables", *args],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                check=False,
            )
            assert result.returncode == 1, result.stderr
            assert "Traceback" not in result.stderr
            assert "internal error" not in result.stderr
            last = result.stderr.splitlines()[-1]
            assert last.startswith(f"trace-reducer: warning: cannot write the tables to {said}")
            assert f"  tables: not written to {args[0]}" in result.stdout
            # The batch itself went on: every bundle has its state.
            for bundle in bundles_under(traces):
                assert (bundle / "state.json").read_text() == expected_state(bundle)
