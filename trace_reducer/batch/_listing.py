"""`trace-reducer list`: one summary per bundle under a root, kept in an index so that a warm
listing reads no bundle at all, and filters over those summaries."""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._confine import open_regular_file
from ..bundle._errors import BundleError, ReductionError
from ._storage import BundleEntry, LocalStore, Store, open_store

__all__ = [
    "INDEX_FILE_NAME",
    "RunFilter",
    "RunIndex",
    "list_runs",
    "parse_reward_filter",
    "parse_since",
    "summarize",
]

# Kept directly under a local root; a URL root's index lives in the user's cache directory.
INDEX_FILE_NAME = ".trace-list.json"
_INDEX_VERSION = 1
# What --text searches: the start of every item's text, up to this much per bundle.
TEXT_CHARS = 16_384
# An unfinished bundle modified this recently is being written (as reduce-all decides).
LIVE_WINDOW = 10.0

_STATUS = {
    value: name.removeprefix("EXECUTION_STATUS_").lower()
    for name, value in common_pb2.ExecutionStatus.items()
}
_INTEGRITY = {
    value: name.removeprefix("INTEGRITY_STATUS_").lower()
    for name, value in state_pb2.IntegrityStatus.items()
}
_MAYBE_LIVE = {"unclosed", "truncated"}


def _iso(stamp: Any) -> str:
    if stamp.seconds == 0 and stamp.nanos == 0:
        return ""
    return str(stamp.ToJsonString())


def _seconds(start: Any, end: Any) -> float | None:
    if start.seconds == 0 or end.seconds == 0:
        return None
    seconds: float = (end.seconds - start.seconds) + (end.nanos - start.nanos) / 1e9
    return round(seconds, 3)


def summarize(trace: state_pb2.RolloutTrace, bundle: str) -> dict[str, Any]:
    """The line `list` shows for a reduced bundle (JSON-ready)."""
    thread = trace.threads.get(trace.root_thread_id)
    turns = [trace.turns[t] for t in thread.turn_ids if t in trace.turns] if thread else []
    # A rollout's outcome is its last turn's; a thread without turns has only its own.
    if turns:
        status = _STATUS.get(turns[-1].execution.status, "unspecified")
    elif thread is not None:
        status = _STATUS.get(thread.execution.status, "unspecified")
    else:
        status = "unspecified"
    usage = {"input": 0, "output": 0, "total": 0}
    for call in trace.inference_calls.values():
        usage["input"] += call.usage.input_tokens
        usage["output"] += call.usage.output_tokens
        usage["total"] += call.usage.total_tokens
    rewards: dict[str, float] = {}
    for reward in trace.rewards:
        # The latest value of each name; a rollout is usually scored once per name.
        rewards[reward.name] = reward.value
    texts: list[str] = []
    size = 0
    for item_id in thread.conversation_item_ids if thread else ():
        item = trace.conversation_items.get(item_id)
        if item is None:
            continue
        for part in item.content:
            if size >= TEXT_CHARS:
                break
            texts.append(part.text[: TEXT_CHARS - size])
            size += len(texts[-1])
    fork = trace.fork if trace.HasField("fork") else None
    return {
        "bundle": bundle,
        "thread_id": trace.root_thread_id,
        "trace_id": trace.trace_id,
        "model": thread.model if thread is not None else "",
        "status": status,
        "turns": len(turns),
        "calls": len(trace.inference_calls),
        "tool_calls": len(trace.tool_calls),
        "tools": sorted({t.name for t in trace.tool_calls.values()}),
        "tokens": usage,
        "rewards": rewards,
        "integrity": _INTEGRITY.get(trace.integrity.status, "unspecified"),
        "recording_complete": trace.recording_complete,
        "started": _iso(trace.started_at),
        "duration": _seconds(trace.started_at, trace.ended_at),
        "metadata": dict(sorted(thread.metadata.items())) if thread is not None else {},
        "fork": {
            "parent_thread_id": fork.parent_thread_id,
            "group_id": fork.group_id,
            "repetition_index": fork.repetition_index,
            "resumed": fork.resumed,
        }
        if fork is not None
        else None,
        "text": "\n".join(texts),
    }


