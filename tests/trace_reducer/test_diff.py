"""`trace-reducer diff` and `serve --replay-from` on bad input: one line, the documented code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.trace_reducer.bundles import BundleBuilder, user_item
from tests.trace_reducer.conftest import GOLDEN
from trace_reducer import BundleWriter, read_recorded_thread
from trace_reducer.bundle import RecordBuilder

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


def _fork_with_a_call(root: Path) -> tuple[Path, Path]:
    """A parent bundle and a fork of it whose one call re-sends the parent's item."""
    parent = BundleBuilder(root, "parent")
    shared = user_item("the parent's words")
    parent.turn("turn-1", [shared])
    parent_dir = parent.close()
    writer = BundleWriter.create(root, "child")
    records = RecordBuilder(writer)
    records.thread_forked(
        parent_thread_id="parent",
        parent_bundle=parent_dir.name,
        parent_trace_id="",
        after_turn_id="turn-1",
        group_id="g",
        repetition_index=1,
        shared_turns=1,
        prefix_items=[shared],
        copy_prefix=False,
    )
    thread = records.thread_started("child", model="m", instructions="", metadata={})
    question = user_item("the fork's question")
    turn = records.turn_started(thread, "turn-2", [question])
    records.inference_started_after_prefix(
        turn,
        inference_call_id="call-1",
        attempt=1,
        model="m",
        provider_base_url="http://127.0.0.1:9/v1",
        envelope={"model": "m", "stream": True},
        prefix_count=1,
        new_items=[question],
    )
    writer.close()
    return parent_dir, writer.bundle_dir


def test_diff_of_a_fork_away_from_its_parent_names_the_parent(tmp_path: Path) -> None:
    parent, fork = _fork_with_a_call(tmp_path)
    assert read_recorded_thread(fork).calls[0].request["input"][0] == user_item(
        "the parent's words"
    )
    parent.rename(tmp_path / "elsewhere")
    result = _run(str(BIN / "trace-reducer"), "diff", str(fork), str(fork))
    assert result.returncode == 2
    # Was: "payload <id> is missing", naming neither the parent nor where it is looked for.
    assert result.stderr.splitlines() == [
        f"trace-reducer: {fork}: its requests refer to its parent's payloads, and its parent "
        f"(thread parent, bundle {parent.name}) is not beside it, or not whole: put the parent "
        "bundle in the same directory"
    ]
