"""`trace-reducer view A --diff B` in headless Chromium: the first divergence of two runs, as
`diff` reports it, with script and markup in the diffed texts shown as text, never run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "playwright.sync_api", reason="needs the viewer-tests extra (make installs it into .venv)"
)
from playwright.sync_api import sync_playwright

from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import StartAgent
from tests.trace_reducer.test_view_browser import CHROMIUM, CHROMIUM_ARGS
from trace_reducer import diff_runs

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
HOSTILE_A = "<script>window.__pwned = 1</script> seen"
HOSTILE_B = '<img src=x onerror="window.__pwned = 2"> changed'


def _page_texts(page_file: Path, home: Path) -> dict[str, object]:
    """What Chromium shows of the page: its parts' texts, what ran, what it fetched."""
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env={**os.environ, "HOME": str(home)}
        )
        try:
            page = chromium.new_page()
            requests: list[str] = []
            errors: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(page_file.resolve().as_uri())
            page.wait_for_selector("body[data-ready=true]")
            return {
                "runs": page.inner_text("#runs"),
                "verdict": page.inner_text("#verdict"),
                "details": page.inner_text("#details"),
                "request_diff": page.inner_text("#request-diff"),
                "added": page.locator("#request-diff .add").all_inner_texts(),
                "removed": page.locator("#request-diff .del").all_inner_texts(),
                "pwned": page.evaluate("window.__pwned === undefined ? null : window.__pwned"),
                "images": page.locator("img").count(),
                "scripts": page.locator("script").count(),
                "requests": requests,
                "errors": errors,
            }
        finally:
            chromium.close()


async def test_the_first_divergence_of_two_runs_as_a_page(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    live = await start_agent(provider_url=None, local_word_delay=0.0)

    async def run(text: str) -> Path:
        thread = await live.start_thread()
        events = live.events(thread.id)
        first = await live.start_turn(thread.id, "the same start")
        await events.turn_completed(first.id)
        second = await live.start_turn(thread.id, text)
        await events.turn_completed(second.id)
        await live.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
        return Path(thread.bundle_path)

    original, replayed = await run(HOSTILE_A), await run(HOSTILE_B)
    expected = diff_runs(original, replayed)
    assert expected.first is not None

    out = tmp_path / "diff.html"
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        "view",
        str(original),
        "--diff",
        str(replayed),
        "-o",
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    assert stdout.decode().strip() == str(out)

    shown = await asyncio.to_thread(_page_texts, out, tmp_path / "chromium-home")
    assert shown["errors"] == []
    assert shown["pwned"] is None
    assert shown["images"] == 0
    assert shown["scripts"] == 0
    assert shown["requests"] == [out.resolve().as_uri()]
    # The same comparison as `trace-reducer diff`: the same call, the same aspects.
    runs = str(shown["runs"])
    assert f"({expected.calls_a} calls)" in runs
    assert str(original) in runs
    assert f"first difference at call {expected.first.number}" in str(shown["verdict"])
    assert "request" in str(shown["verdict"])
    # The local model says back what it was told: the accepted items differ too.
    assert HOSTILE_A in str(shown["details"])
    assert expected.same_calls == 1
    assert "call 1 is the same" in str(shown["details"])
    # The hostile texts are there, as text, on the two sides of the request bodies' diff.
    assert any(HOSTILE_A.replace('"', '\\"') in line for line in shown["removed"])  # type: ignore[attr-defined]
    assert any(HOSTILE_B.replace('"', '\\"') in line for line in shown["added"])  # type: ignore[attr-defined]


def test_view_diff_refuses_what_is_not_a_bundle(tmp_path: Path) -> None:
    result = subprocess.run(
        [TRACE_REDUCER, "view", str(tmp_path), "--diff", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