def _unreadable(bundle: str, detail: str) -> dict[str, Any]:
    return {
        "bundle": bundle,
        "thread_id": "",
        "trace_id": "",
        "model": "",
        "status": "unreadable",
        "turns": 0,
        "calls": 0,
        "tool_calls": 0,
        "tools": [],
        "tokens": {"input": 0, "output": 0, "total": 0},
        "rewards": {},
        "integrity": "",
        "recording_complete": False,
        "started": "",
        "duration": None,
        "metadata": {},
        "fork": None,
        "text": "",
        "error": detail,
    }


# What each field of a summary holds, to check an index entry against (a summary's values).
_SHAPE: dict[str, tuple[type, ...]] = {
    "bundle": (str,),
    "thread_id": (str,),
    "trace_id": (str,),
    "model": (str,),
    "status": (str,),
    "turns": (int,),
    "calls": (int,),
    "tool_calls": (int,),
    "tools": (list,),
    "tokens": (dict,),
    "rewards": (dict,),
    "integrity": (str,),
    "recording_complete": (bool,),
    "started": (str,),
    "duration": (int, float, type(None)),
    "metadata": (dict,),
    "fork": (dict, type(None)),
    "text": (str,),
}
_FORK_SHAPE: dict[str, tuple[type, ...]] = {
    "parent_thread_id": (str,),
    "group_id": (str,),
    "repetition_index": (int,),
    "resumed": (bool,),
}


def _fields_shaped(value: dict[str, Any], shape: dict[str, tuple[type, ...]]) -> bool:
    return all(isinstance(value.get(name, ...), kinds) for name, kinds in shape.items())


def _run_shaped(run: dict[str, Any]) -> bool:
    """Whether an index entry's summary is one `summarize` (or `_unreadable`) could give."""
    if not _fields_shaped(run, _SHAPE):
        return False
    if "error" in run and not isinstance(run["error"], str):
        return False
    tokens, rewards, metadata, fork = run["tokens"], run["rewards"], run["metadata"], run["fork"]
    return (
        all(isinstance(tokens.get(name), int) for name in ("input", "output", "total"))
        and all(isinstance(name, str) for name in run["tools"])
        and all(type(value) in (int, float) for value in rewards.values())
        and all(isinstance(value, str) for value in metadata.values())
        and (fork is None or _fields_shaped(fork, _FORK_SHAPE))
    )


def _key(entry: BundleEntry) -> list[float | None]:
    return [entry.trace_mtime, entry.state_mtime, entry.rewards_mtime]


def _index_path(store: Store, root: str) -> Path:
    if isinstance(store, LocalStore):
        return Path(store.root) / INDEX_FILE_NAME
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(root.encode()).hexdigest()[:24]
    return cache / "rollout-trace" / f"list-{digest}.json"


@dataclass
class RunIndex:
    """The summaries of a root's bundles, each with the file times it was made from."""

    path: Path
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    changed: bool = False

    @classmethod
    def load(cls, path: Path) -> RunIndex:
        """The index at path; an empty one when it is missing, not ours or not a regular file
        (never a symbolic link followed, nor a FIFO waited on)."""
        try:
            with open(open_regular_file(path, os.O_RDONLY), "rb") as source:
                raw = source.read()
            # This writer never escapes a character; an escaped surrogate means another did.
            data = None if b"\\ud" in raw or b"\\uD" in raw else json.loads(raw)
        except (OSError, ValueError, RecursionError):
            return cls(path)
        if not isinstance(data, dict) or data.get("version") != _INDEX_VERSION:
            return cls(path)
        entries = data.get("entries")
        return cls(path, entries if isinstance(entries, dict) else {})

    def run(self, location: str, key: list[float | None], bundle: str) -> dict[str, Any] | None:
        """The summary kept for a bundle, when its file times are still key and it has the
        shape `summarize` gives (anything else is read again from the bundle)."""
        kept = self.entries.get(location)
        if not isinstance(kept, dict) or kept.get("key") != key:
            return None
        run = kept.get("run")
        if not isinstance(run, dict) or run.get("bundle") != bundle or not _run_shaped(run):
            return None
        return run

    def save(self) -> None:
        """Replace the index file whole; a root nobody may write to just keeps none."""
        if not self.changed:
            return
        temp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(
                    {"version": _INDEX_VERSION, "entries": self.entries},
                    out,
                    ensure_ascii=False,
                    separators=(",", ":"),
                )
            os.replace(temp, self.path)
        except OSError:
            temp.unlink(missing_ok=True)


