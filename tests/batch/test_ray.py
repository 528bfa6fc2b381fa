"""reduce-all --ray: the same reduction as Ray tasks, on a real local Ray."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batch.conftest import (
    RAY_ENV,
    TRACE_REDUCER,
    age,
    bundles_under,
    expected_state,
    many_copies,
    reduce_all,
)

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="--ray needs the ray extra: pip install -e '.[ray]' (make test installs it)",
    ),
    # Starting Ray may wait up to RAY_ENV's 120 s for its GCS server on a busy fresh machine.
    pytest.mark.timeout(180),
]


def _short_temp_dir() -> str:
    # Ray's unix sockets live under its temp dir; their paths must stay under 108 bytes.
    return tempfile.mkdtemp(prefix="ray-", dir="/tmp")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray with 2 CPUs, started once; reduce-all joins it by address."""
    temp = _short_temp_dir()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in RAY_ENV.items():
            patch.setenv(key, value)
        # Imported only now: Ray reads its settings from the environment when imported.
        import ray

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=200 << 20,
            _temp_dir=temp,
        )
        try:
            yield str(ray.get_runtime_context().gcs_address)
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _report(stdout: str) -> list[str]:
    """The summary lines that do not depend on timing."""
    keep = ("  bundles:", "  integrity:", "  CORRUPT", "  FAILED", "  live", "  tables:")
    return [line for line in stdout.splitlines() if line.startswith(keep)]


