"""What every trace-reducer command shares: its name, the exit codes, the line a warning or
an error is printed as, and the fsspec option flag."""

from __future__ import annotations

import argparse
import sys

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "add_storage_option_argument",
    "say",
    "warn",
]

PROG = "trace-reducer"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def say(message: str) -> None:
    """One line on stderr, named after the command: how errors and notes reach the user."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    say(f"warning: {message}")


def add_storage_option_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--storage-option KEY=VALUE`, repeatable: fsspec options for `what`."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"fsspec option for {what}, e.g. endpoint_url=http://...",
    )
