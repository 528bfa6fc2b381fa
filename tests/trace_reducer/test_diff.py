"""`trace-reducer diff` and `serve --replay-from` on bad input: one line, the documented code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.trace_reducer.conftest import GOLDEN

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


def _report(a: Path, b: Path) -> list[str]:
    """`trace-reducer diff A B`'s lines, without the request bodies' unified diff."""
    result = _run(str(BIN / "trace-reducer"), "diff", str(a), str(b))
    assert result.returncode in (0, 1), result.stderr
    return [
        line for line in result.stdout.splitlines() if not line.startswith((" ", "+", "-", "@"))
    ]


def test_the_report_s_words_agree_with_its_numbers() -> None:
    one_call = GOLDEN / "20261201T234337Z-thread_0f558eb4ac894d71a303ef0caeaf39b6"
    two_calls = GOLDEN / "20261201T234337Z-thread_57eadcfe992e412fbecd2efb8caebf72"
    three_calls = GOLDEN / "20261201T234337Z-thread_1dc265563cca454ebed4c4d224c02ef0"
    assert _report(one_call, one_call) == [
        f"A: {one_call} (1 call)",
        f"B: {one_call} (1 call)",
        "no difference in 1 call",
    ]
    assert _report(one_call, three_calls)[:3] == [
        f"A: {one_call} (1 call)",
        f"B: {three_calls} (3 calls)",
        "call 1 is the same",  # was: calls 1-1 are the same
    ]
    assert _report(three_calls, two_calls)[2] == "calls 1-2 are the same"

    # Each aspect is named once (was: "tool calls: : 0 entries vs 1", "status: body: ...").
    tools = GOLDEN / "20261201T234337Z-thread_778f00a2cb9a4ebd9496c7994a86ac8f"
    no_tools = GOLDEN / "20261201T234337Z-thread_085421a179e84ce1bcea619a69fa0a2a"
    result = _run(str(BIN / "trace-reducer"), "diff", str(no_tools), str(tools))
    details = [
        line for line in result.stdout.splitlines() if line.startswith("  ") and ": " in line
    ]
    assert details[:4] == [
        '  request: include: absent vs ["message.output_text.logprobs"]',
        '  status: "CANCELLED" vs "COMPLETED"',
        "  accepted items: 0 entries vs 1",
        "  tool calls: 0 entries vs 1",
    ]
    assert (
        "  tool calls: 1 entry vs 0"
        in _run(str(BIN / "trace-reducer"), "diff", str(tools), str(no_tools)).stdout.splitlines()
    )
