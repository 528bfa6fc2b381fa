"""`trace-reducer reward` and `trace-reducer export-rl`: rewards after the fact, samples out."""

from __future__ import annotations

import argparse
from typing import Any

from ..bundle._errors import BundleError, CorruptBundleError, RewardError
from ..bundle._integrity import require_reducible
from ..bundle._names import counted
from ..bundle._reader import resolve_trace_file
from ..bundle._rewards import RewardInput, append_reward, check_reward
from ..export._rl import FORMATS, Exported, ExportError, export_rl
from ..reduce._replay import replay_bundle
from ..reduce._requests import ids_there
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    check_output_dir,
    check_parents,
    finite_argument,
    job_count,
    local_path_argument,
    warn,
)
from ._common import say as _say
from ._progress import progress_for


def _metadata(pairs: list[str]) -> dict[str, str] | None:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            return None
        metadata[key] = value
    return metadata


def _reward(args: argparse.Namespace) -> int:
    bundle = resolve_trace_file(args.bundle).parent
    trace = replay_bundle(bundle)
    # A reward belongs beside a recorded thread: a directory holding no bundle gets none.
    require_reducible(trace.integrity, salvage=True, source=args.bundle)
    metadata = _metadata(args.metadata)
    if metadata is None:
        _say("--metadata takes KEY=VALUE")
        return EXIT_USAGE
    reward = RewardInput(
        thread_id=trace.root_thread_id,
        turn_id=args.turn or "",
        item_id=args.item or "",
        name=args.name,
        value=args.value,
        weight=args.weight,
        source=args.source,
        metadata=metadata,
        recorded_by=f"{PROG} reward",
    )
    try:
        check_reward(reward)
    except RewardError as error:
        _say(str(error))
        return EXIT_USAGE
    # Each answered with the ids it may name instead, as `request` answers an unknown call.
    if reward.turn_id and reward.turn_id not in trace.turns:
        turns = list(trace.threads[trace.root_thread_id].turn_ids)
        _say(f"{args.bundle} has no turn {reward.turn_id!r}; {ids_there(turns, 'turn', 'turns')}")
        return EXIT_USAGE
    items = [
        item.responses_item_id
        for item in trace.conversation_items.values()
        if item.responses_item_id and (not reward.turn_id or item.turn_id == reward.turn_id)
    ]
    if reward.item_id and reward.item_id not in items:
        where = f" in turn {reward.turn_id!r}" if reward.turn_id else ""
        _say(
            f"{args.bundle} has no item {reward.item_id!r}{where}; "
            f"{ids_there(items, 'item id', 'item ids')}"
        )
        return EXIT_USAGE
    try:
        seq = append_reward(bundle, reward, trace_id=trace.trace_id)
    except RewardError as error:
        _say(str(error))
        return EXIT_FAILED
    target = reward.item_id or reward.turn_id or reward.thread_id
    print(f"recorded {reward.name}={reward.value:g} for {target} as seq {seq}", flush=True)
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    check_parents(args.parent)
    check_output_dir("--out", args.out)
    progress = progress_for("export-rl", quiet=args.quiet)
    try:
        try:
            exported = export_rl(
                args.paths,
                fmt=args.format,
                out_dir=args.out,
                parents=args.parent,
                salvage=args.salvage,
                jobs=args.jobs,
                started=progress.started,
                progress=progress.advanced,
                warn=warn,
            )
        finally:
            progress.finished()
    except CorruptBundleError as error:
        _say(f"{error} (--salvage exports the records before it)")
        return EXIT_FAILED
    except ExportError as error:
        _say(str(error))
        return EXIT_FAILED
    for warning in exported.warnings:
        _say(f"warning: {warning}")
    # Each bundle left out in the line reduce-all's summary gives it (CORRUPT at byte ..., or
    # FAILED: why); one bad bundle costs its own sample only, and the exit code says so.
    for unreduced in exported.unreduced:
        _say(f"warning: not exported: {unreduced}")
    if any(unreduced.corrupt for unreduced in exported.unreduced):
        _say(
            "warning: corrupt bundles were not exported: --salvage exports their records "
            "before the damage"
        )
    # Counts said as every report says them (`1 sample`, `7 samples`; was `1 samples`).
    if exported.left_out:
        left_out = len(exported.left_out)
        _say(
            f"warning: {counted(left_out, 'sample')} without exact tokens "
            f"{'is' if left_out == 1 else 'are'} not in {exported.path.name} (never "
            "re-tokenized; --format jsonl keeps their messages)"
        )
    if exported.group_prompts:
        prompts = len(exported.group_prompts)
        _say(
            f"warning: {counted(prompts, 'thread')} forked into a group "
            f"{'is' if prompts == 1 else 'are'} not in {exported.path.name}: each is its "
            "group's prompt (in each fork's row, mask 0), not a group of one; "
            "--format jsonl keeps them"
        )
    if exported.drifted:
        _say(
            f"warning: {counted(exported.drifted, 'sample')} drifted: in "
            f"{counted(exported.drifted_calls, 'inference call')} the engine's prompt departed "
            "from the tokens it had sampled; their ids are kept as the engine saw them and the "
            "departed stretch is masked out (each sample's drift_events says where)"
        )
    print(summary_line(exported), flush=True)
    return EXIT_FAILED if exported.unreduced else EXIT_OK


