"""How a bundle sits on disk: the directory's name and the names of the files inside it."""

from __future__ import annotations

from datetime import datetime

TRACE_FILE_NAME = "trace.binpb"
STATE_FILE_NAME = "state.json"
# Rewards recorded after the fact, beside the trace, never in it.
REWARDS_FILE_NAME = "rewards.binpb"


def bundle_dir_name(created_at: datetime, thread_id: str) -> str:
    """`<UTC yyyymmddTHHMMSSZ>-<thread_id>`: bundles of a root list in the order they began."""
    return f"{created_at:%Y%m%dT%H%M%SZ}-{thread_id}"
