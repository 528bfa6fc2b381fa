"""The served list's JSON, which the page polls every 2 s: an unchanged list is answered 304
without its body, a changed one in full with a new tag."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.trace_reducer.bundles import one_turn_bundle
from trace_reducer.batch._listing import public_run
from trace_reducer.view._site import PAGE_TEXT_CHARS, SiteServer, _listed_runs, _page_runs_json


def test_the_polled_json_is_the_list_pages_runs_spliced_from_the_kept_lines(root: Path) -> None:
    # The golden corpus (forks, rewards, tools, failed, torn, corrupt), text no ASCII encoder
    # would leave alone, and a run still being written, whose line is not the kept one.
    one_turn_bundle(root, text='réponse 答え \u2028 </script> "quoted"', thread_id="thr_text")
    one_turn_bundle(root, close=False, thread_id="thr_live")
    listed = _listed_runs(str(root), lambda relative: f"run/{relative}", lambda _: None)
    assert len(listed) > 10
    assert any(run.live for run, _ in listed)
    # What the page shows of a run: `list --json`'s fields, the start of its text, its link.
    expected = [
        {**public_run(run), "text": run.text[:PAGE_TEXT_CHARS], "href": link}
        for run, link in listed
    ]
    assert json.loads(_page_runs_json(listed)) == {"runs": expected}


async def test_the_page_comes_with_its_lists_tag_so_its_first_poll_is_not_sent_again(
    tmp_path: Path,
) -> None:
    root = tmp_path / "traces"
    one_turn_bundle(root, text="a reply with </script> in it", thread_id="thr_first")
    server = SiteServer(str(root), None)
    base = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            page = (await http.get("/")).text
            start = page.index('id="list-data">') + len('id="list-data">')
            data = json.loads(page[start : page.index("</script>", start)])
            assert data["served"] is True
            assert [run["thread_id"] for run in data["runs"]] == ["thr_first"]
            # The page's own question (_list.js: the newest first, a page of them).
            question = {"sort": "-started", "limit": str(data["page_rows"])}
            polled = await http.get("/api/runs", params=question)
            assert data["tag"] == polled.headers["ETag"]
            assert data["runs"] == polled.json()["runs"]
            again = await http.get(
                "/api/runs", params=question, headers={"If-None-Match": data["tag"]}
            )
            assert again.status_code == 304
    finally:
        await server.stop()


async def test_an_unchanged_list_is_not_sent_again(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    one_turn_bundle(root, thread_id="thr_first")
    server = SiteServer(str(root), None)
    base = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            first = await http.get("/api/runs")
            assert first.status_code == 200
            tag = first.headers["ETag"]
            assert tag[0] == tag[-1] == '"'
            [run] = first.json()["runs"]
            assert run["thread_id"] == "thr_first"

            same = await http.get("/api/runs", headers={"If-None-Match": tag})
            assert same.status_code == 304
            assert same.content == b""
            assert same.headers["ETag"] == tag
            # Any of a list of tags, weak or strong, as a cache would send them.
            listed = await http.get("/api/runs", headers={"If-None-Match": f'"other", W/{tag}'})
            assert listed.status_code == 304
            stale = await http.get("/api/runs", headers={"If-None-Match": '"other"'})
            assert stale.status_code == 200
            assert stale.content == first.content

            one_turn_bundle(root, thread_id="thr_second")
            grown = await http.get("/api/runs", headers={"If-None-Match": tag})
            assert grown.status_code == 200
            assert grown.headers["ETag"] != tag
            assert {run["thread_id"] for run in grown.json()["runs"]} == {
                "thr_first",
                "thr_second",
            }
    finally:
        await server.stop()
