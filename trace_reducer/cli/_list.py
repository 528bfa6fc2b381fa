"""The `trace-reducer list` command: flags, filters, the table or JSON lines."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..bundle._discover import no_bundles_there
from ..bundle._errors import BundleError
from ._common import (
    EXIT_OK,
    add_storage_option_argument,
    path_argument,
    redact,
    root_failure,
    warn,
)
from ._progress import progress_for

if TYPE_CHECKING:
    from ..batch._listing import RunFilter


def add_filter_arguments(parser: argparse.ArgumentParser) -> None:
    """The filters `list` takes (the served viewer's list offers the same in the page)."""
    parser.add_argument(
        "--status",
        action="append",
        default=[],
        metavar="STATUS",
        help="completed, failed, cancelled, aborted, running, live, unreadable or unspecified "
        "(repeatable, or a,b)",
    )
    parser.add_argument(
        "--integrity",
        action="append",
        default=[],
        metavar="NAME",
        help="CLEAN, UNCLOSED, TRUNCATED or CORRUPT, in either case (repeatable, or a,b)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="MODEL",
        help="runs of this model (repeatable, or a,b)",
    )
    parser.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="KEY>=X",
        help="runs whose reward KEY compares so (>=, <=, >, <, =, !=); repeatable",
    )
    parser.add_argument("--since", metavar="WHEN", help="started at or after: ISO time or 2h, 7d")
    parser.add_argument(
        "--tool", action="append", default=[], metavar="NAME", help="runs that called this tool"
    )
    parser.add_argument(
        "--text", metavar="TEXT", help="runs whose id, model, metadata or messages contain it"
    )


def run_filter(args: argparse.Namespace) -> RunFilter:
    """The filter the flags describe; ValueError names a bad flag."""
    # Imported when a listing runs, not for every command's start.
    from ..batch._listing import FILTER_NAMES, RunFilter

    values: dict[str, list[str]] = {}
    for name in FILTER_NAMES:
        given = getattr(args, name)
        if given:
            values[name] = given if isinstance(given, list) else [given]
    return RunFilter.of(values)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "list",
        help="one line per bundle under a directory or URL: status, tokens, rewards, integrity",
        description=(
            "List every bundle under ROOT. Summaries are kept in an index (ROOT/.trace-list.json, "
            "or the user's cache for a URL root): only bundles changed since are read, from "
            "reduce-all's state.json when it is fresh."
        ),
    )
    parser.add_argument(
        "root",
        type=path_argument,
        help="a directory, or an fsspec URL (s3://bucket/prefix, ...)",
    )
    add_filter_arguments(parser)
    parser.add_argument(
        "--sort",
        default="started",
        metavar="KEY",
        help="started (default), duration, tokens, turns, calls, tool_calls, status, "
        "integrity, model, thread_id or reward:NAME; --sort=-KEY for descending",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="at most N runs")
    parser.add_argument("--json", action="store_true", help="JSON lines, one run each")
    add_storage_option_argument(parser, "URL roots")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..batch._listing import check_sort_key, format_table, list_runs, run_line, sort_runs
    from ..batch._storage import is_url, parse_storage_options

    try:
        chosen = run_filter(args)
        sort_key = check_sort_key(args.sort)
        options = parse_storage_options(args.storage_option)
    except ValueError as error:
        raise BundleError(str(error)) from error
    if args.limit is not None and args.limit < 0:
        raise BundleError("--limit must be 0 or more")

    try:
        # A bar on a terminal while bundles are read afresh (a cold root of thousands takes
        # minutes); nothing into a pipe, and nothing for a listing the index answers.
        reading = progress_for("list: reading", bad_word="unreadable")
        listing = list_runs(args.root, storage_options=options, warn=warn, progress=reading)
    except BundleError:
        raise
    except (ImportError, ValueError) as error:
        raise root_failure("list", args.root, error, "open") from error
    except Exception as error:
        if not is_url(args.root):
            raise  # a local tree's I/O error is reported as every command reports one
        # A bucket, service or URL that cannot be listed (fsspec's, botocore's errors).
        raise root_failure("list", args.root, error, "list") from error
    if not listing.runs:
        # As reduce-all: a root with no bundles is a wrong path far more often than a fresh one,
        # and an empty table would look like a filter that matched nothing.
        root = args.root if is_url(args.root) else os.path.abspath(args.root)
        raise BundleError(no_bundles_there(root))
    runs = sort_runs([r for r in listing.runs if chosen.matches(r)], sort_key)
    if not runs:
        for note in _unknown_names(chosen, listing.runs):
            warn(note)
    if args.limit is not None:
        runs = runs[: args.limit]
    if args.json:
        # The lines the index keeps, written as they are (a changed or live run's anew).
        out = sys.stdout
        for start in range(0, len(runs), 4096):
            out.write(redact("".join(f"{run_line(e)}\n" for e in runs[start : start + 4096])))
        out.flush()
    else:
        print(redact(format_table(runs)))
    return EXIT_OK


def _unknown_names(chosen: RunFilter, runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """For a listing that matched nothing: each reward name the filter compares, and each of
    its model or tool lists, that no run has at all, with the names the runs do have. A typo
    (`--reward 'scor<0.5'`) otherwise reads as "no such runs"."""
    have: dict[str, set[str]] = {"reward": set(), "model": set(), "tool": set()}
    for run in runs:
        have["reward"].update(run["rewards"])
        have["model"].add(run["model"])
        have["tool"].update(run["tools"])
    models = {name.lower() for name in have["model"]}
    asked = [
        *(("reward", [key]) for key in dict.fromkeys(key for key, _, _ in chosen.rewards)),
        ("model", sorted(chosen.models) if not chosen.models & models else []),
        ("tool", sorted(chosen.tools) if not chosen.tools & have["tool"] else []),
    ]
    notes = []
    for kind, names in asked:
        if not names or (kind == "reward" and names[0] in have["reward"]):
            continue
        known = sorted(filter(None, have[kind]))
        shown = ", ".join(known[:_SHOWN_NAMES]) + (", ..." if len(known) > _SHOWN_NAMES else "")
        notes.append(
            f"--{kind}: no run has {'the ' + kind if kind != 'reward' else 'a reward named'} "
            f"{' or '.join(map(repr, names))} (the runs have: {shown or 'none'})"
        )
    return notes


# The names a note lists at most.
_SHOWN_NAMES = 20
