"""Every subcommand of both programs against bad arguments and planted files: the documented
exit code, one line saying why (or argparse's usage), never a traceback or `internal error`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agent_server import cli as agent_cli
from trace_reducer.cli import _main as reducer_cli

CORPUS = Path(__file__).resolve().parent / "golden" / "bundles"
FIRST = sorted(p.name for p in CORPUS.glob("2026*"))[0]

# The planted files a path argument may name (created by the `planted` fixture).
PLANTED = ("fifo", "junk", "dangling", "zero-bytes", "junk-dir", "long-name", "fifo-bundle")

# Subcommands that take one bundle (or root) path first, and the arguments after it.
PATH_COMMANDS: dict[str, tuple[str, ...]] = {
    "reduce": ("--stdout",),
    "dump": (),
    "request": ("call-1",),
    "reward": ("--name", "score", "--value", "1"),
    "export-rl": ("--format", "jsonl", "--out", "{out}/rl.jsonl"),
    "export-otlp": ("--endpoint", "http://127.0.0.1:9", "--timeout", "1"),
    "diff": ("{bundle}",),
    "reduce-all": (),
    "list": (),
    "view": ("-o", "{out}/view.html"),
    "watch": (),
}

# Arguments that must each fail at once.
BAD_ARGUMENTS: list[tuple[str, list[str]]] = [
    ("trace-reducer", ["list", "{golden}", "--reward", "a>=nan"]),
    ("trace-reducer", ["list", "{golden}", "--sort", "reward:"]),
    ("trace-reducer", ["view", "{golden}", "--listen", "127.0.0.1:99999"]),
    ("trace-reducer", ["view", "{golden}", "--listen", "nohost"]),
    ("trace-reducer", ["view", "{golden}", "--token-env", "ROLLOUT_AUDIT_UNSET"]),
    ("trace-reducer", ["reward", "{bundle}", "--name", "x", "--value", "1e999"]),
    ("trace-reducer", ["reward", "{bundle}", "--name", "", "--value", "1"]),
    ("trace-reducer", ["reward", "{bundle}", "--name", "x", "--value", "nan"]),
    ("trace-reducer", ["reward", "{bundle}", "--name", "x", "--value", "1", "--metadata", "nokey"]),
    ("trace-reducer", ["reward", "{bundle}", "--name", "x", "--value", "1", "--turn", "no-turn"]),
    ("trace-reducer", ["reduce-all", "{golden}", "--jobs", "0"]),
    ("trace-reducer", ["export-rl", "{golden}", "--format", "jsonl", "--out", "/proc/x/y"]),
    ("trace-reducer", ["export-otlp", "{bundle}", "--endpoint", "http://[::1"]),
    ("trace-reducer", ["export-otlp", "{bundle}", "--endpoint", "ftp://x"]),
    ("trace-reducer", ["serve", "--listen", "127.0.0.1:99999"]),
    ("trace-reducer", ["serve", "--listen", "nope"]),
    ("trace-reducer", ["serve", "--max-upload-bytes", "-1"]),
    ("trace-reducer", ["nonsense"]),
    ("agent-server", ["serve", "--listen", "127.0.0.1:99999"]),
    ("agent-server", ["serve", "--stream-idle-timeout", "nan"]),
    ("agent-server", ["serve", "--replay-from", "/nonexistent/bundles"]),
    ("agent-server", ["serve", "--replay-from", "{bundle}", "--replay-branch-at", "-1"]),
    ("agent-server", ["gateway"]),
    ("agent-server", ["gateway", "--trace-root", "{out}", "--session-idle-timeout", "nan"]),
    ("agent-server", ["gateway", "--trace-root", "{out}", "--session-idle-timeout", "1e400"]),
    ("agent-server", ["gateway", "--trace-root", "{out}", "--listen", "127.0.0.1:99999"]),
    ("agent-server", ["gateway", "--trace-root", "{out}", "--upstream", "ftp://x"]),
    ("agent-server", ["health", "--address", "127.0.0.1:99999"]),
    ("agent-server", ["nonsense"]),
]


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    place = tmp_path / "planted"
    place.mkdir()
    os.mkfifo(place / "fifo")
    (place / "junk").write_bytes(b"not a bundle at all\n" * 10)
    (place / "dangling").symlink_to(tmp_path / "nowhere")
    (place / "zero-bytes").write_bytes(b"")
    (place / "junk-dir").mkdir()
    (place / "junk-dir" / "notes.txt").write_text("x", encoding="utf-8")
    (place / "long-name").write_bytes(b"")
    os.rename(place / "long-name", place / ("n" * 250))
    os.symlink(place / ("n" * 250), place / "long-name")
    (place / "fifo-bundle").mkdir()
    os.mkfifo(place / "fifo-bundle" / "trace.binpb")
    (tmp_path / "out").mkdir()
    # A copy of the corpus: `list` writes its index beside the bundles, never in the repository.
    shutil.copytree(CORPUS, tmp_path / "golden")
    return place


def _fill(args: Sequence[str], tmp_path: Path) -> list[str]:
    golden = tmp_path / "golden"
    return [arg.format(out=tmp_path / "out", golden=golden, bundle=golden / FIRST) for arg in args]


def _run(main: Callable[[Sequence[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as leaving:  # argparse's usage errors
        return int(leaving.code or 0)


def _check(code: int, err: str, out: str, *, ok: bool) -> None:
    assert "Traceback" not in err + out
    assert "internal error" not in err
    if code == 0:
        assert ok, (code, err)
        return
    assert code in (1, 2), (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "a failure says why"
    if not any(line.startswith("usage:") for line in lines):
        # Progress and warnings may come first; what went wrong is the one last line.
        said = [line for line in lines if "warning" not in line and "bundles/s" not in line]
        if not said:
            # reduce-all's last progress line counts the bundles that failed.
            assert "corrupt or failed" in lines[-1], err
        else:
            assert len(said) == 1, err


@pytest.mark.parametrize("command", list(PATH_COMMANDS), ids=list(PATH_COMMANDS))
def test_every_path_command_against_planted_files(
    command: str, planted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in PLANTED:
        if command == "watch" and name in ("junk", "zero-bytes", "long-name"):
            continue  # watch waits for a file that may still grow: not a failure
        rest = _fill(PATH_COMMANDS[command], planted.parent)
        code = _run(reducer_cli.main, [command, str(planted / name), *rest])
        captured = capsys.readouterr()
        # A directory of other files is an empty root for the batch commands.
        _check(code, captured.err, captured.out, ok=command in ("reduce-all", "list"))


@pytest.mark.parametrize(
    ("program", "argv"), BAD_ARGUMENTS, ids=[" ".join(a)[:60] for _, a in BAD_ARGUMENTS]
)
def test_bad_arguments_fail_at_once_in_one_line(
    program: str,
    argv: list[str],
    planted: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROLLOUT_AUDIT_UNSET", raising=False)
    monkeypatch.delenv("ROLLOUT_TRACE_ROOT", raising=False)
    main = reducer_cli.main if program == "trace-reducer" else agent_cli.main
    code = _run(main, _fill(argv, planted.parent))
    captured = capsys.readouterr()
    assert code != 0, captured
    _check(code, captured.err, captured.out, ok=False)


@pytest.mark.parametrize("age", ["9" * 400 + "s", "99999999999999999999999999d"])
def test_an_age_past_the_calendar_lists_every_run(
    age: str, planted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: `internal error: OverflowError` (the age past what datetime reaches).
    golden = str(planted.parent / "golden")
    assert _run(reducer_cli.main, ["list", golden, "--json"]) == 0
    every = capsys.readouterr().out
    assert _run(reducer_cli.main, ["list", golden, "--json", "--since", age]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == every