def test_ray_gives_the_pool_s_states_summary_and_identical_tables(
    ray_address: str, traces: Path, tmp_path: Path
) -> None:
    corrupt = traces / "corrupt"
    shutil.copytree(bundles_under(traces)[0], corrupt)
    data = bytearray((corrupt / "trace.binpb").read_bytes())
    data[len(data) // 2] ^= 0x01
    (corrupt / "trace.binpb").write_bytes(bytes(data))
    age(corrupt / "trace.binpb", 3600)

    pool = reduce_all(str(traces), "--tables", str(tmp_path / "pool"))
    assert pool.returncode == 1, pool.stdout + pool.stderr
    pool_states = {b: (b / "state.json").read_text() for b in bundles_under(traces) if b != corrupt}
    for bundle in pool_states:
        (bundle / "state.json").unlink()

    on_ray = reduce_all(
        str(traces), "--ray", ray_address, "--tables", str(tmp_path / "ray"), env=RAY_ENV
    )
    assert on_ray.returncode == 1, on_ray.stdout + on_ray.stderr
    assert "Traceback" not in on_ray.stderr
    assert "(ray, 2 workers)" in on_ray.stdout
    for bundle, text in pool_states.items():
        assert (bundle / "state.json").read_text() == text == expected_state(bundle)
    assert _report(on_ray.stdout) == [
        line.replace(str(tmp_path / "pool"), str(tmp_path / "ray")) for line in _report(pool.stdout)
    ]
    assert any(line.startswith("  CORRUPT at byte") for line in _report(on_ray.stdout))
    assert _files(tmp_path / "ray") == _files(tmp_path / "pool")


def test_bare_ray_starts_and_stops_its_own(traces: Path, tmp_path: Path) -> None:
    temp = _short_temp_dir()
    try:
        result = reduce_all(
            str(traces),
            "--jobs",
            "2",
            "--ray",
            env={**RAY_ENV, "RAY_TMPDIR": temp},
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "(ray, 2 workers)" in result.stdout
        assert f"reduced {len(bundles_under(traces))}" in result.stdout
        for bundle in bundles_under(traces):
            assert (bundle / "state.json").read_text() == expected_state(bundle)
        # The Ray it started goes with it: soon no process is left holding its session.
        sessions = list(Path(temp).glob("ray/session_*"))
        assert sessions, "the local Ray did not use RAY_TMPDIR"
        deadline = time.monotonic() + 30
        while _processes_using(temp):
            assert time.monotonic() < deadline, f"Ray processes left: {_processes_using(temp)}"
            time.sleep(0.1)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_sigterm_stops_a_ray_batch_as_ctrl_c_does(
    ray_address: str, traces: Path, tmp_path: Path
) -> None:
    # Was: ray.init put its own SIGTERM handlers in; the driver ended with exit 15, no summary,
    # and Ray's core printed a stack (`*** SIGTERM received at time=...`).
    root = many_copies(traces, tmp_path, 3000)
    process = subprocess.Popen(
        [TRACE_REDUCER, "reduce-all", str(root), "--ray", ray_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **RAY_ENV},
    )
    try:
        deadline = time.monotonic() + 120
        while not any(root.glob("*/state.json")):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no bundle reduced"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 143, stdout + stderr
    assert "interrupted after" in stdout
    assert "SIGTERM received" not in stderr
    assert "Traceback" not in stderr
    assert not list(root.rglob("*.tmp"))
    for state in root.glob("*/state.json"):
        assert state.read_text() == expected_state(state.parent)


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_nothing_listens_on_is_one_line_and_exit_2(scheme: str, traces: Path) -> None:
    """ray.init retries a GCS address nothing answers on for ever: the address is tried first,
    and named as it was given (Ray would name it by the host's IP)."""
    with socket.socket() as bound:  # bound, never listening: a connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"{scheme}127.0.0.1:{bound.getsockname()[1]}"
        result = reduce_all(str(traces), "--ray", address, env=RAY_ENV, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"trace-reducer: cannot join Ray at {address}: Connection refused (is a Ray head "
        "running there? `ray start --head` prints the address to give)"
    ]
    assert not list(traces.rglob("state.json"))


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("ray://raysuser:S3CRETPW@127.0.0.1:{port}", "ray://127.0.0.1:{port}"),
        ("raysuser:S3CRETPW@127.0.0.1:{port}", "***:***@127.0.0.1:{port}"),
    ],
)
def test_an_address_with_credentials_is_never_repeated(
    given: str, shown: str, traces: Path
) -> None:
    """The refusal names the address without its user and password, as a root URL's are (was:
    `cannot join Ray at ray://raysuser:S3CRETPW@…`)."""
    with socket.socket() as bound:  # bound, never listening: a connection is refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        result = reduce_all(str(traces), "--ray", given.format(port=port), env=RAY_ENV, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"trace-reducer: cannot join Ray at {shown.format(port=port)}: Connection refused (is a "
        "Ray head running there? `ray start --head` prints the address to give)"
    ]
    assert "S3CRETPW" not in result.stdout + result.stderr
    assert "raysuser" not in result.stdout + result.stderr


@pytest.mark.parametrize("address", ["head", "head:port", "head:70000", "ray://head:1/x"])
def test_an_address_that_is_not_host_port_is_one_line_and_exit_2(
    address: str, traces: Path
) -> None:
    result = reduce_all(str(traces), "--ray", address, env=RAY_ENV, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"trace-reducer: --ray {address}: expects auto, HOST:PORT or ray://HOST:PORT "
        "(bare --ray starts a local Ray)"
    ]


def _processes_using(path: str) -> list[int]:
    """Processes whose command line names path (Ray's daemons carry their session dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if path.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_driver_that_already_joined_ray_keeps_it(
    ray_address: str, traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Python driver calls ray.init(address=...) itself, then reduce-all (ray job submit
    runs such drivers): the Ray it joined is used, and left running."""
    import ray

    from trace_reducer import cli

    assert ray.is_initialized()
    code = cli.main(["reduce-all", str(traces), "--ray", "auto", "--tables", str(tmp_path / "t")])
    assert code == 0, capsys.readouterr()
    assert "(ray, 2 workers)" in capsys.readouterr().out
    assert ray.is_initialized()
    assert ray.get_runtime_context().gcs_address == ray_address
    for bundle in bundles_under(traces):
        assert (bundle / "state.json").read_text() == expected_state(bundle)
