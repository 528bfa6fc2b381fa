"""export-rl --jobs and the progress of the long exports: the same samples from one process or
several, a bar on a terminal (a real pseudo-terminal), nothing but data on stdout, silence
into a pipe and with --quiet."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, StartAgent
from tests.agent_server.test_rl_export import run_turn
from tests.commands import run_on_terminal
from trace_reducer.bundle._reader import read_bundle
from trace_reducer.export import _rl as rl_export
from trace_reducer.reduce import _forks as forks_module

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


@pytest.fixture
async def root(start_agent: StartAgent) -> Path:
    """A trace root of 7 bundles: a parent, 4 forks of it (each a sample whose prefix lives
    in the parent's bundle), and two plain threads."""
    local: Harness = await start_agent(provider_url=None, local_word_delay=0.0)
    parent = await local.start_thread(capture_logprobs=True, request_token_ids=True)
    await run_turn(local, parent.id, "The question.")
    forks = (
        await local.stub.ForkThread(
            agent_pb2.ForkThreadRequest(thread_id=parent.id, count=4, group_id="q1")
        )
    ).threads
    others = [await local.start_thread() for _ in range(2)]
    for thread in [*forks, *others]:
        await run_turn(local, thread.id, "Your answer?")
    for thread in [parent, *forks, *others]:
        await local.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return Path(parent.bundle_path).parent


# Three exports, two of them starting worker processes: a hang guard for a busy machine.
@pytest.mark.timeout(240)
async def test_jobs_write_the_same_samples_as_one_process(root: Path, tmp_path: Path) -> None:
    outputs = {}
    for jobs in ("1", "2", "3"):
        out_dir = tmp_path / f"jobs-{jobs}"
        process = await asyncio.create_subprocess_exec(
            TRACE_REDUCER, "export-rl", str(root), "--format", "jsonl", "--out", str(out_dir),
            "--jobs", jobs,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        # Into a pipe: no progress on stderr, stdout the one summary line.
        assert err.decode() == ""
        assert out.decode().startswith("wrote 7 samples (5 with exact tokens"), out
        outputs[jobs] = (out_dir / "samples.jsonl").read_bytes()
    assert outputs["1"].count(b"\n") == 7
    # Byte for byte: order, fork prefixes resolved in every worker, rewards, groups.
    assert outputs["2"] == outputs["1"]
    assert outputs["3"] == outputs["1"]


async def test_a_worker_reads_its_bundles_and_their_parents_only(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: every chunk of 16 bundles a worker reduced read the header of every bundle of the
    # export again (N/16 times N reads): 1,728 rollouts in 8-fork groups took 34.9 s with
    # --jobs 2, 2.9 s with --jobs 1. The index of threads is now read once and handed to each
    # worker as it starts.
    from trace_reducer.reduce._forks import bundles_by_thread

    bundles = rl_export.find_bundles([root])
    index = bundles_by_thread(bundles)
    forked = {
        path: trace.fork.parent_thread_id
        for path, trace, _ in rl_export.reduce_all(bundles, salvage=False)
    }
    fork = next(path for path, parent_thread in forked.items() if parent_thread)
    parent = index[forked[fork]]
    opened: list[Path] = []

    def spy(path: Any) -> Any:
        opened.append(Path(path))
        return read_bundle(path)

    monkeypatch.setattr(forks_module, "read_bundle", spy)
    monkeypatch.setattr(rl_export, "_worker_by_thread", {})
    handler = signal.getsignal(signal.SIGINT)
    try:
        rl_export._start_worker(index)
    finally:
        signal.signal(signal.SIGINT, handler)
    [reduced] = rl_export._reduce_chunk([fork], False, "jsonl")
    assert reduced.counted is not None
    # Its parent resolved: the history it inherited is in its sample.
    messages = json.loads(reduced.row)["messages"]
    assert "The question." in json.dumps(messages)
    # The parent's bundle, for its fork record and then its history; no other.
    assert set(opened) == {parent}


async def test_bad_jobs_is_usage(root: Path, tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "export-rl", str(root), "--format", "jsonl", "--out", str(tmp_path / "o"),
        "--jobs", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await process.communicate()
    assert process.returncode == 2
    assert "argument --jobs: must be from 1 to 1024, got 0" in err.decode()
    assert "Traceback" not in err.decode()
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("jobs", ["1", "2"])
async def test_export_rl_shows_a_bar_on_a_terminal(root: Path, tmp_path: Path, jobs: str) -> None:
    code, out, terminal = await asyncio.to_thread(
        run_on_terminal,
        TRACE_REDUCER, "export-rl", str(root), "--format", "jsonl", "--out", str(tmp_path / "o"),
        "--jobs", jobs,
    )  # fmt: skip
    assert code == 0, terminal
    assert "export-rl" in terminal, terminal
    assert "7/7" in terminal, terminal
    # The bar is on stderr only: stdout stays the summary.
    assert out.startswith("wrote 7 samples"), out
    assert out.count("\n") == 1, out


async def test_quiet_shows_no_bar(root: Path, tmp_path: Path) -> None:
    code, out, terminal = await asyncio.to_thread(
        run_on_terminal,
        TRACE_REDUCER, "export-rl", str(root), "--format", "jsonl", "--out", str(tmp_path / "o"),
        "--quiet",
    )  # fmt: skip
    assert code == 0, terminal
    assert terminal == "", terminal
    assert out.startswith("wrote 7 samples"), out


def bundles_under(root: Path) -> list[str]:
    return sorted(str(path) for path in root.iterdir())


async def test_export_otlp_shows_its_reduction_on_a_terminal(root: Path) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="export-otlp needs the otel extra")
    bundles = bundles_under(root)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    # A closed port: the bar comes before the first send, which then fails in one line.
    code, out, terminal = await asyncio.to_thread(
        run_on_terminal,
        TRACE_REDUCER, "export-otlp", *bundles, "--endpoint", closed, "--timeout", "1",
    )  # fmt: skip
    assert code == 1, terminal
    assert "export-otlp: reducing" in terminal
    assert f"{len(bundles)}/{len(bundles)}" in terminal
    bar_end = terminal.rindex(f"{len(bundles)}/{len(bundles)}")
    assert "could not export spans to" in terminal[bar_end:], terminal
    assert out == ""
    code, _, terminal = await asyncio.to_thread(
        run_on_terminal,
        TRACE_REDUCER, "export-otlp", *bundles, "--endpoint", closed, "--timeout", "1", "--quiet",
    )  # fmt: skip
    assert code == 1
    assert "reducing" not in terminal
    assert "could not export spans to" in terminal
