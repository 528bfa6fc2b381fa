"""`trace-reducer view ROOT` in headless Chromium: the run list over a root of good, torn,
corrupt, live, forked and hostile bundles recorded by real agent servers — filters, search,
sorting, live updates; the run page's rewards, fork links, logprob toggle, waterfall, JSON tree
and diff; the static site offline; nothing from a bundle ever runs or fetches anything."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

pytest.importorskip(
    "playwright.sync_api", reason="needs the viewer-tests extra (make installs it into .venv)"
)
from playwright.sync_api import Browser, Dialog, Page, Route
from playwright.sync_api import Error as PlaywrightError

from agent_server.config import Settings
from agent_server.server import AgentServer
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.agent_server.conftest import Harness, clean_env
from tests.agent_server.scripted_provider import answer

from .bundles import one_turn_bundle
from .live import scripted_agent

# Skips this module too where Chromium is missing; the same browser, launched once a module.
from .test_view_browser import browser  # noqa: F401 - a fixture
from .test_watch import frame_ends

BIN = Path(sys.executable).parent
ROOT_DIR = Path(__file__).resolve().parents[2]


class Canary:
    """A loopback HTTP server that counts every request: a page must never reach it."""

    def __init__(self) -> None:
        hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.hits = hits
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def hostile_texts(canary: str) -> dict[str, str]:
    script = "<script>window.__pwned = 1</script>"
    return {
        "model": '<img src=x onerror="window.__pwned=2">',
        "instructions": f"Be <b>bold</b> {script}",
        "user": f'Hi {script} <img src="{canary}/user.png">',
        "reply": (
            "# Title <script>window.__pwned = 3</script>\n"
            f"**bold** [run me](javascript:window.__pwned=4) and [a page]({canary}/clicked)\n"
            f"![pixel]({canary}/pixel.png) <img src={canary}/raw.png onerror=window.__pwned=5>\n"
            f"- item <iframe src={canary}/frame></iframe>\n"
            "```\n<script>window.__pwned = 6</script>\n```"
        ),
        "meta": f'<svg onload="window.__pwned=7"></svg>{script}',
        "source": f"<a href='javascript:window.__pwned=8'>judge</a> {canary}/source.png",
    }


@dataclass
class Recorded:
    root: Path
    parent: str
    forks: list[str]
    failed: str
    hostile: str
    torn: str
    corrupt: str


def local_settings(root: Path, delay: float = 0.0) -> Settings:
    return Settings(
        listen="127.0.0.1:0",
        provider_url=None,
        model="local-model",
        trace_root=root,
        max_retries=0,
        retry_base_delay=0.0,
        local_word_delay=delay,
    )


async def _turn(agent: Harness, thread_id: str, text: str) -> None:
    events = agent.events(thread_id)
    turn = await agent.start_turn(thread_id, text)
    await events.turn_completed(turn.id)


async def _record(root: Path, canary: str) -> Recorded:
    evil = hostile_texts(canary)
    server = await AgentServer.start(local_settings(root))
    channel = grpc.aio.insecure_channel(server.address)
    agent = Harness(server, channel, agent_pb2_grpc.AgentServiceStub(channel), root)
    stub = agent.stub
    try:
        parent = await agent.start_thread(
            capture_logprobs=True,
            temperature=1.0,
            policy_version="policy-7",
            metadata={"task": "q1"},
        )
        await _turn(agent, parent.id, "What is two and two?")
        forks = (
            await stub.ForkThread(
                agent_pb2.ForkThreadRequest(thread_id=parent.id, count=3, group_id="q1-group")
            )
        ).threads
        for fork, score in zip(forks, (0.9, 0.1, 0.5), strict=True):
            await _turn(agent, fork.id, "Answer with a number.")
            await stub.RecordReward(
                agent_pb2.RecordRewardRequest(thread_id=fork.id, name="score", value=score)
            )
        extra = []
        for name in ("torn", "corrupt"):
            thread = await agent.start_thread(metadata={"case": name})
            await _turn(agent, thread.id, f"A {name} one.")
            extra.append(thread)
        for thread in [parent, *forks, *extra]:
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    finally:
        for log in agent.logs:
            await log.close()
        await server.stop()
        await channel.close(None)

    async with scripted_agent(root) as (scripted, provider):
        provider.queue(answer(evil["reply"], "msg-evil"))
        hostile = await scripted.start_thread(
            model=evil["model"], instructions=evil["instructions"], metadata={"note": evil["meta"]}
        )
        await _turn(scripted, hostile.id, evil["user"])
        await scripted.stub.RecordReward(
            agent_pb2.RecordRewardRequest(
                thread_id=hostile.id,
                name="judge<script>",
                value=0.3,
                source=evil["source"],
                metadata={"why": evil["meta"]},
            )
        )
        provider.queue_error(500, {"error": {"message": "the provider broke", "code": "boom"}})
        failed = await scripted.start_thread()
        await _turn(scripted, failed.id, "This one fails.")
        for thread in (hostile, failed):
            await scripted.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))

    torn, corrupt = (Path(t.bundle_path) / "trace.binpb" for t in extra)
    data = torn.read_bytes()
    ends = frame_ends(data)
    torn.write_bytes(data[: ends[-3] + (ends[-2] - ends[-3]) // 2])
    broken = bytearray(corrupt.read_bytes())
    broken[len(broken) // 2] ^= 0x5A
    corrupt.write_bytes(bytes(broken))
    # Old enough not to count as being written.
    for path in (torn, corrupt):
        os.utime(path, (1_700_000_000, 1_700_000_000))
    return Recorded(
        root, parent.id, [f.id for f in forks], failed.id, hostile.id, extra[0].id, extra[1].id
    )


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    server = Canary()
    yield server
    server.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, canary: Canary) -> Recorded:
    return asyncio.run(_record(tmp_path_factory.mktemp("site") / "traces", canary.url))


@contextlib.contextmanager
def served(root: Path, *extra: str, **env: str) -> Iterator[str]:
    """`trace-reducer view ROOT --listen 127.0.0.1:0` as a user runs it; its address."""
    process = subprocess.Popen(
        [str(BIN / "trace-reducer"), "view", str(root), "--listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(**env),
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), (line, process.stderr)
        yield line.removeprefix("serving ").strip()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""


@dataclass
class Watched:
    page: Page
    requests: list[str]
    errors: list[str]
    dialogs: list[str]


OpenPage = Callable[[str], Watched]


@pytest.fixture
def open_page(browser: Browser) -> Iterator[OpenPage]:  # noqa: F811 - the fixture
    pages: list[Watched] = []

    def opener(url: str) -> Watched:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        watched = Watched(page, [], [], [])

        def on_dialog(dialog: Dialog) -> None:
            watched.dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("request", lambda request: watched.requests.append(request.url))
        page.on("pageerror", lambda error: watched.errors.append(str(error)))
        page.on("dialog", on_dialog)
        page.goto(url)
        page.wait_for_selector("body[data-ready=true]")
        pages.append(watched)
        return watched

    yield opener
    for watched in pages:
        assert not watched.errors, watched.errors
        assert not watched.dialogs, watched.dialogs
        watched.page.close()


def embedded_records(page: str) -> int:
    """records_read of the state a run page was served with."""
    start = page.index('id="view-data">') + len('id="view-data">')
    data = json.loads(page[start : page.index("</script>", start)])
    return int(data["trace"]["integrity"]["records_read"])


def settled(page: Page) -> None:
    """Waits for the served list to draw its server's answer to the change just made (a
    static list draws at once)."""
    page.wait_for_selector("body[data-busy=false]", state="attached")


def token_column(page: Page) -> list[int]:
    """The tokens column of the rows drawn, top to bottom."""
    cells: list[str] = page.eval_on_selector_all(
        "#runs tbody tr td:nth-child(7)", "cells => cells.map(c => c.textContent)"
    )
    return [int(text.replace(",", "")) for text in cells]


def row_threads(page: Page) -> list[str]:
    threads: list[str] = page.eval_on_selector_all(
        "#runs tbody tr", "rows => rows.map(r => r.dataset.thread)"
    )
    return threads


def test_the_list_filters_searches_sorts_and_opens_each_run(
    recorded: Recorded, open_page: OpenPage, canary: Canary
) -> None:
    opener = open_page
    with served(recorded.root) as address:
        watched = opener(address)
        page = watched.page
        everyone = {recorded.parent, *recorded.forks, recorded.failed, recorded.hostile}
        everyone |= {recorded.torn, recorded.corrupt}
        assert set(row_threads(page)) == everyone
        assert page.inner_text("#count").strip() == f"{len(everyone)} of {len(everyone)} runs"

        page.select_option("#status", "failed")
        settled(page)
        assert row_threads(page) == [recorded.failed]
        page.select_option("#status", "")
        settled(page)
        page.select_option("#integrity", "CORRUPT")
        settled(page)
        assert row_threads(page) == [recorded.corrupt]
        page.select_option("#integrity", "TRUNCATED")
        settled(page)
        assert row_threads(page) == [recorded.torn]
        page.select_option("#integrity", "")
        settled(page)
        page.fill("#reward", "score<0.6")
        settled(page)
        assert set(row_threads(page)) == {recorded.forks[1], recorded.forks[2]}
        page.fill("#reward", "")
        settled(page)
        page.fill("#search", "two and two")
        settled(page)
        assert set(row_threads(page)) == {recorded.parent, *recorded.forks}
        page.fill("#search", "")
        settled(page)

        page.click("th[data-sort=tokens]")
        settled(page)
        tokens = token_column(page)
        assert tokens == sorted(tokens)
        assert len(set(tokens)) > 1
        page.click("th[data-sort=tokens]")
        settled(page)
        assert page.get_attribute("th[data-sort=tokens]", "aria-sort") == "descending"

        # The low-reward fork: its reward, its parent and its group's siblings, linked.
        page.fill("#reward", "score<0.2")
        settled(page)
        assert row_threads(page) == [recorded.forks[1]]
        page.click(f"tr[data-thread={recorded.forks[1]}] a.run-link")
        page.wait_for_selector("body[data-rollout-ready=true]")
        assert page.inner_text("#rewards .reward-name") == "score"
        assert page.inner_text("#rewards .reward-value") == "0.1000"
        group = page.eval_on_selector_all(
            "#fork .fork-group a.run-link", "links => links.map(a => a.textContent)"
        )
        assert len(group) == 2
        assert "q1-group" in page.inner_text("#fork")
        # Ids are short on the face of the page and whole on hover.
        short = page.locator("#fork .fork-chain .short-id").first
        assert short.get_attribute("title") == recorded.parent
        assert len(short.inner_text()) < len(recorded.parent)
        assert "policy-7" in page.inner_text("#calls")
        assert "temperature=1" in page.inner_text("#calls")
        assert "completed" in page.inner_text("#calls .stop")

        assert page.locator("#tokens .tok").count() == 0
        page.click("#logprob-toggle")
        assert page.locator("#tokens .tok").count() > 5
        assert page.get_attribute("#logprob-toggle", "aria-pressed") == "true"
        title = page.get_attribute("#tokens .tok >> nth=0", "title") or ""
        assert title.startswith("logprob ")

        assert page.locator("#waterfall .wf-row").count() >= 1
        starts = page.eval_on_selector_all(
            "#waterfall .wf-row", "rows => rows.map(r => Number(r.dataset.start))"
        )
        assert starts == sorted(starts)

        page.click("#requests details.request summary")
        page.wait_for_selector("#requests .request-view")
        # The fork's first request is its bundle's first: every input item is new to it, the
        # parent's question (read from the parent's bundle) and its own.
        assert "first call" in page.inner_text("#requests .diff-head")
        diff = page.inner_text("#requests .request-diff")
        assert "What is two and two?" in diff
        assert "Answer with a number." in diff
        assert page.locator("#requests .json-node").count() > 3

        page.click("#fork .fork-chain a.run-link")
        page.wait_for_selector("body[data-rollout-ready=true]")
        assert page.inner_text("#thread-id") == recorded.parent
        children = page.locator("#fork .fork-children a.run-link").count()
        assert children == 3
        assert not canary.hits


@pytest.mark.timeout(150)
def test_a_list_of_many_runs_draws_a_page_of_rows_and_searches_them_all(
    open_page: OpenPage, tmp_path: Path
) -> None:
    # Thousands of rows were drawn again at every keystroke of a search (0.7 s at 9,000 runs).
    root = tmp_path / "many"
    for index in range(600):
        one_turn_bundle(root, thread_id=f"thr_{index:04d}")
    with served(root) as address:
        page = open_page(address).page
        assert len(row_threads(page)) == 500
        assert page.inner_text("#count").strip() == "500 shown, 600 of 600 runs"
        # The page holds the rows it draws; its server searches, filters and sorts the rest.
        data = json.loads(page.inner_text("#list-data"))
        assert len(data["runs"]) == 500
        assert page.inner_text("#more") == "show 100 more of 100"

        # The search runs over every run, drawn or not.
        drawn = set(row_threads(page))
        hidden = next(f"thr_{i:04d}" for i in range(600) if f"thr_{i:04d}" not in drawn)
        page.fill("#search", hidden)
        settled(page)
        assert row_threads(page) == [hidden]
        assert page.inner_text("#count").strip() == "1 of 600 runs"
        assert page.locator("#more").count() == 0
        page.fill("#search", "")
        settled(page)

        page.click("#more")
        settled(page)
        assert sorted(row_threads(page)) == [f"thr_{i:04d}" for i in range(600)]
        assert page.inner_text("#count").strip() == "600 of 600 runs"
        assert page.locator("#more").count() == 0


def test_the_list_polls_less_often_while_its_server_is_slow_to_answer(
    open_page: OpenPage, tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    one_turn_bundle(root, thread_id="thr_only")
    with served(root) as address:
        page = open_page(address).page
        # The page's policy allows no script of ours: attribute selectors, then.
        page.wait_for_selector("body[data-poll-ms='2000']", state="attached")

        def slow(route: Route) -> None:
            # A server slow to answer, as one listing tens of thousands of runs is.
            time.sleep(0.6)
            route.continue_()

        page.route(re.compile(r"/api/runs\?"), slow)
        page.wait_for_selector("body:not([data-poll-ms='2000'])", state="attached", timeout=30_000)
        assert int(page.get_attribute("body", "data-poll-ms") or 0) >= 2400
        page.unroute(re.compile(r"/api/runs\?"))
        page.wait_for_selector("body[data-poll-ms='2000']", state="attached", timeout=30_000)


def test_a_bundle_being_written_updates_the_list_and_its_page(
    recorded: Recorded, open_page: OpenPage, tmp_path: Path
) -> None:
    root = tmp_path / "live"
    shutil.copytree(recorded.root, root)
    agent = subprocess.Popen(
        [
            str(BIN / "agent-server"),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--trace-root",
            str(root),
            "--local-word-delay",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert agent.stdout is not None
        address = agent.stdout.readline().removeprefix("listening on ").strip()
        with grpc.insecure_channel(address) as channel, served(root) as viewer:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            thread = stub.StartThread(agent_pb2.StartThreadRequest()).thread
            turn = stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="tell me a long story")]
                )
            ).turn
            # The run's page first, while its turn streams; then the list.
            url = viewer + "run/" + Path(thread.bundle_path).name
            with urllib.request.urlopen(url) as served_page:
                first = embedded_records(served_page.read().decode())
            run = open_page(url)
            records = (
                "() => JSON.parse(document.getElementById('view-data').textContent)"
                ".trace.integrity.records_read"
            )
            # The page reloads itself as records arrive: wait for a load showing more.
            grown = 0
            for _ in range(150):
                with contextlib.suppress(PlaywrightError):
                    grown = int(run.page.evaluate(records))
                if grown > first:
                    break
                run.page.wait_for_timeout(100)
            assert grown > first, (first, grown)
            listing = open_page(viewer)
            row = f"tr[data-thread={thread.id}]"
            listing.page.wait_for_selector(f"{row}.st-live", timeout=15_000)
            events = stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id))
            for response in events:
                if response.event.HasField("turn_completed"):
                    ended = response.event.turn_completed.turn
                    break
            events.cancel()  # type: ignore[no-untyped-call]
            assert (ended.id, ended.status) == (turn.id, agent_pb2.TURN_STATUS_COMPLETED)
            stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            listing.page.wait_for_selector(f"{row}.st-completed", timeout=15_000)
            assert int(listing.page.get_attribute("body", "data-updates") or 0) >= 1
            # Once nothing changes, a poll is answered without the list: the page sent its tag.
            unchanged = listing.page.wait_for_event(
                "response",
                lambda response: "/api/runs?" in response.url and response.status == 304,
                timeout=15_000,
            )
            assert unchanged.headers["etag"]
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)


def test_hostile_bundles_never_run_code_or_fetch_anything(
    recorded: Recorded, open_page: OpenPage, canary: Canary, tmp_path: Path
) -> None:
    evil = hostile_texts(canary.url)
    site = tmp_path / "site"
    out = subprocess.run(
        [str(BIN / "trace-reducer"), "view", str(recorded.root), "-o", str(site)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()) == site / "index.html"
    with served(recorded.root) as address:
        pages = [address, (site / "index.html").as_uri()]
        for index_url in pages:
            listing = open_page(index_url)
            href = listing.page.get_attribute(
                f"tr[data-thread={recorded.hostile}] a.run-link", "href"
            )
            assert href
            listing.page.click(f"tr[data-thread={recorded.hostile}] a.run-link")
            page = listing.page
            page.wait_for_selector("body[data-rollout-ready=true]")
            page.click("#requests details.request summary")
            page.click("#logprob-toggle") if page.locator("#logprob-toggle").count() else None
            page.wait_for_timeout(300)
            assert page.evaluate("window.__pwned") is None
            text = page.inner_text("body")
            assert evil["model"] in text
            assert "javascript:window.__pwned=4" not in [
                a
                for a in page.eval_on_selector_all(
                    "a", "links => links.map(a => a.getAttribute('href'))"
                )
                if a
            ]
            assert page.locator("img, iframe, svg, object, embed").count() == 0
            assert page.locator("#main .md strong").count() >= 1
            assert "[image: pixel]" in page.inner_text("#main")
            assert "judge<script>" in page.inner_text("#rewards")
            hrefs = page.eval_on_selector_all(
                "a[href]", "links => links.map(a => a.getAttribute('href'))"
            )
            assert all(not h.lower().startswith("javascript:") for h in hrefs)
            # Only the page itself (and, served, its own server) was ever asked for anything.
            origin = index_url.split("/", 3)[:3]
            for url in listing.requests:
                assert url.startswith("file://") or url.split("/", 3)[:3] == origin, url
    assert not canary.hits, canary.hits


def test_static_site_reads_offline(recorded: Recorded, open_page: OpenPage, tmp_path: Path) -> None:
    site = tmp_path / "static"
    subprocess.run(
        [str(BIN / "trace-reducer"), "view", str(recorded.root), "-o", str(site)], check=True
    )
    listing = open_page((site / "index.html").as_uri())
    assert len(row_threads(listing.page)) == 8
    # Offline, the page searches, filters and sorts the runs it holds itself.
    page = listing.page
    page.select_option("#status", "failed")
    assert row_threads(page) == [recorded.failed]
    page.select_option("#status", "")
    page.fill("#reward", "score<0.6")
    assert set(row_threads(page)) == {recorded.forks[1], recorded.forks[2]}
    page.fill("#reward", "")
    page.fill("#search", "two and two")
    assert set(row_threads(page)) == {recorded.parent, *recorded.forks}
    assert page.inner_text("#count").strip() == "4 of 8 runs"
    # The fields `list --text` searches: a fork group's id finds its forks (it found none).
    page.fill("#search", "Q1-GROUP")
    assert set(row_threads(page)) == set(recorded.forks)
    page.fill("#search", "")
    page.click("th[data-sort=tokens]")
    tokens = token_column(page)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) > 1
    listing.page.click(f"tr[data-thread={recorded.forks[0]}] a.run-link")
    listing.page.wait_for_selector("body[data-rollout-ready=true]")
    assert listing.page.inner_text("#rewards .reward-value") == "0.9000"
    listing.page.click("#fork .fork-chain a.run-link")
    listing.page.wait_for_selector("body[data-rollout-ready=true]")
    assert listing.page.inner_text("#thread-id") == recorded.parent
    assert all(url.startswith("file://") for url in listing.requests)


def test_a_static_run_page_runs_its_shared_scripts_and_no_script_tag_slipped_in(
    open_page: OpenPage, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    one_turn_bundle(root, text="the answer on the page")
    site = tmp_path / "site"
    subprocess.run([str(BIN / "trace-reducer"), "view", str(root), "-o", str(site)], check=True)
    (page_file,) = (site / "runs").iterdir()
    # What markup that ever slipped through a page could do: load a script beside the site's.
    (site / "assets" / "slipped.js").write_text("window.__pwned = 1;\n")
    text = page_file.read_text(encoding="utf-8")
    slipped = '<script src="../assets/slipped.js"></script>'
    page_file.write_text(text.replace("<body>", "<body>" + slipped, 1), encoding="utf-8")
    opened = open_page(page_file.as_uri())
    page = opened.page
    page.wait_for_selector("body[data-rollout-ready=true]")
    assert "the answer on the page" in page.inner_text("#main")
    # Its style came from the shared sheet too.
    assert page.eval_on_selector("#tabs", "nav => getComputedStyle(nav).display") == "flex"
    # The loader's scripts ran; the one the page's markup named did not (a policy of 'self'
    # would have let it).
    assert page.evaluate("window.__pwned") is None
    assert all(url.startswith("file://") for url in opened.requests)


def test_a_token_guards_the_served_viewer(recorded: Recorded) -> None:
    with served(recorded.root, "--token-env", "VIEW_TOKEN", VIEW_TOKEN="s3cret-token") as address:
        assert address.endswith("?token=s3cret-token")
        base = address.split("?")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "api/runs")
        assert refused.value.code == 401
        assert b"s3cret" not in refused.value.read()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with opener.open(address) as page:
            assert page.status == 200
            assert "token=" not in page.url
        with opener.open(base + "api/runs") as runs:
            assert runs.status == 200
        with pytest.raises(urllib.error.HTTPError) as outside:
            opener.open(base + "run/..%2F..%2Fetc")
        assert outside.value.code == 404


def test_readme_screenshots(recorded: Recorded, open_page: OpenPage, tmp_path: Path) -> None:
    """The README's pictures of the list and a run page, taken from these bundles; with
    ROLLOUT_UPDATE_SCREENSHOTS=1 they replace docs/list.png and docs/run.png."""
    shots = ROOT_DIR / "docs" if os.environ.get("ROLLOUT_UPDATE_SCREENSHOTS") == "1" else tmp_path
    with served(recorded.root) as address:
        listing = open_page(address)
        listing.page.set_viewport_size({"width": 1400, "height": 520})
        listing.page.screenshot(path=str(shots / "list.png"))
        listing.page.click(f"tr[data-thread={recorded.forks[1]}] a.run-link")
        listing.page.wait_for_selector("body[data-rollout-ready=true]")
        listing.page.click("#logprob-toggle")
        listing.page.locator("#tokens").scroll_into_view_if_needed()
        listing.page.set_viewport_size({"width": 1400, "height": 900})
        listing.page.screenshot(path=str(shots / "run.png"))
    for name in ("list.png", "run.png"):
        assert re.match(rb"\x89PNG", (shots / name).read_bytes()[:4])
