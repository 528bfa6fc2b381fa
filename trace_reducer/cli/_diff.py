"""`trace-reducer diff A B`: the first call at which two recorded runs differ."""

from __future__ import annotations

import argparse
from typing import Any

from ..bundle._shown import one_line
from ..reduce._diff import diff_report, diff_runs
from ._common import local_path_argument

# 2 is trouble, as for diff(1): a report that could not be written is not a difference.
EXIT_SAME, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2


def _diff(args: argparse.Namespace) -> int:
    result = diff_runs(args.a, args.b)
    # Each line one line, whatever the runs' names and requests hold.
    print("\n".join(map(one_line, diff_report(result, args.a, args.b))), flush=True)
    return EXIT_SAME if result.first is None else EXIT_DIFFERENT


def add_parser(commands: Any) -> None:
    diff = commands.add_parser(
        "diff",
        help="compare two bundles call by call; name the first call where they differ",
        description="Compares the root threads of two bundles call by call: the request "
        "(apart from the fields a replay sets aside), the status, the accepted items, the "
        "tool calls and the tokens. Exit codes: 0 no difference, 1 a difference, 2 bad input "
        "or a report that could not be written.",
    )
    diff.add_argument("a", type=local_path_argument, help="bundle directory or its trace.binpb")
    diff.add_argument("b", type=local_path_argument, help="bundle directory or its trace.binpb")
    # `trace-reducer view A --diff B` shows the same comparison as a page.
    diff.set_defaults(run=_diff, output_failed=EXIT_TROUBLE)
