"""Hostile input at `trace-reducer list`'s index and the served viewer: a corrupt, hostile,
symlinked or FIFO index file, tokens and cookies of any bytes, paths that leave the root, and
`--listen` values no socket takes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.malformed_http import (
    MALFORMED_REQUESTS,
    SECRET,
    refusals,
    status_line,
    until_closed,
)
from tests.trace_reducer.bundles import BundleBuilder, fork_of, user_item
from tests.trace_reducer.conftest import GOLDEN, TRACE_REDUCER
from tests.trace_reducer.live import eventually, open_descriptors
from tests.trace_reducer.site import served_site
from trace_reducer.batch._listing import INDEX_FILE_NAME, list_runs
from trace_reducer.bundle._confine import BundleRoot, ConfinedBundle
from trace_reducer.view._site import TOKEN_COOKIE, SiteServer


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRACE_REDUCER, *args], capture_output=True, text=True, timeout=timeout)


def _index(root: Path) -> dict[str, Any]:
    head = (root / INDEX_FILE_NAME).read_text(encoding="utf-8").split("\n", 1)[0]
    data: dict[str, Any] = json.loads(head)
    return data


def test_a_fifo_or_symlink_index_is_never_opened(root: Path, tmp_path: Path) -> None:
    honest = _run("list", "--json", str(root))
    index = root / INDEX_FILE_NAME
    index.unlink()
    os.mkfifo(index)
    # Was: `list` waited on the FIFO forever (and so did the served viewer's list page).
    done = _run("list", "--json", str(root), timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == honest.stdout
    outside = tmp_path / "outside.json"
    planted = {"version": 1, "entries": {str(root / "x"): {"key": [], "run": {}}}}
    outside.write_text(json.dumps(planted), encoding="utf-8")
    index.unlink()
    index.symlink_to(outside)
    done = _run("list", "--json", str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout == honest.stdout
    # The link was replaced by the index, never written through.
    assert json.loads(outside.read_text(encoding="utf-8")) == planted
    assert not index.is_symlink()


def test_a_fifo_or_symlink_named_index_html_in_the_site_is_replaced(
    root: Path, tmp_path: Path
) -> None:
    # Was: `view ROOT -o DIR` waited for ever on a FIFO named index.html in DIR, and wrote
    # the list through a symbolic link of that name.
    outside = tmp_path / "precious.html"
    outside.write_text("keep me")
    for kind in ("fifo", "link"):
        site = tmp_path / f"site-{kind}"
        site.mkdir()
        if kind == "fifo":
            os.mkfifo(site / "index.html")
        else:
            (site / "index.html").symlink_to(outside)
        done = _run("view", str(root), "-o", str(site), timeout=30)
        assert done.returncode == 0, (kind, done.stderr)
        assert not (site / "index.html").is_symlink()
        assert "<html" in (site / "index.html").read_text(encoding="utf-8")
    assert outside.read_text() == "keep me"


def test_an_index_of_foreign_json_is_rebuilt(root: Path) -> None:
    honest = list_runs(str(root)).runs
    for data in (b"[]", b'{"version": 1, "entries": []}', b"[" * 100_000, b"\xff not json"):
        (root / INDEX_FILE_NAME).write_bytes(data)
        assert list_runs(str(root)).runs == honest


@pytest.fixture
async def site(root: Path) -> AsyncIterator[str]:
    server = SiteServer(str(root), "s3cret-token")
    address = await server.start("127.0.0.1", 0)
    yield address
    await server.stop()


async def test_a_token_or_cookie_of_any_characters_is_a_401(
    site: str, capfd: pytest.CaptureFixture[str]
) -> None:
    async with httpx.AsyncClient(base_url=site) as http:
        for query in ("?token=%C3%A9t%C3%A9", "?token=%00", "?token=" + "x" * 4000):
            answer = await http.get("/" + query)
            # Was: 500 and a TypeError traceback (compare_digest of non-ASCII text).
            assert answer.status_code == 401, (query, answer.status_code)
        for cookie in (b'"\\303\\251"', "été".encode(), b"\xff\xfe"):
            http.cookies.clear()
            answer = await http.get("/", headers={b"cookie": TOKEN_COOKIE.encode() + b"=" + cookie})
            assert answer.status_code == 401, (cookie, answer.status_code)
        answer = await http.get("/?token=s3cret-token")
        assert answer.status_code == 302
        answer = await http.get("/", headers={"cookie": f"{TOKEN_COOKIE}=s3cret-token"})
        assert answer.status_code == 200
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out


def test_the_printed_address_opens_the_viewer_whatever_the_token_holds(root: Path) -> None:
    # Was: the token printed as it is, so one holding `+`, `&`, `#` or `%` made an address
    # that was answered 401 (`+` read back as a space, the rest cut off).
    token = "a+b&c#d %2F é"
    process = subprocess.Popen(
        [TRACE_REDUCER, "view", str(root), "--listen", "127.0.0.1:0", "--token-env", "VIEW_T"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "VIEW_T": token},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line
        address = line.removeprefix("serving ").strip()
        with httpx.Client() as http:
            opened = http.get(address, follow_redirects=True)
            assert opened.status_code == 200
            assert http.cookies.get(TOKEN_COOKIE) is not None
            assert http.get(address.split("?")[0] + "api/runs").status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)


async def test_served_paths_never_leave_the_root(
    site: str, root: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside-bundle"
    shutil.copytree(next(p for p in GOLDEN.iterdir() if p.name.startswith("2026")), outside)
    (root / "linked").symlink_to(outside)
    bundle = next(p for p in sorted(os.listdir(root)) if p.startswith("2026"))
    (root / bundle / "inner-link").symlink_to(outside)
    async with httpx.AsyncClient(base_url=site, cookies={TOKEN_COOKIE: "s3cret-token"}) as http:
        for path in (
            "/run/linked",
            f"/run/{bundle}/inner-link",
            "/run/..%2foutside-bundle",
            "/run/%2e%2e/outside-bundle",
            f"/run/{outside}",
            "/run/" + "%2e%2e/" * 20 + "etc",
            "/api/watch/linked",
            "/api/watch/%2e%2e/outside-bundle",
            f"/api/watch/{outside}",
            "/run/%00",
            "/run/" + "a" * 5000,
        ):
            answer = await http.get(path)
            assert answer.status_code in (400, 403, 404), (path, answer.status_code)
            assert (
                "outside-bundle" not in answer.text
                or "not followed" in answer.text
                or ("outside the bundle root" in answer.text)
            ), (path, answer.text)
        runs = (await http.get("/api/runs")).json()["runs"]
    assert all("outside-bundle" not in run["bundle"] for run in runs)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out


async def test_a_trace_put_in_the_served_root_is_passed_over(
    site: str, root: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    bundle = next(p for p in sorted(os.listdir(root)) if p.startswith("2026"))
    async with httpx.AsyncClient(base_url=site, cookies={TOKEN_COOKIE: "s3cret-token"}) as http:
        honest = (await http.get("/api/runs")).json()["runs"]
        # A stray trace after the viewer started. Was: every list answer 500, every page 404
        # "... is a bundle, not a root of bundles".
        shutil.copy(root / bundle / "trace.binpb", root / "trace.binpb")
        assert (await http.get("/api/runs")).json()["runs"] == honest
        assert (await http.get("/")).status_code == 200
        page = await http.get(f"/run/{bundle}")
        assert page.status_code == 200, page.text
        # The root itself is still no run of it.
        assert (await http.get("/run/.")).status_code in (403, 404)
        assert (await http.get("/run/trace.binpb")).status_code in (403, 404)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:", ":80x"])
def test_view_listen_values_no_socket_takes(root: Path, listen: str) -> None:
    done = _run("view", str(root), "--listen", listen, timeout=30)
    # Was: `internal error: OverflowError: bind(): port must be 0-65535.` (exit 1).
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "internal error" not in done.stderr


def test_concurrent_listings_share_one_index(root: Path) -> None:
    honest = _run("list", "--json", str(root)).stdout
    (root / INDEX_FILE_NAME).unlink()

    async def many() -> list[subprocess.CompletedProcess[str]]:
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(_run, "list", "--json", str(root)) for _ in range(4))
            )
        )

    for done in asyncio.run(many()):
        assert done.returncode == 0, done.stderr
        assert done.stdout == honest
    assert isinstance(_index(root)["version"], int)


@pytest.mark.parametrize("request_bytes", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS)
async def test_a_request_the_parser_refuses_is_logged_without_its_bytes(
    root: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    server = SiteServer(str(root), SECRET)
    address = await server.start("127.0.0.1", 0)
    try:
        head = await status_line(int(address.rsplit(":", 1)[1].rstrip("/")), request_bytes)
    finally:
        await server.stop()
    assert head.split(b" ")[1] == b"400", head
    # Was: an ERROR with aiohttp's traceback, quoting the header line and the token in it.
    (line,) = refusals(caplog.records)
    assert line.startswith("WARNING refused a malformed HTTP request from 127.0.0.1: "), line


@pytest.fixture
def odd_root(root: Path) -> tuple[Path, int]:
    """The corpus with one more bundle, under a name that is not UTF-8; and how many bundles
    have names that are."""
    named = sorted(root.glob("*/trace.binpb"))
    shutil.copytree(named[0].parent, os.fsdecode(bytes(root) + b"/run\xff"))
    return root, len(named)


async def test_the_served_list_says_once_that_it_passed_over_a_name_that_is_not_utf8(
    odd_root: tuple[Path, int],
) -> None:
    root, named = odd_root
    warnings: list[str] = []
    server = SiteServer(str(root), None, warn=warnings.append)
    address = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=address) as http:
            answers = [await http.get("/api/runs") for _ in range(3)]
    finally:
        await server.stop()
    assert [answer.status_code for answer in answers] == [200] * 3
    assert len(answers[-1].json()["runs"]) == named
    # Once, not on every refresh of the list.
    assert warnings == [f"passed over {root}/run\\xff: its name is not valid UTF-8 (rename it)"]


async def test_a_served_root_removed_is_a_503_that_says_so_until_it_is_back(
    tmp_path: Path,
) -> None:
    root = tmp_path / "served"
    bundle = sorted(GOLDEN.glob("*-thread_*"))[0]
    shutil.copytree(bundle, root / "one")
    warnings: list[str] = []
    async with served_site(root, warn=warnings.append) as http:
        assert (await http.get("/api/runs")).status_code == 200
        shutil.rmtree(root)
        gone = [await http.get(path) for path in ("/api/runs", "/", "/api/runs")]
        assert [answer.status_code for answer in gone] == [503] * 3
        reason = f"the served root cannot be listed: no such file or directory: {root}"
        assert {answer.text for answer in gone} == {reason + "\n"}
        assert all("Traceback" not in answer.text for answer in gone)
        shutil.copytree(bundle, root / "one")
        back = await http.get("/api/runs")
        assert back.status_code == 200
        assert len(back.json()["runs"]) == 1
    # Said once to the operator, not at every poll.
    assert warnings == [reason]


async def test_a_live_runs_watch_ends_when_its_client_goes_away(tmp_path: Path) -> None:
    # A thread waiting for its next turn: its writer holds the bundle open, however long.
    builder = BundleBuilder(tmp_path / "root")
    builder.turn("turn-1", [user_item("hello")])
    trace_file = builder.bundle_dir / "trace.binpb"
    try:
        async with served_site(tmp_path / "root") as http:
            for _ in range(3):  # a live run page reloaded
                async with http.stream("GET", f"/api/watch/{builder.bundle_dir.name}") as answer:
                    assert answer.status_code == 200
                    first = await anext(answer.aiter_lines())
                    assert first.startswith("data: ")
                    assert open_descriptors(trace_file) == 2  # the writer's, the watch's
            # Was: every watch whose page was closed went on following the bundle (a
            # descriptor and a poll every 50 ms) for as long as its writer held it.
            await eventually(
                lambda: open_descriptors(trace_file) == 1, "the viewer closed its watches"
            )
    finally:
        builder.close()


async def test_a_request_head_that_never_ends_loses_its_connection(tmp_path: Path) -> None:
    # Slowloris: a request line and one header, then nothing. aiohttp's own bound was an
    # hour, a descriptor each; now the idle timeout. A live run's watch outlasts it.
    builder = BundleBuilder(tmp_path / "root")
    builder.turn("turn-1", [user_item("hello")])
    server = SiteServer(str(tmp_path / "root"), None, idle_timeout=0.3)
    address = await server.start("127.0.0.1", 0)
    try:
        port = int(address.rsplit(":", 1)[1].rstrip("/"))
        assert await until_closed(port, b"GET / HTTP/1.1\r\nHost: localhost\r\n") == b""
        async with (
            httpx.AsyncClient(base_url=address) as http,
            http.stream("GET", f"/api/watch/{builder.bundle_dir.name}") as answer,
        ):
            lines = answer.aiter_lines()
            first = await anext(lines)
            await asyncio.sleep(0.6)  # twice the bound, the watch waiting for the writer
            builder.turn("turn-2", [user_item("again")])
            later = ""
            async with asyncio.timeout(30):
                while not later.startswith("data: "):
                    later = await anext(lines)
    finally:
        builder.close()
        await server.stop()
    assert first.startswith("data: ")
    assert (
        json.loads(later.removeprefix("data: "))["records"]
        > json.loads(first.removeprefix("data: "))["records"]
    )


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8765", "localhost.attacker.example", ""]
)
async def test_the_tokenless_viewer_refuses_a_request_to_another_name(
    root: Path, host: str
) -> None:
    # DNS rebinding: a page whose own name the attacker points at 127.0.0.1 reads the viewer
    # as its own origin; the browser still sends that name as the Host.
    async with served_site(root) as http:
        for path in ("/", "/api/runs", f"/run/{sorted(os.listdir(root))[0]}"):
            answer = await http.get(path, headers={"Host": host})
            assert answer.status_code == 403, (path, answer.text)
            assert "--token-env" in answer.text
            assert "thread_" not in answer.text


async def test_the_tokenless_viewer_answers_loopback_s_names(root: Path) -> None:
    async with served_site(root) as http:
        for host in ("localhost:8765", "LOCALHOST.", "127.0.0.1", "127.3.2.1:80", "[::1]:8765"):
            answer = await http.get("/api/runs", headers={"Host": host})
            assert answer.status_code == 200, (host, answer.text)
    # With a token it may be reached by any name (it may listen on every address).
    server = SiteServer(str(root), "s3cret-token")
    address = await server.start("127.0.0.1", 0)
    try:
        cookies = {TOKEN_COOKIE: "s3cret-token"}
        async with httpx.AsyncClient(base_url=address, cookies=cookies) as http:
            answer = await http.get("/api/runs", headers={"Host": "viewer.internal:8765"})
        assert answer.status_code == 200, answer.text
    finally:
        await server.stop()


async def test_a_run_pages_fork_parent_is_never_read_through_a_directory_swapped_for_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: the parent was looked for under the path of the fork's directory, resolved again
    # when the fork turned out to be one: a directory under the root swapped for a symlink
    # in between put the words of a bundle outside the root on the run page.
    outside = tmp_path / "outside"
    parent = BundleBuilder(outside, "parent")
    secret = user_item("the parent's words, outside the root")
    parent.turn("turn-1", [secret])
    root = tmp_path / "root"
    sub = root / "sub"
    child = fork_of(sub, parent.close(), [secret], "child")
    open_bundle = BundleRoot.open

    def open_then_swap(confined: BundleRoot, bundle: str) -> ConfinedBundle:
        # Once the fork is open, and before its parent is looked for.
        opened = open_bundle(confined, bundle)
        if not sub.is_symlink():
            sub.rename(root / "moved")
            sub.symlink_to(outside)
        return opened

    monkeypatch.setattr(BundleRoot, "open", open_then_swap)
    async with served_site(root) as http:
        page = await http.get(f"/run/sub/{child.name}")
    assert page.status_code == 200, page.text
    assert sub.is_symlink()
    assert "outside the root" not in page.text
