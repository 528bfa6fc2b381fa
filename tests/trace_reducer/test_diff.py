"""`trace-reducer diff` and `serve --replay-from` on bad input: one line, the documented code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_diff_of_what_is_not_a_bundle(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "trace.binpb").write_bytes(b"\x05hello")
    result = _run(str(BIN / "trace-reducer"), "diff", str(tmp_path / "missing"), str(garbage))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_replay_from_nothing(tmp_path: Path) -> None:
    result = _run(
        str(BIN / "agent-server"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--replay-from",
        str(tmp_path / "nowhere"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("agent-server: --replay-from: ")
    assert "Traceback" not in result.stderr


def test_branching_without_a_live_provider_is_refused() -> None:
    result = _run(
        str(BIN / "agent-server"), "serve", "--replay-from", ".", "--replay-branch-at", "3"
    )
    assert result.returncode == 2
    assert "--provider-url" in result.stderr


def test_two_request_bodies_side_by_side() -> None:
    from trace_reducer import body_diff, comparable_request, request_difference

    recorded = {"model": "a", "input": [{"id": "x", "role": "user", "content": "hi"}]}
    replayed = {"model": "b", "input": [{"id": "y", "role": "user", "content": "ho"}]}
    # The model and item ids are set aside; the content is not.
    a, b = comparable_request(recorded), comparable_request(replayed)
    assert request_difference(a, b) == 'input[0].content: "hi" vs "ho"'
    lines = body_diff(a, b, ("A", "B"))
    assert lines[:2] == ["--- A", "+++ B"]
    assert '-      "content": "hi",' in lines
    assert '+      "content": "ho",' in lines
    assert request_difference(comparable_request({"model": "a"}), {}) == "identical"
