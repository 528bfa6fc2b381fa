"""The errors a newcomer meets first: no server at the address, something else at it, a server
that does not answer, a bundle path typed wrong, an optional extra not installed. Each is one
line on stderr that says what to do, with the documented exit code, and never a traceback."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.grpc_common.test_server import make_certificate
from tests.live_server import live_server
from tests.test_readme_commands import demo_bundle

BIN = Path(sys.executable).parent
HINT = "start one with `agent-server serve`, or give its address with --address or $ROLLOUT_ADDRESS"


def _run(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*argv], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextmanager
def _refusing() -> Iterator[str]:
    """A loopback port nothing listens on, held so that nothing else takes it meanwhile."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


@contextmanager
def _silent() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        yield f"127.0.0.1:{listening.getsockname()[1]}"


@contextmanager
def _http_server() -> Iterator[str]:
    """A plain HTTP/1.1 server: the wrong kind of server at the address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("command", ["health", "chat"])
def test_no_server_at_the_address(command: str) -> None:
    with _refusing() as address:
        result = _run(str(BIN / "agent-server"), command, "--address", address, stdin="hi\n")
    line = _one_line(result, 1)
    assert line == (
        f"agent-server {command}: no agent server answers at {address} (connection refused); {HINT}"
    )


def test_a_host_name_that_does_not_resolve() -> None:
    result = _run(str(BIN / "agent-server"), "health", "--address", "no-such-host.invalid:50051")
    line = _one_line(result, 1)
    assert "(its host name does not resolve)" in line
    assert line.endswith(HINT)


@pytest.mark.parametrize("command", ["health", "chat"])
def test_a_url_for_the_address(command: str) -> None:
    # Was: `no agent server answers at http://127.0.0.1:50051 (its host name does not
    # resolve)`, exit 1: gRPC took the URL (the gateway's kind of address) for a host name.
    program = str(BIN / "agent-server")
    with _refusing() as address:
        cases = [
            (f"http://{address}", address),
            (f"HTTPS://user:S3CRET@{address}/v1?key=S3CRETQ", f"{address} with --tls"),
        ]
        for url, give in cases:
            line = _one_line(_run(program, command, "--address", url, stdin="hi\n"), 2)
            assert line == (
                f"agent-server {command}: --address takes the server's HOST:PORT, not a URL: "
                f"give {give}"
            )


def test_something_else_at_the_address() -> None:
    with _http_server() as address:
        result = _run(str(BIN / "agent-server"), "health", "--address", address)
    line = _one_line(result, 1)
    assert f"no agent server answers at {address} (something other than gRPC listens there)" in (
        line
    )


@pytest.mark.parametrize("command", ["health", "chat"])
def test_a_client_and_server_that_disagree_on_tls(command: str, tmp_path: Path) -> None:
    # Was: `no agent server answers at … (failed to connect to all addresses; last error:
    # UNKNOWN: …: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: …); start one
    # with `agent-server serve`…`, for a server that answered.
    cert, key = make_certificate(tmp_path)
    program = str(BIN / "agent-server")
    with live_server() as plain:
        line = _one_line(
            _run(program, command, "--address", plain.address, "--tls", stdin="hi\n"), 1
        )
        assert line == (
            f"agent-server {command}: the server at {plain.address} does not serve TLS (it was "
            "started without --tls-cert): leave out --tls and --tls-ca"
        )
    with live_server("--tls-cert", str(cert), "--tls-key", str(key)) as tls:
        line = _one_line(_run(program, command, "--address", tls.address, "--tls", stdin="hi\n"), 1)
        assert line.startswith(
            f"agent-server {command}: the server at {tls.address} serves TLS with a certificate "
            "this command does not trust ("
        ), line
        assert line.endswith("): give the certificate, or its CA's, with --tls-ca PEM")
        line = _one_line(_run(program, command, "--address", tls.address, stdin="hi\n"), 1)
        assert "--tls or --tls-ca PEM if it serves TLS" in line
        assert "Tls handshake" not in line


def test_a_server_that_does_not_answer() -> None:
    with _silent() as address:
        result = _run(str(BIN / "agent-server"), "health", "--address", address, "--timeout", "0.5")
    line = _one_line(result, 1)
    assert line == f"agent-server health: {address} did not answer within 0.5 s (--timeout)"


@pytest.mark.parametrize("command", ["reduce", "view", "watch", "dump", "export-otlp"])
def test_a_bundle_path_typed_wrong(command: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "trace-reducer"), command, "traces/20261202T0000Z-thread_typo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = _one_line(result, 2)
    assert line == "trace-reducer: no such file or directory: traces/20261202T0000Z-thread_typo"


@pytest.mark.parametrize(
    "argv",
    [
        ["trace-reducer", "list", "{dir}"],
        ["trace-reducer", "list", "{dir}", "--json"],
        ["trace-reducer", "reduce-all", "{dir}"],
        ["trace-reducer", "view", "{dir}", "-o", "{tmp}/site"],
        ["trace-reducer", "export-rl", "{dir}", "--format", "jsonl", "--out", "{tmp}/rl"],
        ["agent-server", "serve", "--listen", "127.0.0.1:0", "--replay-from", "{dir}"],
    ],
    ids=["list", "list-json", "reduce-all", "view-o", "export-rl", "replay-from"],
)
@pytest.mark.parametrize("kind", ["empty", "other-files"])
def test_a_root_that_holds_no_bundle(argv: list[str], kind: str, tmp_path: Path) -> None:
    # One fact, one line, one exit code. Was said four ways: `not a trace bundle (no
    # trace.binpb), nor a root of bundles: D`, `not a bundle and no bundles in it: D`,
    # `--replay-from: no bundle in D` and reduce-all's; and `list` printed an empty table
    # (exit 0), `view D -o` wrote a site of no runs (exit 0), for an empty directory.
    root = tmp_path / "root"
    root.mkdir()
    if kind == "other-files":
        (root / "notes").mkdir()
        (root / "notes" / "readme.txt").write_text("not a bundle")
    program, *rest = (part.format(dir=root, tmp=tmp_path) for part in argv)
    line = _one_line(_run(str(BIN / program), *rest), 2)
    flag = "--replay-from: " if "--replay-from" in argv else ""
    said = f"no trace bundles (directories holding trace.binpb) under {root}"
    assert line == f"{program}: {flag}{said}"
    assert sorted(os.listdir(tmp_path)) == ["root"]  # nothing written


def test_the_served_view_of_a_directory_of_other_files_says_the_same(tmp_path: Path) -> None:
    # The served list starts on an empty root (a trace root before its first recording) and
    # fills in; a directory of other files is no root to watch.
    (tmp_path / "readme.txt").write_text("not a bundle")
    line = _one_line(_run(str(BIN / "trace-reducer"), "view", str(tmp_path)), 2)
    said = f"no trace bundles (directories holding trace.binpb) under {tmp_path}"
    assert line == f"trace-reducer: {said}"


@pytest.mark.parametrize(
    "argv",
    [
        ["reduce", "{root}"],
        ["dump", "{root}"],
        ["watch", "{root}"],
        ["request", "{root}", "inf_1"],
        ["export-otlp", "{root}"],
        ["diff", "{root}", "{bundle}"],
        ["reward", "{root}", "--name", "score", "--value", "1"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_root_given_where_a_bundle_belongs(argv: list[str], bundle: Path) -> None:
    # Was `not a trace bundle (no trace.binpb): ROOT`: what the root lacks, not that it holds
    # the bundles, nor where their names are.
    root = bundle.parent
    filled = [arg.format(root=root, bundle=bundle) for arg in argv]
    line = _one_line(_run(str(BIN / "trace-reducer"), *filled), 2)
    assert line == (
        f"trace-reducer: not a trace bundle (no trace.binpb) but a root of bundles: {root}: "
        f"give one of them (`trace-reducer list {root}` names them)"
    )


def _without(packages: list[str], program: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """A command run as if the packages were not installed (an import of them fails)."""
    main = {"trace-reducer": "trace_reducer.cli", "agent-server": "agent_server.cli"}[program]
    code = (
        "import sys\n"
        f"for name in {packages!r}:\n"
        "    sys.modules[name] = None\n"
        f"from {main} import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return _run(sys.executable, "-c", code, *argv)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_bundle(tmp_path_factory.mktemp("traces"))


@pytest.mark.parametrize(
    ("missing", "argv", "said"),
    [
        (
            ["pyarrow"],
            ["reduce-all", "{root}", "--tables", "{tmp}/tables"],
            "reduce-all needs the batch extra (pyarrow is missing): "
            "pip install 'rollout-trace[batch]'",
        ),
        (
            # The training extra installed (pyarrow), not the batch extra: was `internal error:
            # ModuleNotFoundError`.
            ["fsspec"],
            ["reduce-all", "{root}", "--tables", "{tmp}/tables"],
            "reduce-all needs the batch extra (fsspec is missing): "
            "pip install 'rollout-trace[batch]'",
        ),
        (
            ["ray"],
            ["reduce-all", "{root}", "--force", "--ray"],
            "--ray needs the ray extra (ray is missing): pip install 'rollout-trace[ray]'",
        ),
        (
            ["opentelemetry"],
            ["export-otlp", "{bundle}"],
            "export-otlp needs the otel extra (opentelemetry is missing): "
            "pip install 'rollout-trace[otel]'",
        ),
        (
            ["pyarrow"],
            ["export-rl", "{root}", "--format", "verl", "--out", "{tmp}/rl"],
            "--format verl needs the training extra (pyarrow is missing): "
            "pip install 'rollout-trace[training]'",
        ),
    ],
)
def test_a_missing_extra(
    missing: list[str], argv: list[str], said: str, bundle: Path, tmp_path: Path
) -> None:
    filled = [arg.format(root=bundle.parent, bundle=bundle, tmp=tmp_path) for arg in argv]
    line = _one_line(_without(missing, "trace-reducer", *filled), 2)
    assert line == f"trace-reducer: {said}"
    assert not (tmp_path / "tables").exists()


def test_live_export_without_the_otel_extra() -> None:
    result = _without(
        ["opentelemetry"],
        "agent-server",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--otlp-endpoint",
        "http://127.0.0.1:4317",
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    # The first module of the SDK the live export imports.
    assert last.startswith("agent-server: --otlp-endpoint needs the otel extra (opentelemetry")
    assert last.endswith(" is missing): pip install 'rollout-trace[otel]'")
