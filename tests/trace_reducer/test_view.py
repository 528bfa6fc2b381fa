"""`trace-reducer view` without a browser: the file it writes, its data, escaping, the CLI."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.trace.v1 import record_pb2
from tests.commands import run_on_terminal
from trace_reducer import VIEW_FILE_NAME, replay_bundle, request_body, write_view
from trace_reducer.bundle import _confine
from trace_reducer.view._site import write_site
from trace_reducer.view._view import _delta

from .bundles import (
    CANCELLED,
    COMPLETED,
    BundleBuilder,
    as_input,
    assistant_output,
    one_turn_bundle,
    user_item,
)
from .test_cli import COMMAND, assert_one_clean_line, bad_inputs, run

EVIL = '</script><script>alert(1)</script><!-- <img src=x onerror="alert(2)">'


def page_data(page: str, element_id: str) -> object:
    match = re.search(
        rf'<script type="application/json" id="{element_id}">(.*?)</script>', page, re.S
    )
    assert match is not None, element_id
    return json.loads(match.group(1))


def two_turn_bundle(root: Path, text: str = "first answer") -> Path:
    """Two turns; the second call repeats the first one's input and output, then adds."""
    bundle = BundleBuilder(root)
    question = user_item(EVIL)
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    item = bundle.added(call, "msg-1")
    bundle.delta(call, text)
    answer = assistant_output(text, "msg-1")
    bundle.done(call, item, answer)
    bundle.call_ended(call, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    follow_up = user_item("and then?")
    turn2 = bundle.turn("turn-2", [follow_up])
    call2 = bundle.call(turn2, "call-2", [as_input(answer, "msg-1"), follow_up], prefix=1)
    bundle.added(call2, "msg-2")
    bundle.delta(call2, "half of a")
    bundle.interrupt(turn2)
    bundle.call_ended(call2, CANCELLED)
    bundle.turn_ended(turn2, CANCELLED)
    bundle.thread_ended()
    return bundle.close()


def test_writes_one_page_next_to_the_bundle(tmp_path: Path) -> None:
    bundle = two_turn_bundle(tmp_path)
    path = write_view(bundle)
    assert path == bundle / VIEW_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    page = path.read_text(encoding="utf-8")
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r"\b(src|href)\s*=", page.split('id="view-data"')[0])
    assert "http://" not in page.split('id="view-data"')[0]
    assert "https://" not in page
    assert [name for name in tmp_path.rglob(".*.tmp")] == []


def test_untrusted_text_never_leaves_the_data_block(tmp_path: Path) -> None:
    bundle = two_turn_bundle(tmp_path)
    page = write_view(bundle).read_text(encoding="utf-8")
    # Exactly the page's own five scripts (two data blocks, the shared helpers, the page and
    # its rollout panel): the text's </script> did not end a block early.
    assert page.count("<script") == 5
    assert page.count("</script>") == 5
    data = page_data(page, "view-data")
    assert isinstance(data, dict)
    texts = [part[1] for item in data["items"].values() for part in item["parts"]]
    assert EVIL in texts
    # The CSP lets only the page's own script run.
    csp = re.search(r'Content-Security-Policy" content="([^"]*)"', page)
    assert csp is not None
    assert "script-src 'sha256-" in csp.group(1)
    assert "unsafe-inline" not in csp.group(1).split("script-src")[1].split(";")[0]
    assert "default-src 'none'" in csp.group(1)


def test_placeholders_in_the_text_stay_text(tmp_path: Path) -> None:
    bundle = two_turn_bundle(tmp_path, text="{{SCRIPT}} {{PAYLOADS}} {{TITLE}}")
    page = write_view(bundle).read_text(encoding="utf-8")
    data = page_data(page, "view-data")
    assert isinstance(data, dict)
    texts = [part[1] for item in data["items"].values() for part in item["parts"]]
    assert "{{SCRIPT}} {{PAYLOADS}} {{TITLE}}" in texts


def test_request_bodies_are_rebuilt_from_the_embedded_pieces(tmp_path: Path) -> None:
    """What the page's script does, step by step, gives the exact body the call sent."""
    bundle = two_turn_bundle(tmp_path)
    page = write_view(bundle).read_text(encoding="utf-8")
    data = page_data(page, "view-data")
    payloads = page_data(page, "view-payloads")
    assert isinstance(data, dict)
    assert isinstance(payloads, dict)
    trace = replay_bundle(bundle)
    for call_id, call in trace.inference_calls.items():
        chain = []
        link: str | None = call_id
        while link is not None:
            chain.append(data["calls"][link]["body"])
            link = data["calls"][link]["body"]["base"]
        inputs: list[str] = []
        for step in reversed(chain):
            inputs = inputs[: step["keep"]] + step["add"]
        assert inputs == list(call.input_payload_ids)
        prefix, suffix = payloads["envelopes"][data["calls"][call_id]["body"]["envelope"]]
        body = prefix + "[" + ",".join(payloads["inputs"][pid] for pid in inputs) + "]" + suffix
        assert body.encode() == request_body(bundle, call_id)


