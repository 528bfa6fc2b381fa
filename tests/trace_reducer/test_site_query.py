"""The served list's questions: /api/runs with `list`'s filter names, sort and limit answers
the runs `trace-reducer list` would print, a page of them, how many match of how many, and
what the page's menus offer; a question it cannot read is a 400 saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.trace.v1 import common_pb2
from tests.trace_reducer.bundles import one_turn_bundle
from trace_reducer.cli import main

from .site import served_site

FAILED = common_pb2.EXECUTION_STATUS_FAILED

# Each question as the page's query and as `list`'s flags.
QUESTIONS = [
    ({"status": "failed,cancelled"}, ["--status", "failed,cancelled"]),
    ({"integrity": "truncated"}, ["--integrity", "truncated"]),
    ({"model": "MODEL-A"}, ["--model", "MODEL-A"]),
    ({"reward": "helpful>=0.5", "sort": "-tokens"}, ["--reward", "helpful>=0.5", "--sort=-tokens"]),
    ({"text": "Echo", "sort": "reward:depth"}, ["--text", "Echo", "--sort", "reward:depth"]),
    ({"sort": "-tool_calls", "limit": "4"}, ["--sort=-tool_calls", "--limit", "4"]),
    ({"sort": "thread_id"}, ["--sort", "thread_id"]),
    (
        {"since": "2000-01-01", "sort": "integrity"},
        ["--since", "2000-01-01", "--sort", "integrity"],
    ),
]


def listed_by_cli(root: Path, flags: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    assert main(["list", str(root), "--json", *flags]) == 0
    return [json.loads(line)["bundle"] for line in capsys.readouterr().out.splitlines()]


async def test_each_question_is_answered_as_list_answers_it(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with served_site(root) as http:
        everything = (await http.get("/api/runs")).json()["runs"]
        for params, flags in QUESTIONS:
            expected = listed_by_cli(root, flags, capsys)
            answer = (await http.get("/api/runs", params=params)).json()
            assert [run["bundle"] for run in answer["runs"]] == expected, params
            assert answer["total"] == len(everything)
            if "limit" not in params:
                assert answer["matching"] == len(expected)
            # Each run as the unasked list has it: its fields, text and link.
            by_bundle = {run["bundle"]: run for run in everything}
            assert all(run == by_bundle[run["bundle"]] for run in answer["runs"])
    # The questions choose different runs: none of them is answered by "all of them".
    assert len({len(listed_by_cli(root, flags, capsys)) for _, flags in QUESTIONS}) > 3


async def test_a_page_of_the_newest_and_what_the_menus_offer(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for index in range(7):
        status = FAILED if index % 3 == 0 else common_pb2.EXECUTION_STATUS_COMPLETED
        one_turn_bundle(root, status, thread_id=f"thr_{index}")
    async with served_site(root) as http:
        answer = (await http.get("/api/runs", params={"sort": "-started", "limit": "3"})).json()
        everything = (await http.get("/api/runs")).json()["runs"]
        newest = sorted(everything, key=lambda run: run["started"], reverse=True)[:3]
        assert [run["thread_id"] for run in answer["runs"]] == [r["thread_id"] for r in newest]
        assert (answer["matching"], answer["total"]) == (7, 7)
        assert answer["facets"] == {
            "status": ["completed", "failed"],
            "integrity": ["CLEAN"],
            "model": sorted({run["model"] for run in everything}),
            "reward": [],
        }
        assert answer["facets"]["model"] != []
        failed = (await http.get("/api/runs", params={"status": "failed"})).json()
        assert [run["thread_id"] for run in failed["runs"]] == ["thr_0", "thr_3", "thr_6"]
        none = (await http.get("/api/runs", params={"text": "no run says this"})).json()
        assert (none["runs"], none["matching"], none["total"]) == ([], 0, 7)
        # What the menus offer is the root's, whatever the question chooses.
        assert none["facets"] == answer["facets"]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"bogus": "1"}, "unknown parameter 'bogus': /api/runs takes status, integrity, model"),
        ({"limit": "-1"}, "limit expects a whole number, 0 or more; got '-1'"),
        ({"limit": "ten"}, "limit expects a whole number, 0 or more; got 'ten'"),
        ({"limit": "\u00b2"}, "limit expects a whole number, 0 or more; got '\u00b2'"),
        ({"limit": "9" * 5000}, "limit expects a whole number, 0 or more; got '99999"),
        ({"status": "nope"}, "status takes aborted, cancelled, completed"),
        ({"sort": "size"}, "sort expects one of started, duration, tokens"),
        ({"reward": "score<"}, "reward expects KEY>=X (or <=, >, <, =, !=), got 'score<'"),
        ({"reward": "score<high"}, "reward 'score<high': 'high' is not a number"),
        ({"since": "yesterday"}, "since expects an ISO date or time, or an age"),
    ],
)
async def test_a_question_it_cannot_read_is_a_400_saying_why(
    tmp_path: Path, params: dict[str, str], says: str
) -> None:
    root = tmp_path / "runs"
    one_turn_bundle(root, thread_id="thr_only")
    async with served_site(root) as http:
        answer = await http.get("/api/runs", params=params)
        assert answer.status_code == 400
        assert answer.text.startswith(says), answer.text
        assert answer.text.count("\n") == 1


async def test_the_same_question_of_the_same_runs_is_answered_304(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    one_turn_bundle(root, thread_id="thr_first")
    question = {"sort": "-started", "limit": "500"}
    async with served_site(root) as http:
        first = await http.get("/api/runs", params=question)
        tag = first.headers["ETag"]
        again = await http.get("/api/runs", params=question, headers={"If-None-Match": tag})
        assert (again.status_code, again.headers["ETag"]) == (304, tag)
        # Another answer, another tag; the unasked list's tag is its own too.
        other = await http.get("/api/runs", params={"text": "no run says this"})
        assert other.status_code == 200
        assert other.headers["ETag"] != tag
        whole = await http.get("/api/runs", headers={"If-None-Match": tag})
        assert whole.status_code == 200
        # A new run changes the answer.
        one_turn_bundle(root, thread_id="thr_second")
        grown = await http.get("/api/runs", params=question, headers={"If-None-Match": tag})
        assert grown.status_code == 200
        assert [run["thread_id"] for run in grown.json()["runs"]] == ["thr_second", "thr_first"]


async def test_the_page_comes_with_the_answer_to_its_own_question(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for index in range(3):
        one_turn_bundle(root, thread_id=f"thr_{index}")
    async with served_site(root) as http:
        page = (await http.get("/")).text
        start = page.index('id="list-data">') + len('id="list-data">')
        data = json.loads(page[start : page.index("</script>", start)])
        asked = await http.get("/api/runs", params={"sort": "-started", "limit": "500"})
        assert data["tag"] == asked.headers["ETag"]
        assert data["page_rows"] == 500
        assert {key: data[key] for key in asked.json()} == asked.json()
