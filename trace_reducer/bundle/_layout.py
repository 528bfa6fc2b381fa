"""How a bundle sits on disk: the directory's name and the names of the files inside it."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

TRACE_FILE_NAME = "trace.binpb"
STATE_FILE_NAME = "state.json"
# Rewards recorded after the fact, beside the trace, never in it.
REWARDS_FILE_NAME = "rewards.binpb"


def bundle_dir_name(created_at: datetime, thread_id: str) -> str:
    """`<UTC yyyymmddTHHMMSSZ>-<thread_id>`: bundles of a root list in the order they began."""
    return f"{created_at:%Y%m%dT%H%M%SZ}-{thread_id}"


def thread_bundles(root: Path, thread_id: str) -> list[Path]:
    """The bundles of a thread directly under root, oldest first (their names sort by when
    they began); none for an id that is not a plain name."""
    if not thread_id or any(c in thread_id for c in "/\0*?[") or thread_id in {".", ".."}:
        return []
    if not root.is_dir():
        return []
    return [d for d in sorted(root.glob(f"*-{thread_id}")) if (d / TRACE_FILE_NAME).is_file()]