def test_delta_encoding_of_lists() -> None:
    assert _delta(["a", "b", "c"], ["a", "b"]) == (2, ["c"])
    assert _delta(["a", "x", "c"], ["a", "b"]) == (1, ["x", "c"])
    assert _delta(["a"], ["a", "b"]) == (1, [])
    assert _delta(["z"], []) == (0, ["z"])
    assert _delta([], ["a"]) == (0, [])


def test_the_flow_of_a_turn_follows_the_records(tmp_path: Path) -> None:
    bundle = two_turn_bundle(tmp_path)
    page = write_view(bundle).read_text(encoding="utf-8")
    data = page_data(page, "view-data")
    assert isinstance(data, dict)
    trace = replay_bundle(bundle)
    turn2 = trace.turns["turn-2"]
    assert data["turns"]["turn-2"]["flow"] == [
        ["i", turn2.input_item_ids[0]],
        ["c", "call-2"],
        ["x"],
        ["d", "call-2", 0],
    ]
    assert data["turns"]["turn-2"]["interrupt"]["by"] == "ipv4:127.0.0.1:5555"
    assert data["calls"]["call-2"]["discarded"] == [
        {"id": "msg-2", "type": "message", "text": "half of a"}
    ]


def test_cli_prints_the_path_and_takes_an_output(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    result = run("view", bundle)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(bundle / VIEW_FILE_NAME)
    assert result.stderr == ""
    target = tmp_path / "elsewhere.html"
    result = run("view", bundle / "trace.binpb", "-o", target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)
    assert "<!DOCTYPE html>" in target.read_text(encoding="utf-8")


def test_cli_open_hands_the_page_to_the_browser(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    opened = tmp_path / "opened.txt"
    fake_browser = tmp_path / "browser.py"
    fake_browser.write_text(
        f"import sys\nopen({str(opened)!r}, 'w').write(sys.argv[1])\n", encoding="utf-8"
    )
    result = subprocess.run(
        [sys.executable, "-m", "trace_reducer.cli", "view", str(bundle), "--open"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "BROWSER": f"{sys.executable} {fake_browser} %s"},
    )
    assert result.returncode == 0, result.stderr
    assert opened.read_text(encoding="utf-8") == (bundle / VIEW_FILE_NAME).as_uri()


def test_damaged_bundles_are_shown_with_a_warning(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    data = (bundle / "trace.binpb").read_bytes()
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "trace.binpb").write_bytes(data[:-3])
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x40
    (corrupt / "trace.binpb").write_bytes(bytes(flipped))
    for path, status in ((torn, "truncated"), (corrupt, "corrupt")):
        result = run("view", path)
        assert result.returncode == 0, result.stderr
        assert_one_clean_line(result.stderr)
        assert result.stderr.startswith(f"trace-reducer: warning: {status} bundle")
        page = (path / VIEW_FILE_NAME).read_text(encoding="utf-8")
        shown = page_data(page, "view-data")
        assert isinstance(shown, dict)
        assert shown["trace"]["integrity"]["status"] == status.upper()
        assert shown["trace"]["recording_complete"] is False


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for name, path in bad_inputs(tmp_path).items():
        result = run("view", path)
        assert result.returncode == 2, (name, result.stderr)
        assert_one_clean_line(result.stderr)
        assert str(path) in result.stderr, name
        assert not path.is_dir() or not (path / VIEW_FILE_NAME).exists()


def test_contradicting_records_exit_1(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    bundle.append(inference_ended=record_pb2.InferenceEnded(call=9, status=COMPLETED))
    result = run("view", bundle.close())
    assert result.returncode == 1
    assert_one_clean_line(result.stderr)
    assert "unknown inference call ordinal 9" in result.stderr


def test_the_thread_badge_is_its_last_turns_outcome(tmp_path: Path) -> None:
    from tests.golden.record import BUNDLES

    # The golden corpus's thread whose only turn failed (its recording closed cleanly).
    failed = next(
        path
        for path in sorted(BUNDLES.iterdir())
        if replay_bundle(path).threads[replay_bundle(path).root_thread_id].metadata.get("corpus")
        == "failed"
    )
    copy = tmp_path / failed.name
    copy.mkdir()
    (copy / "trace.binpb").write_bytes((failed / "trace.binpb").read_bytes())
    data = page_data(write_view(copy).read_text(encoding="utf-8"), "view-data")
    assert isinstance(data, dict)
    assert [thread["status"] for thread in data["threads"]] == ["FAILED"]


def test_the_pages_share_one_copy_of_the_helpers(tmp_path: Path) -> None:
    from importlib import resources

    from trace_reducer.view._site import render_list
    from trace_reducer.view._view import script_hash

    assets = resources.files("trace_reducer.view")
    shared = assets.joinpath("_page.js").read_text(encoding="utf-8")
    for name in ("_list.js", "_run.js", "_view.js"):
        script = assets.joinpath(name).read_text(encoding="utf-8")
        for helper in ("function el(", "function shortId(", "function payloads(", "function add("):
            assert helper not in script, f"{name} defines its own {helper}"
    bundle = one_turn_bundle(tmp_path)
    pages = [
        write_view(bundle).read_text(encoding="utf-8"),
        render_list(b'{"runs":[]}', served=False, title="runs"),
    ]
    for page in pages:
        # Inlined once, ahead of the page's own script, and allowed to run by its hash.
        assert page.count(shared) == 1
        assert page.index(shared) < page.index("})();\n</script>")
        assert script_hash(shared) in page


def test_a_sites_pages_share_one_copy_of_the_style_and_scripts(tmp_path: Path) -> None:
    from importlib import resources

    from trace_reducer.view._view import script_hash

    root = tmp_path / "root"
    bundles = [two_turn_bundle(root / f"run{number}", f"answer {number}") for number in range(3)]
    site = tmp_path / "site"
    result = run("view", root, "-o", site)
    assert result.returncode == 0, result.stderr
    package = resources.files("trace_reducer.view")
    shipped = {
        name: package.joinpath(name).read_bytes()
        for name in ("_view.css", "_page.js", "_view.js", "_run.js")
    }
    written = {path.name: path.read_bytes() for path in (site / "assets").iterdir()}
    # Each written once, under a name of its own content.
    assert sorted(written.values()) == sorted(shipped.values())
    pages = list((site / "runs").iterdir())
    assert len(pages) == 3
    for page in pages:
        text = page.read_text(encoding="utf-8")
        # Was: every page inlined all four (~47 KB), a 20,000-run site 1.05 GB.
        for body in shipped.values():
            assert body.decode() not in text
        assert all(f"../assets/{name}" in text for name in written)
        # One inline script runs, the loader the policy names; it may load the others.
        loader = re.findall(r"<script>(.*?)</script>", text, re.S)
        assert len(loader) == 1
        policy = re.search(r'Content-Security-Policy" content="([^"]*)"', text)
        assert policy is not None
        assert f"script-src {script_hash(loader[0])} 'strict-dynamic';" in policy.group(1)
    # A page of its own still carries everything: it is the one file to hand on.
    own = write_view(bundles[0], tmp_path / "own.html").read_text(encoding="utf-8")
    assert all(body.decode() in own for body in shipped.values())
    assert "../assets/" not in own


def _modes_under(directory: Path) -> dict[str, int]:
    return {
        os.path.relpath(path, directory): stat.S_IMODE(path.stat().st_mode)
        for path in [directory, *directory.rglob("*")]
    }


@pytest.mark.parametrize(
    ("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)]
)
def test_what_a_user_asks_for_gets_the_mode_any_new_file_gets(
    tmp_path: Path, umask: int, file_mode: int, dir_mode: int
) -> None:
    # Was: a site's pages 0600 and its runs/ and assets/ 0700, so a web server running as
    # another user (as the README says one may serve it) could read none of it. As cp or
    # mkdir make them now, the umask deciding; a page or state left in the bundle stays 0600.
    root = tmp_path / "root"
    bundles = [two_turn_bundle(root / f"run{number}", f"answer {number}") for number in range(2)]
    site, page, diff, state = (tmp_path / name for name in ("site", "a.html", "d.html", "s.json"))

    def run_under_umask(*args: str | Path) -> None:
        result = subprocess.run(
            [*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=30, umask=umask
        )
        assert result.returncode == 0, result.stderr

    run_under_umask("view", root, "-o", site)
    modes = _modes_under(site)
    assert {name for name, mode in modes.items() if (site / name).is_dir()} == {
        ".",
        "runs",
        "assets",
    }
    assert modes == {name: dir_mode if (site / name).is_dir() else file_mode for name in modes}, (
        modes
    )
    assert len(modes) == 3 + 1 + 2 + 4  # index.html, two pages, four assets
    run_under_umask("view", bundles[0], "-o", page)
    run_under_umask("view", bundles[0], "--diff", bundles[1], "-o", diff)
    run_under_umask("reduce", bundles[0], "-o", state)
    for written in (page, diff, state):
        assert stat.S_IMODE(written.stat().st_mode) == file_mode, written
    run_under_umask("view", bundles[0])
    run_under_umask("view", bundles[0], "--diff", bundles[1])
    run_under_umask("reduce", bundles[0])
    for name in (VIEW_FILE_NAME, "diff.html", "state.json"):
        assert stat.S_IMODE((bundles[0] / name).stat().st_mode) == 0o600, name


def test_a_site_gives_every_run_a_page_of_its_own(tmp_path: Path) -> None:
    root = tmp_path / "root"
    # Paths a naive flattening ("/" -> "__") would give one page name.
    first = two_turn_bundle(tmp_path / "a", "the first run")
    second = two_turn_bundle(tmp_path / "b", "the second run")
    (root / "x").mkdir(parents=True)
    first.rename(root / "x" / "run1")
    second.rename(root / "x__run1")
    site = tmp_path / "site"
    result = run("view", root, "-o", site)
    assert result.returncode == 0, result.stderr
    pages = sorted((site / "runs").iterdir())
    assert len(pages) == 2
    texts = sorted("first" if "the first run" in page.read_text() else "second" for page in pages)
    assert texts == ["first", "second"]
    index = (site / "index.html").read_text()
    assert all(f"runs/{page.name}" in index for page in pages)


def _root_with_an_unshowable_run(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    two_turn_bundle(tmp_path / "a").rename(root / "good")
    bad = BundleBuilder(tmp_path / "b")
    bad.append(inference_ended=record_pb2.InferenceEnded(call=9, status=COMPLETED))
    bad.close().rename(root / "contradicting")
    return root


def test_a_site_gives_a_run_it_cannot_show_a_page_saying_why(tmp_path: Path) -> None:
    root = _root_with_an_unshowable_run(tmp_path)
    site = tmp_path / "site"
    result = run("view", root, "-o", site)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{site / 'index.html'}\n"
    # The list links it, so its page exists and says why, in the served page's words.
    index = (site / "index.html").read_text()
    assert "runs/contradicting.html" in index
    page = (site / "runs" / "contradicting.html").read_text()
    reason = "records contradict each other: seq 4: unknown inference call ordinal 9"
    assert f'<p id="unshown">This run cannot be shown: {reason}</p>' in page
    assert "<script" not in page
    assert '<a href="../index.html">' in page
    assert result.stderr == f"trace-reducer: warning: contradicting: {reason} (its page says so)\n"
    assert "the first answer" not in page
    assert "first answer" in (site / "runs" / "good.html").read_text()


def test_a_site_shows_its_pages_as_a_bar_on_a_terminal(tmp_path: Path) -> None:
    root = _root_with_an_unshowable_run(tmp_path)
    code, out, terminal = run_on_terminal(*COMMAND, "view", root, "-o", tmp_path / "site")
    assert code == 0, terminal
    assert out == f"{tmp_path / 'site' / 'index.html'}\n"
    assert "view" in terminal, terminal
    assert "2/2" in terminal, terminal
    assert "1 unreadable" in terminal, terminal
    # The warning comes after the bar, not drawn over by it.
    assert terminal.rindex("2/2") < terminal.index("warning: contradicting:"), terminal


def _files_under(place: Path) -> dict[str, bytes]:
    return {
        path.relative_to(place).as_posix(): path.read_bytes()
        for path in sorted(place.rglob("*"))
        if path.is_file()
    }


def _pages_bar_part_way(terminal: str) -> bool:
    # The pages' bar (`view:`, not `view: reading:`) showing some but not all pages written.
    counts = re.findall(r"view: +\d+%\|[^|]*\| *(\d+)/(\d+)", terminal)
    return any(0 < int(done) < int(total) for done, total in counts)


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_site_stopped_part_way_leaves_the_site_before(
    tmp_path: Path, stop: signal.Signals, code: int
) -> None:
    # Was: the pages were written into DIR as they came, so a Ctrl-C left DIR half the new
    # site and half the one before (or, where there was none, a list-less directory of pages).
    # And SIGTERM killed the command where it stood, its half-written site left beside DIR.
    bundle = one_turn_bundle(tmp_path / "one")
    earlier, root = tmp_path / "earlier", tmp_path / "root"
    earlier.mkdir()
    shutil.copytree(bundle, earlier / "only")
    root.mkdir()
    for number in range(300):
        shutil.copytree(bundle, root / f"run{number:03d}")
    site = tmp_path / "site"
    assert run("view", earlier, "-o", site).returncode == 0
    before = _files_under(site)
    beside = sorted(os.listdir(tmp_path))

    stopped, out, terminal = run_on_terminal(
        *COMMAND, "view", root, "-o", site, interrupt_when=_pages_bar_part_way, interrupt_with=stop
    )
    assert (stopped, out) == (code, ""), terminal
    assert "Traceback" not in terminal
    assert _files_under(site) == before
    assert sorted(os.listdir(tmp_path)) == beside  # nothing half-written left beside it

    # Run to its end, the new site replaces the earlier whole: no page of a run gone from
    # the root stays behind, and the directory keeps its mode.
    site.chmod(0o750)
    result = run("view", root, "-o", site)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(site / "runs")) == [f"run{number:03d}.html" for number in range(300)]
    assert stat.S_IMODE(site.stat().st_mode) == 0o750
    assert sorted(os.listdir(tmp_path)) == beside


def test_a_site_is_never_written_through_a_link_nor_over_other_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    one_turn_bundle(tmp_path / "one").rename(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    outcomes = {
        "link": "a symbolic link; give the directory itself",
        "notes": "holds files that are not a site's (todo.txt), which writing the site would "
        "remove; give a new or empty directory, or one a site was written to before",
    }
    for name, said in outcomes.items():
        result = run("view", tmp_path, "-o", tmp_path / name)
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr == f"trace-reducer: -o {tmp_path / name}: {said}\n"
    assert os.listdir(elsewhere) == []
    assert os.listdir(notes) == ["todo.txt"]


def test_a_site_written_there_meanwhile_is_left_and_said(tmp_path: Path) -> None:
    # Two `view ROOT -o DIR` at once into a new DIR: the one that ended second said
    # `Directory not empty: .DIR.<hex>.writing`, naming a directory gone by then.
    root = tmp_path / "root"
    root.mkdir()
    one_turn_bundle(tmp_path / "one").rename(root / "run")
    site = tmp_path / "site"

    def other_command_finishes_first(_pages: int, _unshown: int) -> None:
        site.mkdir()
        (site / "index.html").write_text("the other's")

    with pytest.raises(OSError, match="while this was written") as raised:
        write_site(str(root), site, progress=other_command_finishes_first)
    assert raised.value.filename == str(site)
    assert os.listdir(site) == ["index.html"]
    assert (site / "index.html").read_text() == "the other's"
    assert sorted(os.listdir(tmp_path)) == ["one", "root", "site"]


def test_a_site_is_never_written_over_other_files_in_its_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    one_turn_bundle(tmp_path / "one").rename(root / "run")
    site = tmp_path / "site"
    assert run("view", root, "-o", site).returncode == 0
    # Was: only the site directory's own names were looked at, so these went with the site
    # before when a new one took its place.
    (site / "assets" / "mine.css").write_text("body { color: teal }")
    (site / "runs" / "notes.txt").write_text("mine")
    before = _files_under(site)
    result = run("view", root, "-o", site)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (
        f"trace-reducer: -o {site}: holds files that are not a site's (assets/mine.css, "
        "runs/notes.txt), which writing the site would remove; give a new or empty directory, "
        "or one a site was written to before\n"
    )
    assert _files_under(site) == before


def test_a_site_replaces_the_one_before_where_the_kernel_cannot_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where renameat2's RENAME_EXCHANGE is missing (not Linux, an old C library, a file
    # system without it), two renames take its place, and the result is the same.
    def missing(first: Path, second: Path) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(_confine, "_rename_exchange", missing)
    root = tmp_path / "root"
    root.mkdir()
    bundle = one_turn_bundle(tmp_path / "one")
    shutil.copytree(bundle, root / "first")
    site = tmp_path / "site"
    write_site(str(root), site)
    shutil.rmtree(root / "first")
    shutil.copytree(bundle, root / "second")
    assert write_site(str(root), site) == site / "index.html"
    assert os.listdir(site / "runs") == ["second.html"]
    assert sorted(os.listdir(tmp_path)) == ["one", "root", "site"]
