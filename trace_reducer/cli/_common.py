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
    "MAX_JOBS",
    "PROG",
    "add_storage_option_argument",
    "job_count",
    "say",
    "warn",
]

PROG = "trace-reducer"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


# Beyond this a process pool is a mistake, not a machine: argparse says so, not the OS.
MAX_JOBS = 1024


def job_count(text: str) -> int:
    """`--jobs N`: a number of worker processes, from 1 to MAX_JOBS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_JOBS}, got {value}")
    return value


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