def _reduce(store: Store, entry: BundleEntry) -> state_pb2.RolloutTrace:
    """What reduce-all kept (a fresh state.json), else the bundle reduced now."""
    from ._batch import replay_from_store

    trace: state_pb2.RolloutTrace | None = None
    if entry.state_is_fresh:
        try:
            trace = store.read_state(entry.location)
        except Exception:  # noqa: BLE001 - an unreadable state.json is rebuilt from the bundle
            trace = None
    if trace is None:
        # The fork's parent found beside it, the rewards beside it attached, as reduce-all.
        trace = replay_from_store(store, entry.location)
    return trace


@dataclass
class Listing:
    runs: list[dict[str, Any]]
    reduced: int
    cached: int


def list_runs(
    root: str,
    *,
    storage_options: tuple[tuple[str, str], ...] = (),
    warn: Callable[[str], None] = lambda _: None,
    index_path: Path | None = None,
    now: float | None = None,
) -> Listing:
    """Every bundle under root, summarized: from the index when its files have not changed
    since, else from its fresh state.json or by reducing it; the index is then updated.

    Raises BundleError (BundleNotFoundError, NotABundleError) when root is not a directory."""
    store = open_store(root, storage_options)
    entries = store.discover(warn)
    index = RunIndex.load(index_path or _index_path(store, root))
    moment = time.time() if now is None else now
    runs: list[dict[str, Any]] = []
    reduced = cached = 0
    seen: set[str] = set()
    for entry in entries:
        seen.add(entry.location)
        key = _key(entry)
        bundle = store.display(entry.location)
        kept = index.run(entry.location, key, bundle)
        if kept is not None:
            run = kept
            cached += 1
        else:
            try:
                run = summarize(_reduce(store, entry), bundle)
            except (BundleError, ReductionError) as error:
                run = _unreadable(bundle, str(error))
            except OSError as error:
                run = _unreadable(bundle, f"{error.strerror or error}")
            index.entries[entry.location] = {"key": key, "run": run}
            index.changed = True
            reduced += 1
        run = dict(run)
        run["live"] = (
            run["integrity"] in _MAYBE_LIVE
            and entry.trace_mtime is not None
            and moment - entry.trace_mtime < LIVE_WINDOW
        )
        if run["live"]:
            run["status"] = "live"
        runs.append(run)
    for gone in set(index.entries) - seen:
        del index.entries[gone]
        index.changed = True
    index.save()
    return Listing(runs, reduced, cached)


# -- filters ---------------------------------------------------------------------------------

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "!=": operator.ne,
    "==": operator.eq,
    "=": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
