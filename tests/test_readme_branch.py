"""The README's branch recipe runs as written: a recorded run branched at turn 3 onto vLLM is a
fork of it, and `diff`, `export-rl` and the served viewer (in Chromium) show both runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "playwright.sync_api", reason="needs the viewer-tests extra (make installs it into .venv)"
)
from playwright.sync_api import Browser

from tests.agent_server.conftest import serve
from tests.test_readme import example
from tests.test_readme_replay import TRACE_REDUCER, _in, commands
from tests.trace_reducer.test_site_browser import served

# Skips this module too where Chromium is missing; the same browser, launched once a module.
from tests.trace_reducer.test_view_browser import browser  # noqa: F401 - a fixture
from trace_reducer import replay_bundle

README_ENGINE = "http://127.0.0.1:8000/v1"


async def _record_and_branch(directory: Path, vllm_url: str) -> tuple[Path, Path]:
    namespace: dict[str, Any] = {}
    exec(compile(example("replay"), "README.md", "exec"), namespace)
    record = commands("replay")[0]
    branch = commands("branch")[0]
    assert branch[:2] == ["agent-server", "serve"]
    assert README_ENGINE in branch
    async with serve(*_in(directory, record[2:], {})) as original:
        recorded = Path(await namespace["my_agent"](original.address))
    argv = [vllm_url if arg == README_ENGINE else arg for arg in _in(directory, branch[2:], {})]
    async with serve(*argv) as branching:
        branched = Path(await namespace["my_agent"](branching.address))
    assert "branches from" in branching.stderr.decode(), branching.stderr.decode()
    return recorded, branched


def _trace_reducer(argv: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [TRACE_REDUCER, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" not in result.stderr
    return result


@pytest.mark.engine
@pytest.mark.timeout(400)
def test_a_run_branched_at_turn_3_onto_vllm_sits_beside_it(
    tmp_path: Path,
    vllm_url: str,
    browser: Browser,  # noqa: F811 - the fixture
) -> None:
    # Playwright's sync API holds this thread's event loop: the servers run on another (a
    # daemon, so that a timeout does not wait for it).
    runs: list[tuple[Path, Path]] = []
    failures: list[BaseException] = []

    def record() -> None:
        try:
            runs.append(asyncio.run(_record_and_branch(tmp_path, vllm_url)))
        except BaseException as error:
            failures.append(error)

    worker = threading.Thread(target=record, daemon=True)
    worker.start()
    worker.join()
    if failures:
        raise failures[0]
    ((recorded, branched),) = runs
    root = tmp_path / "runs" / "original"
    # The replay of turns 1-2 gave way to the fork's bundle: the root holds the two runs.
    assert sorted(p.name for p in root.iterdir()) == sorted([recorded.name, branched.name])
    original, branch = replay_bundle(recorded), replay_bundle(branched)
    assert branch.fork.resolved
    assert branch.fork.parent_thread_id == original.root_thread_id
    turn_ids = list(original.threads[original.root_thread_id].turn_ids)
    assert branch.fork.after_turn_id == turn_ids[1]
    # Turns 3 and 4 went to vLLM, asking for its model.
    assert {call.model for call in branch.inference_calls.values()} == {"smollm2-135m-instruct"}
    # Its own turns are 3 and 4; 1 and 2 are the original's.
    assert len(branch.threads[branch.root_thread_id].turn_ids) == 2

    diff, export, view = commands("branch")[1:]
    bundles = {"original": recorded.name}
    result = _trace_reducer(_in(tmp_path, diff[1:], bundles, branched.name))
    assert result.returncode == 1, result.stderr
    assert "calls 1-3 are the same" in result.stdout
    assert "first difference at call 4" in result.stdout

    result = _trace_reducer(_in(tmp_path, export[1:], bundles))
    assert result.returncode == 0, result.stderr
    (written,) = (tmp_path / "runs" / "rl").glob("*.jsonl")
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert {row["group_id"] for row in rows} == {original.root_thread_id}
    assert sorted(row["repetition_index"] for row in rows) == [0, 1]
    # Both hold the whole conversation: the same turns 1-2 and turn 3's question (7 messages:
    # the tool round is a call and its output), then each its own answers.
    contents = [[str(m["content"]) for m in row["messages"]] for row in rows]
    assert contents[0][:7] == contents[1][:7]
    assert contents[0][6] == "what did you find?"
    assert contents[0][7] != contents[1][7]

    assert view[:2] == ["trace-reducer", "view"]
    assert view[3:] == ["--listen", "127.0.0.1:8080"]
    with served(root) as url:
        page = browser.new_page()
        try:
            page.goto(url)
            page.wait_for_selector("body[data-ready=true]")
            assert page.locator("a.run-link").count() == 2
            assert "fork #1" in page.inner_text("body")
            page.goto(url)
            page.wait_for_selector("body[data-ready=true]")
            page.click(f"a.run-link:has([data-full='{original.root_thread_id}'])")
            page.wait_for_selector("body[data-rollout-ready=true]")
            children = page.locator("#fork .fork-children a.run-link")
            assert children.count() == 1
            children.first.click()
            page.wait_for_selector("body[data-rollout-ready=true]")
            assert page.inner_text("#thread-id") == branch.root_thread_id
            assert "forks it after turn" in page.inner_text("#fork")
        finally:
            page.close()