def summary_line(exported: Exported) -> str:
    """export-rl's last line: what it wrote, and what it could not export."""
    written = exported.samples - len(exported.left_out) - len(exported.group_prompts)
    not_exported = ""
    if exported.unreduced:
        corrupt = sum(unreduced.corrupt for unreduced in exported.unreduced)
        not_exported = (
            f"; {counted(len(exported.unreduced), 'bundle')} not exported "
            f"({corrupt:,} corrupt, {len(exported.unreduced) - corrupt:,} failed)"
        )
    # Every count with its thousands marked, as `counted` marks the first (was `1,536
    # samples (1536 with exact tokens …)`).
    return (
        f"wrote {counted(written, 'sample')} "
        f"({exported.exact:,} with exact tokens, {exported.drifted:,} drifted) to "
        f"{exported.path}{not_exported}"
    )


def add_parsers(commands: Any) -> None:
    """Register `reward` and `export-rl` on the CLI's subcommands."""
    reward = commands.add_parser(
        "reward",
        help="record a reward for a bundle's thread, turn or item (in its rewards.binpb)",
        description="Exit codes: 0 recorded; 1 the sidecar cannot be written or is corrupt; "
        "2 bad input (bundle, name, value, turn, item).",
    )
    reward.add_argument(
        "bundle", type=local_path_argument, help="bundle directory or its trace.binpb"
    )
    reward.add_argument("--name", required=True, help="the reward's name, e.g. correct")
    reward.add_argument("--value", required=True, type=finite_argument, help="a finite number")
    reward.add_argument("--turn", metavar="TURN_ID", help="a turn of the thread (default: all)")
    reward.add_argument("--item", metavar="ITEM_ID", help="an item id as events show it")
    reward.add_argument(
        "--weight",
        type=finite_argument,
        default=0.0,
        help="its weight in the sample's mean reward (default 0, which counts as 1)",
    )
    reward.add_argument("--source", default="", help="who gave it, e.g. rule, judge, human")
    reward.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a metadata entry (repeatable)",
    )
    reward.set_defaults(run=_reward)

    export = commands.add_parser(
        "export-rl",
        help="write one training sample per thread: tokens, loss masks, logprobs, rewards",
        description="Exit codes: 0 written; 1 a bundle could not be reduced (corrupt without "
        "--salvage, records that contradict each other, unreadable: the others are written, "
        "each one left out named on stderr), an output that failed as it was written; 2 bad input "
        "(--out not a directory that can be written in, --parent no bundle), or pyarrow (the "
        "training extra) not installed for verl or skyrl.",
    )
    export.add_argument(
        "paths",
        nargs="+",
        type=local_path_argument,
        metavar="bundle-or-root",
        help="a bundle directory, or a directory holding bundles",
    )
    export.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="jsonl (plain JSON lines), verl, skyrl or art (docs/training.md)",
    )
    export.add_argument(
        "--out",
        required=True,
        type=local_path_argument,
        metavar="DIR",
        help="where the files are written",
    )
    export.add_argument(
        "--parent",
        action="append",
        type=local_path_argument,
        default=[],
        metavar="BUNDLE",
        help="a parent bundle of forks that is not beside them (repeatable)",
    )
    export.add_argument("--salvage", action="store_true", help="export corrupt bundles' records")
    export.add_argument(
        "--jobs",
        type=job_count,
        default=1,
        metavar="N",
        help="processes reducing bundles (default 1; a fork's parent is reduced once per process)",
    )
    export.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar on stderr (shown on a terminal only)",
    )
    export.set_defaults(run=_export)


__all__ = ["BundleError", "add_parsers"]
