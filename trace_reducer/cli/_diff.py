"""`trace-reducer diff A B`: the first call at which two recorded runs differ."""

from __future__ import annotations

import argparse
from typing import Any

from ..reduce._diff import RunDiff, diff_runs

EXIT_SAME, EXIT_DIFFERENT = 0, 1


def report(result: RunDiff, a: str, b: str) -> list[str]:
    """The comparison as a person reads it: each run's size, the first differing call with
    what differs there, and a unified diff of the two request bodies when they differ."""
    lines = [f"A: {a} ({result.calls_a} calls)", f"B: {b} ({result.calls_b} calls)"]
    first = result.first
    if first is None:
        lines.append(f"no difference in {result.same_calls} calls")
        return lines
    if result.same_calls:
        lines.append(f"calls 1-{result.same_calls} are the same")
    ids = " / ".join(call.inference_call_id if call else "-" for call in (first.a, first.b))
    lines.append(f"first difference at call {first.number} ({ids}): {', '.join(first.aspects)}")
    lines.append(f"  request: {first.request}")
    lines.extend(f"  {detail}" for detail in first.details)
    lines.extend(first.request_diff)
    return lines


def _diff(args: argparse.Namespace) -> int:
    result = diff_runs(args.a, args.b)
    print("\n".join(report(result, args.a, args.b)), flush=True)
    return EXIT_SAME if result.first is None else EXIT_DIFFERENT


def add_parser(commands: Any) -> None:
    diff = commands.add_parser(
        "diff",
        help="compare two bundles call by call; name the first call where they differ",
        description="Compares the root threads of two bundles call by call: the request "
        "(apart from the fields a replay sets aside), the status, the accepted items, the "
        "tool calls and the tokens. Exit codes: 0 no difference, 1 a difference, 2 bad input.",
    )
    diff.add_argument("a", help="bundle directory or its trace.binpb")
    diff.add_argument("b", help="bundle directory or its trace.binpb")
    diff.set_defaults(run=_diff)