_REWARD = re.compile(r"^\s*([^<>=!\s]+)\s*(>=|<=|!=|==|=|>|<)\s*(\S+)\s*$")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_reward_filter(text: str) -> tuple[str, str, float]:
    """`KEY>=X` (or <=, >, <, =, !=) as (key, operator, value); ValueError says why not."""
    match = _REWARD.match(text)
    if match is None:
        raise ValueError(f"--reward expects KEY>=X (or <=, >, <, =, !=), got {text!r}")
    try:
        value = float(match[3])
    except ValueError:
        raise ValueError(f"--reward {text!r}: {match[3]!r} is not a number") from None
    if math.isnan(value):
        raise ValueError(f"--reward {text!r}: the value must be a number")
    return match[1], match[2], value


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO date or time (UTC when it names no zone), or an age: 30m, 2h, 7d."""
    moment = now or datetime.now(UTC)
    relative = _RELATIVE.match(text.strip())
    if relative:
        try:
            return moment - timedelta(seconds=float(relative[1]) * _UNITS[relative[2]])
        except OverflowError:
            # Further back than datetime reaches: every run is newer.
            return datetime.min.replace(tzinfo=UTC)
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--since expects an ISO date or time, or an age such as 30m, 2h, 7d; got {text!r}"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True)
class RunFilter:
    """Which runs to show; every field set must match."""

    statuses: frozenset[str] = frozenset()
    integrities: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    rewards: tuple[tuple[str, str, float], ...] = ()
    since: datetime | None = None
    tools: frozenset[str] = frozenset()
    text: str = ""

    def matches(self, run: dict[str, Any]) -> bool:
        if self.statuses and run["status"] not in self.statuses:
            return False
        if self.integrities and run["integrity"] not in self.integrities:
            return False
        if self.models and run["model"].lower() not in self.models:
            return False
        for key, op, value in self.rewards:
            got = run["rewards"].get(key)
            if got is None or not _COMPARE[op](got, value):
                return False
        if self.since is not None:
            started = run["started"]
            if not started or datetime.fromisoformat(started.replace("Z", "+00:00")) < self.since:
                return False
        if self.tools and not self.tools & set(run["tools"]):
            return False
        if self.text:
            needle = self.text.lower()
            haystack = (
                run["thread_id"],
                run["model"],
                run["bundle"],
                run["text"],
                *run["metadata"].values(),
            )
            if not any(needle in value.lower() for value in haystack):
                return False
        return True


def split_values(values: Iterable[str]) -> frozenset[str]:
    """Repeated or comma-separated flag values, lower case."""
    return frozenset(
        part.strip().lower() for value in values for part in value.split(",") if part.strip()
    )


SORT_KEYS = ("started", "duration", "tokens", "turns", "calls", "status", "model")


def sort_runs(runs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """By `key` (a SORT_KEYS name or reward:NAME), `-key` for descending; runs without the
    value go last either way."""
    descending = key.startswith("-")
    name = key.removeprefix("-")

    def value(run: dict[str, Any]) -> Any:
        if name.startswith("reward:"):
            return run["rewards"].get(name.removeprefix("reward:"))
        if name == "tokens":
            return run["tokens"]["total"]
        return run.get(name)

    present = [run for run in runs if value(run) not in (None, "")]
    missing = [run for run in runs if value(run) in (None, "")]
    present.sort(key=value, reverse=descending)
    return present + missing


def check_sort_key(key: str) -> str:
    name = key.removeprefix("-")
    if name in SORT_KEYS or (name.startswith("reward:") and len(name) > len("reward:")):
        return key
    raise ValueError(f"--sort expects one of {', '.join(SORT_KEYS)} or reward:NAME, got {key!r}")


# -- the text table -------------------------------------------------------------------------


def _rewards_text(rewards: dict[str, float]) -> str:
    return ",".join(f"{name}={value:g}" for name, value in sorted(rewards.items())) or "-"


def _duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


COLUMNS = (
    "THREAD",
    "MODEL",
    "STATUS",
    "TURNS",
    "CALLS",
    "TOOLS",
    "TOKENS",
    "REWARDS",
    "INTEGRITY",
    "STARTED",
    "DURATION",
)


def table_rows(runs: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [COLUMNS]
    for run in runs:
        rows.append(
            (
                run["thread_id"] or run["bundle"],
                run["model"] or "-",
                run["status"],
                str(run["turns"]),
                str(run["calls"]),
                str(run["tool_calls"]),
                str(run["tokens"]["total"]),
                _rewards_text(run["rewards"]),
                run["integrity"] or "-",
                run["started"][:19].replace("T", " ") if run["started"] else "-",
                _duration_text(run["duration"]),
            )
        )
    return rows


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = table_rows(runs)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def public_run(run: dict[str, Any]) -> dict[str, Any]:
    """A run as --json prints it: the summary without the search text."""
    return {key: value for key, value in run.items() if key != "text"}
