"""`trace-reducer list` over the golden corpus (forks, rewards, tools, failed, interrupted,
torn, corrupt): a line per bundle, the filters, --json, and the index that keeps a warm listing
from reading any bundle."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.commands import run_on_terminal
from tests.trace_reducer.collector import left_in_cycles
from tests.trace_reducer.conftest import GOLDEN, TRACE_REDUCER
from trace_reducer import RewardInput, append_reward
from trace_reducer.batch._listing import (
    INDEX_FILE_NAME,
    SORT_KEYS,
    Listing,
    Run,
    RunFilter,
    _unreadable,
    list_runs,
)

# A file or pipe left for the garbage collector fails these tests (the collector reports it as
# an unraisable ResourceWarning, which only warned: run_on_terminal left each run's stdout).
pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]


def run_list(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRACE_REDUCER, "list", *args], capture_output=True, text=True)


def listed(*args: str) -> list[dict[str, object]]:
    done = run_list(*args, "--json")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def names(runs: list[dict[str, object]]) -> set[str]:
    return {Path(str(run["bundle"])).name.split("-", 1)[-1] for run in runs}


def test_a_line_per_bundle_with_its_status_integrity_and_rewards(root: Path) -> None:
    done = run_list(str(root))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "THREAD", "MODEL", "STATUS", "TURNS", "CALLS", "TOOL_CALLS", "TOKENS", "REWARDS",
        "INTEGRITY", "STARTED", "DURATION",
    ]  # fmt: skip
    # Was TOOLS, which --json calls the tools a run declares; each column is headed by the
    # key --sort takes for it (the thread's, thread_id, and reward:NAME aside).
    sortable = {word.lower() for word in lines[0].split()} - {"thread", "rewards"}
    assert sortable <= set(SORT_KEYS)
    assert len(lines) == 1 + len(list(GOLDEN.iterdir()))
    runs = {Path(str(r["bundle"])).name: r for r in listed(str(root))}
    # In the word the tables, the viewer, the RL export and `reduce` use (was corrupt, ...).
    assert runs["damaged-corrupt"]["integrity"] == "CORRUPT"
    assert runs["damaged-torn"]["integrity"] == "TRUNCATED"
    assert {line.split()[8] for line in lines[1:]} == {"CLEAN", "TRUNCATED", "CORRUPT"}
    assert {r["status"] for r in runs.values()} >= {"completed", "failed", "cancelled"}
    rewarded = [r for r in runs.values() if r["rewards"] == {"concise": 0.25, "helpful": 0.5}]
    assert rewarded
    forks = [r for r in runs.values() if r["fork"]]
    assert {f["fork"]["group_id"] for f in forks} >= {"group-a", "group-b"}  # type: ignore[index]
    assert all("text" not in r for r in runs.values())


def test_filters(root: Path) -> None:
    every = listed(str(root))
    assert [r["status"] for r in listed(str(root), "--status", "failed")] == ["failed"]
    damaged = listed(str(root), "--integrity", "CORRUPT,TRUNCATED")
    assert {r["integrity"] for r in damaged} == {"CORRUPT", "TRUNCATED"}
    # The lower-case words list once showed are taken too, in any case: no script breaks.
    assert listed(str(root), "--integrity", "corrupt", "--integrity", "Truncated") == damaged
    assert [r["rewards"] for r in listed(str(root), "--reward", "correct>=1")] == [{"correct": 1}]
    assert len(listed(str(root), "--reward", "correct<1")) == 1
    assert len(listed(str(root), "--reward", "helpful>=0.5", "--reward", "concise<0.3")) >= 1
    assert {r["model"] for r in listed(str(root), "--model", "MODEL-A")} == {"model-a"}
    assert [r["tools"] for r in listed(str(root), "--tool", "lookup")] == [["lookup"]]
    assert len(listed(str(root), "--since", "2000-01-01")) == len(every)
    assert listed(str(root), "--since", "2099-01-01T00:00:00Z") == []
    assert len(listed(str(root), "--since", "100000d")) == len(every)
    texts = listed(str(root), "--text", "local-echo")
    assert 0 < len(texts) < len(every)
    # Was: a fork group's id, a trace id or a parent thread's id found no run (`--text q7`
    # over 1,728 rollouts in groups q0..q191: none), though the run list names them.
    group = [r for r in every if r["fork"] and r["fork"]["group_id"] == "group-a"]  # type: ignore[index]
    assert group
    assert listed(str(root), "--text", "GROUP-A") == group
    parent_thread = group[0]["fork"]["parent_thread_id"]  # type: ignore[index]
    trace = [r for r in every if r["trace_id"] == group[0]["trace_id"]]
    assert {r["thread_id"] for r in trace} >= {parent_thread, *(r["thread_id"] for r in group)}
    assert listed(str(root), "--text", str(group[0]["trace_id"])) == trace
    assert {r["thread_id"] for r in listed(str(root), "--text", str(parent_thread))} >= {
        r["thread_id"] for r in group
    }
    top = listed(str(root), "--sort=-tokens", "--limit", "1")
    assert top[0]["tokens"] == max((r["tokens"] for r in every), key=lambda t: t["total"])  # type: ignore[index]


def test_a_filter_naming_what_no_run_has_says_what_the_runs_have(root: Path) -> None:
    # Was: an empty listing and nothing else, so a typo (`--reward 'correc<1'`) read as "no
    # such runs".
    every = listed(str(root))
    rewards = sorted({name for run in every for name in run["rewards"]})  # type: ignore[attr-defined]
    models = sorted({str(run["model"]) for run in every} - {""})
    tools = sorted({tool for run in every for tool in run["tools"]})  # type: ignore[attr-defined]
    cases = [
        (["--reward", "correc<1"], "--reward: no run has a reward named 'correc'", rewards),
        (
            ["--model", "model-z,MODEL-Y"],
            "--model: no run has the model 'model-y' or 'model-z'",
            models,
        ),
        (["--tool", "lokup"], "--tool: no run has the tool 'lokup'", tools),
    ]
    for args, said, have in cases:
        done = run_list(str(root), *args, "--json")
        assert (done.returncode, done.stdout) == (0, ""), done.stderr
        assert done.stderr.splitlines() == [
            f"trace-reducer: warning: {said} (the runs have: {', '.join(have)})"
        ]
    # A name some run has says nothing, whether runs match or not.
    for args in (["--reward", "correct<0"], ["--reward", "correct>=1"], ["--tool", "lookup"]):
        done = run_list(str(root), *args)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr


def test_a_cold_listing_leaves_nothing_for_the_cycle_collector(root: Path) -> None:
    # The listing turns the collector off while it runs: whatever a bundle's reduction left in
    # cycles would pile up until the end (300 MiB at 9,000 small bundles, when it did).
    list_runs(str(root))  # a message class's first use makes its own lasting cycles
    (root / INDEX_FILE_NAME).unlink()
    listings: list[Listing] = []
    # The collector off already, so the listing leaves it off and nothing goes before we look.
    assert left_in_cycles(lambda: listings.append(list_runs(str(root)))) == []
    assert listings[0].reduced == len(listings[0].runs) > 1


def test_a_warm_listing_reads_no_bundle_and_a_changed_one_is_read_again(root: Path) -> None:
    first = list_runs(str(root))
    assert (first.reduced, first.cached) == (len(first.runs), 0)
    assert (root / INDEX_FILE_NAME).stat().st_mode & 0o777 == 0o600
    again = list_runs(str(root))
    assert (again.reduced, again.cached) == (0, len(first.runs))
    assert again.runs == first.runs
    target = next(r for r in first.runs if r["tools"] and not r["rewards"])
    trace = json.loads(
        subprocess.run(
            [TRACE_REDUCER, "reduce", "--stdout", str(target["bundle"])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    append_reward(
        Path(str(target["bundle"])),
        RewardInput(thread_id=str(trace["root_thread_id"]), name="late", value=2.0),
        trace_id=str(trace["trace_id"]),
    )
    changed = list_runs(str(root))
    assert (changed.reduced, changed.cached) == (1, len(first.runs) - 1)
    after = next(r for r in changed.runs if r["bundle"] == target["bundle"])
    assert after["rewards"] == {"late": 2.0}
    # reduce-all's fresh state.json is read rather than the bundle reduced.
    removed = next(r for r in first.runs if r["integrity"] == "CLEAN")
    subprocess.run(
        [TRACE_REDUCER, "reduce", str(removed["bundle"])], check=True, capture_output=True
    )
    shutil.rmtree(root / Path(str(target["bundle"])).name)
    final = list_runs(str(root))
    assert len(final.runs) == len(first.runs) - 1
    assert final.reduced == 1


class Told:
    """A progress display that keeps what it was told."""

    def __init__(self) -> None:
        self.said: list[tuple[str, int, int]] = []

    def started(self, total: int) -> None:
        self.said.append(("started", total, 0))

    def advanced(self, count: int = 1, bad: int = 0) -> None:
        self.said.append(("advanced", count, bad))

    def finished(self) -> None:
        self.said.append(("finished", 0, 0))


def test_a_listing_that_reads_bundles_says_how_many_and_each_as_it_goes(root: Path) -> None:
    # Was: nothing on stderr for as long as a cold root took (3,000 bundles: 10 s; 100,000:
    # minutes), `list` silent until its table.
    cold = Told()
    first = list_runs(str(root), progress=cold)
    unreadable = sum(run["status"] == "unreadable" for run in first.runs)
    assert cold.said[0] == ("started", len(first.runs), 0)
    steps = cold.said[1:-1]
    assert [(kind, count) for kind, count, _ in steps] == [("advanced", 1)] * len(first.runs)
    assert sum(bad for _, _, bad in steps) == unreadable
    assert cold.said[-1] == ("finished", 0, 0)
    # A warm listing, answered from the index, shows nothing.
    warm = Told()
    list_runs(str(root), progress=warm)
    assert warm.said == []


def test_list_on_a_terminal_draws_a_bar_while_it_reads(root: Path) -> None:
    count = sum(1 for _ in root.iterdir())
    code, out, terminal = run_on_terminal(TRACE_REDUCER, "list", str(root))
    assert code == 0, terminal
    assert re.search(rf"list: reading: 100%\|.*\| {count}/{count} \[", terminal), terminal
    assert out.startswith("THREAD")
    # Warm: the index answers, nothing to show progress of.
    code, out, terminal = run_on_terminal(TRACE_REDUCER, "list", str(root))
    assert code == 0, terminal
    assert terminal == ""
    assert out.startswith("THREAD")


def test_bad_input_is_one_line_and_exit_2(root: Path, tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    cases = [
        [str(tmp_path / "missing")],
        [str(file)],
        [str(root), "--reward", "score"],
        [str(root), "--reward", "score>=high"],
        [str(root), "--since", "yesterday"],
        [str(root), "--sort", "nonsense"],
        # A filter no run can match is a typo, not an empty answer.
        [str(root), "--status", "bogus"],
        [str(root), "--status", "completed,finished"],
        [str(root), "--integrity", "bogus"],
        # A bundle given where its root belongs.
        [str(next(root.iterdir()))],
    ]
    for args in cases:
        done = run_list(*args)
        assert done.returncode == 2, (args, done)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_the_api_s_word_for_a_status_is_answered_with_the_trace_s(root: Path) -> None:
    # Was: `--status takes aborted, cancelled, …; not interrupted`, for the word the API,
    # `agent-server chat` and the logs use, with nothing saying which of the listed it is.
    done = run_list(str(root), "--status", "interrupted,completed")
    assert done.returncode == 2
    assert done.stderr.endswith(
        "; not interrupted (the trace says cancelled for interrupted: docs/vocabulary.md)\n"
    )
    with pytest.raises(ValueError, match=r"not bogus, in_progress \(the trace says running for"):
        RunFilter.of({"status": ["in_progress", "bogus"]})


def test_a_url_root(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    for path in root.rglob("trace.binpb"):
        memory.pipe_file(f"/golden/{path.parent.name}/trace.binpb", path.read_bytes())
    runs = list_runs("memory://golden")
    assert len(runs.runs) == len(list(GOLDEN.iterdir()))
    assert {r["integrity"] for r in runs.runs} >= {"CLEAN", "CORRUPT", "TRUNCATED"}
    assert list_runs("memory://golden").reduced == 0
    assert any((tmp_path / "cache" / "rollout-trace").iterdir())


def old_json_line(run: object) -> str:
    # What `list --json` printed before the index kept lines: the run's fields in summary
    # order, without the search text, `live` last.
    fields = {key: value for key, value in dict(run).items() if key != "text"}  # type: ignore[call-overload]
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))


def test_a_warm_listing_prints_the_lines_a_cold_one_does(root: Path) -> None:
    cold = run_list(str(root), "--json")
    warm = run_list(str(root), "--json")
    assert cold.returncode == warm.returncode == 0, cold.stderr + warm.stderr
    assert warm.stdout == cold.stdout
    # Each line is what the summary encodes to, whether it came from the index or not.
    for first, again in zip(list_runs(str(root)).runs, list_runs(str(root)).runs, strict=True):
        assert first.json_line() == again.json_line() == old_json_line(again)
    # A warm search of the texts (kept apart in the index) finds what a cold one does.
    warm_search = listed(str(root), "--text", "local-echo")
    assert list_runs(str(root)).reduced == 0
    (root / INDEX_FILE_NAME).unlink()
    assert warm_search == listed(str(root), "--text", "local-echo") != []


def test_a_live_run_prints_its_live_status(root: Path) -> None:
    torn = next(path for path in root.iterdir() if path.name.endswith("damaged-torn"))
    list_runs(str(root))  # the index holds it as truncated, not live
    os.utime(torn / "trace.binpb")  # being written now; the index entry is stale anyway
    runs = {r["bundle"]: r for r in listed(str(root))}
    assert runs[str(torn)]["status"] == "live"
    assert runs[str(torn)]["live"] is True
    again = {r.get("bundle"): r for r in list_runs(str(root)).runs}
    assert again[str(torn)].json_line() == old_json_line(again[str(torn)])


def test_an_index_someone_else_wrote_is_never_trusted_beyond_its_shape(
    root: Path, tmp_path: Path
) -> None:
    expected = run_list(str(root), "--json").stdout
    index = root / INDEX_FILE_NAME
    lines = index.read_text(encoding="utf-8").split("\n")
    head = json.loads(lines[0])
    # Wrong shapes and a run line that is no JSON object: re-summarized or shown as damaged,
    # never a traceback.
    head["entries"][0] = ["x"]
    head["entries"][1][2] = 7
    lines[0] = json.dumps(head)
    lines[3] = "{not json}"
    index.write_text("\n".join(lines), encoding="utf-8")
    done = run_list(str(root), "--json", "--status", "completed,failed,cancelled,unreadable")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    for garbage in ("[1, 2", "null", '{"version": 4, "entries": {}}', ""):
        index.write_text(garbage, encoding="utf-8")
        again = run_list(str(root), "--json")
        assert (again.returncode, again.stdout) == (0, expected), again.stderr
    # Neither followed through a symbolic link nor waited on as a FIFO: summarized afresh.
    run_list(str(root), "--json")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(
        index.read_text(encoding="utf-8").replace('"status":"completed"', '"status":"planted"'),
        encoding="utf-8",
    )
    index.unlink()
    index.symlink_to(elsewhere)
    assert run_list(str(root), "--json").stdout == expected
    index.unlink()
    os.mkfifo(index)
    fifo = subprocess.run(
        [TRACE_REDUCER, "list", str(root), "--json"], capture_output=True, text=True, timeout=120
    )
    assert (fifo.returncode, fifo.stdout) == (0, expected), fifo.stderr


def test_a_directory_named_in_bytes_that_are_not_utf8_is_passed_over_with_a_warning(
    root: Path,
) -> None:
    odd = os.fsdecode(bytes(root) + b"/b\xff")
    os.mkdir(odd)
    shutil.move(str(root / "damaged-corrupt"), odd)
    for args in ([str(root)], [str(root), "--json"]):
        done = run_list(*args)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert "b\\xff: its name is not valid UTF-8" in done.stderr
    assert len(listed(str(root))) == len(list(GOLDEN.iterdir())) - 1


def test_a_file_that_is_no_bundle_is_listed_unreadable(root: Path) -> None:
    empty = root / "20261201T000000Z-thread_empty"
    empty.mkdir()
    (empty / "trace.binpb").write_bytes(b"")
    os.utime(empty / "trace.binpb", (0, 0))  # long ago: not a bundle being written
    run = next(r for r in listed(str(root)) if str(r["bundle"]).endswith("thread_empty"))
    assert run["status"] == "unreadable"
    assert names(listed(str(root), "--status", "unreadable")) >= {"thread_empty"}


@pytest.mark.parametrize(
    ("needle", "found"),
    [
        ("MODEL-x", True),  # any case
        ("thr_searched", True),
        ("a sunny\u0000reply", True),  # a NUL the text itself holds
        ("key-value", True),  # a metadata value
        ("model-xthr", False),  # across two fields: no field holds it
        ("model-x\u0000thr", False),
    ],
)
def test_text_searches_each_field_alone(needle: str, found: bool) -> None:
    summary = _unreadable("/runs/b1", "")
    summary |= {
        "thread_id": "thr_searched",
        "model": "model-x",
        "text": "a sunny\u0000reply",
        "metadata": {"k": "key-value"},
    }
    run = Run.of(summary)
    chosen = RunFilter(text=needle)
    assert chosen.matches(run) is found
    # The same answer for a run as a plain mapping (no text kept lower-cased).
    assert chosen.matches({**run, "text": summary["text"]}) is found


def test_an_index_of_an_older_layout_is_rebuilt_never_misread(root: Path) -> None:
    # Version 2 first kept every search text in one JSON object on the line after the runs;
    # one text a line came later without raising it. Such an index of two runs, made here by
    # hand from a current one, was read as texts of "" and `--text` found nothing.
    for bundle in sorted(root.iterdir())[2:]:
        shutil.rmtree(bundle)
    expected = run_list(str(root), "--json", "--text", "story").stdout
    assert len(expected.splitlines()) == 1
    index = root / INDEX_FILE_NAME
    lines = index.read_text(encoding="utf-8").split("\n")
    heads = json.loads(lines[0])["entries"]
    texts = {head[0]: json.loads(text) for head, text in zip(heads, lines[3:5], strict=True)}
    older = [json.dumps({"version": 2, "entries": heads}), *lines[1:3], json.dumps(texts)]
    index.write_text("\n".join(older) + "\n", encoding="utf-8")
    again = run_list(str(root), "--json", "--text", "story")
    assert (again.returncode, again.stdout) == (0, expected), again.stderr
    # Rebuilt in the current layout: the listing after it reads no bundle.
    assert list_runs(str(root)).reduced == 0
