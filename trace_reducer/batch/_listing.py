"""`trace-reducer list`: one summary per bundle under a root, kept in an index so that a warm
listing reads no bundle at all, and filters over those summaries."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import operator
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._confine import open_regular_file, write_aside
from ..bundle._errors import BundleError, ReductionError
from ..bundle._liveness import being_written
from ..bundle._names import INTEGRITY_WORDS, OUTCOME_WORDS, rollout_outcome
from ..bundle._shown import one_line
from ..reduce._pass import no_cycle_collection
from ._storage import (
    BundleEntry,
    LocalStore,
    Store,
    describe_store_error,
    open_store,
    state_mismatch,
)

__all__ = [
    "INDEX_FILE_NAME",
    "Run",
    "RunFilter",
    "RunIndex",
    "list_runs",
    "parse_reward_filter",
    "parse_since",
    "summarize",
]

# Kept directly under a local root; a URL root's index lives in the user's cache directory.
INDEX_FILE_NAME = ".trace-list.json"
# Raised whenever what the file holds or how it is laid out changes: an index of any other
# version is ignored and rebuilt, never read in the wrong layout.
# 1: every run kept as a JSON object.
# 2: each run kept as the JSON line `list --json` prints, beside the fields a listing needs
#    before it knows whether to parse it; every search text in one JSON object after them,
#    later one text a line (not raised then: an index of one or two runs in the older layout
#    was read as texts of "", and `--text` found nothing in it).
# 3: tokens null when unknown, and `unknown_calls` (2 counted a call without usage as 0
#    tokens); an index of either layout of 2 is rebuilt.
# 4: integrity in the words of every other surface, CLEAN, UNCLOSED, ... (was clean, ...).
_INDEX_VERSION = 4
# What --text searches: the start of every item's text, up to this much per bundle.
TEXT_CHARS = 16_384

# The integrity's word is every surface's (`describe_integrity`, the tables, the viewer, the RL
# export): CLEAN, UNCLOSED, TRUNCATED, CORRUPT. `--integrity` takes it in any case.
_INTEGRITY = INTEGRITY_WORDS
_MAYBE_LIVE = {
    INTEGRITY_WORDS[state_pb2.INTEGRITY_STATUS_UNCLOSED],
    INTEGRITY_WORDS[state_pb2.INTEGRITY_STATUS_TRUNCATED],
}


def _iso(stamp: Any) -> str:
    if stamp.seconds == 0 and stamp.nanos == 0:
        return ""
    return str(stamp.ToJsonString())


def _seconds(start: Any, end: Any) -> float | None:
    if start.seconds == 0 or end.seconds == 0:
        return None
    seconds: float = (end.seconds - start.seconds) + (end.nanos - start.nanos) / 1e9
    return round(seconds, 3)


def _tokens(calls: Iterable[state_pb2.InferenceCall]) -> dict[str, int | None]:
    """A run's tokens: the sums over the calls whose provider reported usage, and how many
    answers did not (`unknown_calls`: completed calls without usage, such as a Chat stream
    without `stream_options.include_usage`). Each sum is null when there are such calls and
    none reported usage: the count is unknown, and 0 would claim none were spent (was: 0).
    A call that failed or was cut off without usage adds nothing, as before."""
    sums = {"input": 0, "output": 0, "total": 0}
    reported = unknown = 0
    for call in calls:
        if not call.HasField("usage"):
            unknown += call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
            continue
        reported += 1
        sums["input"] += call.usage.input_tokens
        sums["output"] += call.usage.output_tokens
        sums["total"] += call.usage.total_tokens
    tokens: dict[str, int | None] = {**sums}
    if unknown and not reported:
        tokens = dict.fromkeys(sums)
    tokens["unknown_calls"] = unknown
    return tokens


def summarize(trace: state_pb2.RolloutTrace, bundle: str) -> dict[str, Any]:
    """The line `list` shows for a reduced bundle (JSON-ready)."""
    thread = trace.threads.get(trace.root_thread_id)
    turns = [trace.turns[t] for t in thread.turn_ids if t in trace.turns] if thread else []
    # A rollout's outcome is its last turn's; a thread without turns has only its own.
    status = rollout_outcome(trace)
    if not trace.integrity.records_read:
        # Not a bundle yet (an empty file just made) or at all: its integrity tells which.
        status = "unreadable"
    usage = _tokens(trace.inference_calls.values())
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
        "integrity": _INTEGRITY.get(trace.integrity.status, "UNSPECIFIED"),
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
        "tokens": {"input": None, "output": None, "total": None, "unknown_calls": 0},
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


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class Run(Mapping[str, Any]):
    """One bundle's summary (`summarize`'s fields, plus `live`), parsed from its kept JSON
    line only when a field other than status, integrity and start time is first read: a
    listing that filters on nothing prints the kept lines as they are."""

    __slots__ = (
        "_data",
        "_line",
        "_recorded_status",
        "_searched",
        "_text",
        "integrity",
        "live",
        "started",
    )

    def __init__(
        self, kept: Sequence[str], text: str | Callable[[], str], *, live: bool = False
    ) -> None:
        # [the public fields as JSON (no `live`), status, integrity, started]
        self._line, self._recorded_status, self.integrity, self.started = kept
        self._text = text
        self._data: dict[str, Any] | None = None
        self._searched: str | None = None
        self.live = live

    @classmethod
    def of(cls, summary: Mapping[str, Any], *, live: bool = False) -> Run:
        public = {key: value for key, value in summary.items() if key not in ("text", "live")}
        kept = (_JSON.encode(public), summary["status"], summary["integrity"], summary["started"])
        return cls(kept, summary["text"], live=live)

    def kept(self) -> list[str]:
        """What the index keeps of it, besides its text."""
        return [self._line, self._recorded_status, self.integrity, self.started]

    @property
    def status(self) -> str:
        return "live" if self.live else self._recorded_status

    @property
    def text(self) -> str:
        if not isinstance(self._text, str):
            self._text = self._text()
        return self._text

    def searched_text(self) -> str:
        """_searched_text of this run, made once: the served list asks question after question
        of the same runs, and lower-casing each run's text for each costs most of an answer."""
        if self._searched is None:
            self._searched = _searched_text(self)
        return self._searched

    def _parsed(self) -> dict[str, Any]:
        if self._data is None:
            try:
                data = json.loads(self._line)
            except ValueError:
                data = None
            if not isinstance(data, dict) or not data.keys() >= _SUMMARY_KEYS:
                # An index entry someone else wrote, of the wrong shape: shown for what it is.
                data = _unreadable("", "this run's entry in the listing's index is damaged")
                del data["text"]
            self._data = data
        return self._data

    def __getitem__(self, key: str) -> Any:
        if key in _EAGER:
            return getattr(self, key)
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._parsed()
        yield "text"
        yield "live"

    def __len__(self) -> int:
        return len(self._parsed()) + 2

    def __repr__(self) -> str:
        return f"Run({dict(self)!r})"

    def json_line(self) -> str:
        """The line `list --json` prints: every field but the search text, `live` last."""
        if self.live:
            return _JSON.encode(public_run(self))
        return f'{self._line[:-1]},"live":false}}'


_SUMMARY_KEYS = frozenset(_unreadable("", "").keys()) - {"text", "error"}
_EAGER = frozenset({"text", "live", "status", "integrity", "started"})


def _key(entry: BundleEntry) -> list[float | None]:
    return [entry.trace_mtime, entry.state_mtime, entry.rewards_mtime]


def _index_path(store: Store, root: str) -> Path:
    if isinstance(store, LocalStore):
        return Path(store.root) / INDEX_FILE_NAME
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(root.encode()).hexdigest()[:24]
    return cache / "rollout-trace" / f"list-{digest}.json"


def _text_of(raw: str) -> str:
    try:
        text = json.loads(raw)
    except ValueError:
        return ""
    return text if type(text) is str else ""


@dataclass
class RunIndex:
    """The summaries of a root's bundles, each with the file times it was made from.

    One file of lines: `{"version", "entries": [[bundle, times, status, integrity, started],
    ...]}`; then each entry's run as the JSON line `list --json` prints (without `live`); then
    each entry's search text as a JSON string, the bulk of the file. The lines are kept as they
    are: a listing decodes a run's line only when a filter or the table asks for a field, a
    text only when a search or a page does, and an index saved again writes them back as read."""

    path: Path
    # bundle: [times, [json line, status, integrity, started], search text as JSON]
    entries: dict[str, list[Any]] = field(default_factory=dict)
    changed: bool = False

    @classmethod
    def load(cls, path: Path) -> RunIndex:
        # A file in the root is anyone's who may write there: opened as a regular file only
        # (no link followed, no FIFO waited on), only JSON read from it, and an entry of the
        # wrong shape is summarized again.
        try:
            with os.fdopen(open_regular_file(path, os.O_RDONLY), "rb") as source:
                lines = source.read().decode("utf-8").split("\n")
            top = json.loads(lines[0])
        except (OSError, ValueError, RecursionError):  # nested past the parser: not ours
            return cls(path)
        if not isinstance(top, dict) or top.get("version") != _INDEX_VERSION:
            return cls(path)
        heads = top.get("entries")
        if not isinstance(heads, list) or len(lines) < 2 * len(heads) + 1:
            return cls(path)
        count = len(heads)
        entries: dict[str, list[Any]] = {}
        runs, texts = lines[1 : count + 1], lines[count + 1 : 2 * count + 1]
        for head, line, text in zip(heads, runs, texts, strict=True):
            if type(head) is list and len(head) == 5 and type(head[0]) is str:
                location, times, status, integrity, started = head
                entries[location] = [times, [line, status, integrity, started], text]
        return cls(path, entries)

    def get(self, location: str, key: list[float | None]) -> tuple[list[str], str] | None:
        """What is kept for the bundle (its fields, its text as JSON) if it was made from
        files with these times."""
        kept = self.entries.get(location)
        if kept is None or kept[0] != key:
            return None
        fields: list[str] = kept[1]
        line, status, integrity, started = fields
        shaped = type(status) is str and type(integrity) is str and type(started) is str
        if shaped and line.startswith("{") and line.endswith("}"):
            return fields, kept[2]
        return None

    def keep(self, location: str, key: list[float | None], run: Run) -> None:
        self.entries[location] = [key, run.kept(), _JSON.encode(run.text)]
        self.changed = True

    def forget(self, locations: Iterable[str]) -> None:
        for location in locations:
            del self.entries[location]
            self.changed = True

    def save(self) -> None:
        """Replace the index file whole; a root nobody may write to just keeps none."""
        if not self.changed:
            return
        heads = [
            [location, key, status, integrity, started]
            for location, (key, (_, status, integrity, started), _) in self.entries.items()
        ]
        kept = self.entries.values()

        def write(raw: BinaryIO) -> None:
            out = io.TextIOWrapper(raw, encoding="utf-8")
            # JSON holds no raw newline: each line is one JSON text.
            out.write(_JSON.encode({"version": _INDEX_VERSION, "entries": heads}))
            out.write("\n")
            out.writelines(f"{fields[0]}\n" for _, fields, _ in kept)
            out.writelines(f"{text}\n" for _, _, text in kept)
            out.detach()  # flushed, and `raw` left for write_aside to close

        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Private (0600) as the bundles whose text it keeps.
            write_aside(self.path, write, mode=0o600)


def indexed_integrity(store: Store, root: str) -> Callable[[BundleEntry], str | None]:
    """What the index `list` keeps under root says of a bundle's integrity (CLEAN, UNCLOSED,
    TRUNCATED, CORRUPT), when its files have not changed since; None when it has no such
    entry. Reads the index's first line alone (the entries' heads), not its runs or texts:
    reduce-all counts an up-to-date bundle's integrity so without opening its state.json."""
    try:
        with os.fdopen(open_regular_file(_index_path(store, root), os.O_RDONLY), "rb") as source:
            top = json.loads(source.readline())
    except (OSError, ValueError, RecursionError):  # none, or not ours: as RunIndex.load
        return lambda _: None
    if not isinstance(top, dict) or top.get("version") != _INDEX_VERSION:
        return lambda _: None
    heads = top.get("entries")
    if not isinstance(heads, list):
        return lambda _: None
    kept = {
        head[0]: (head[1], head[3])
        for head in heads
        if type(head) is list and len(head) == 5 and type(head[0]) is str
    }

    def integrity(entry: BundleEntry) -> str | None:
        times, name = kept.get(entry.location, (None, None))
        if times != _key(entry) or type(name) is not str or name not in INTEGRITY_NAMES:
            return None
        return name

    return integrity


def _reduce(store: Store, entry: BundleEntry) -> tuple[state_pb2.RolloutTrace, bool]:
    """What reduce-all kept (a fresh state.json), else the bundle reduced now; and whether a
    state.json newer than the bundle was passed over (unreadable, or another bundle's)."""
    from ._batch import replay_from_store

    trace: state_pb2.RolloutTrace | None = None
    if entry.state_is_fresh:
        try:
            trace = store.read_state(entry.location)
            # Newer than the bundle is not enough: another bundle's is rebuilt too.
            if state_mismatch(store, entry.location, trace) is not None:
                trace = None
        except Exception:  # noqa: BLE001 - an unreadable state.json is rebuilt from the bundle
            trace = None
    if trace is not None:
        return trace, False
    # The fork's parent found beside it, the rewards beside it attached, as reduce-all.
    return replay_from_store(store, entry.location), entry.state_is_fresh


@dataclass
class Listing:
    runs: list[Run]
    reduced: int
    cached: int


class ReadProgress(Protocol):
    """Told how many bundles a listing reads afresh (the index does not hold them, or they
    changed), of each as it is read (`bad`: unreadable), and when it is over: the CLI's
    progress bar (`trace_reducer.cli._progress`)."""

    def started(self, total: int) -> None: ...

    def advanced(self, count: int = 1, bad: int = 0) -> None: ...

    def finished(self) -> None: ...


def list_runs(
    root: str,
    *,
    storage_options: tuple[tuple[str, str], ...] = (),
    warn: Callable[[str], None] = lambda _: None,
    index_path: Path | None = None,
    now: float | None = None,
    bundle_root_refused: bool = True,
    progress: ReadProgress | None = None,
) -> Listing:
    """Every bundle under root, summarized: from the index when its files have not changed
    since, else from its fresh state.json or by reducing it; the index is then updated.
    `progress` is told of the bundles read afresh, and only when there are some.

    Raises BundleError (BundleNotFoundError, NotABundleError) when root is not a directory,
    or is a bundle itself unless bundle_root_refused is False (its trace.binpb is then passed
    over)."""
    with no_cycle_collection():
        store = open_store(root, storage_options, bundle_root_refused=bundle_root_refused)
        return _list_runs(store, root, warn, index_path, now, progress)


def _still_written(store: Store, entry: BundleEntry, integrity: str, moment: float) -> bool:
    # The lock is looked at only for a bundle that has no footer: one open of its file.
    if integrity not in _MAYBE_LIVE:
        return False
    return being_written(store.writer_holds(entry.location), entry.trace_mtime, moment)


def _list_runs(
    store: Store,
    root: str,
    warn: Callable[[str], None],
    index_path: Path | None,
    now: float | None,
    progress: ReadProgress | None = None,
) -> Listing:
    entries = store.discover(warn)
    index = RunIndex.load(index_path or _index_path(store, root))
    moment = time.time() if now is None else now
    runs: list[Run] = []
    reduced = cached = 0
    seen: set[str] = set()
    # Each looked up first, so that a listing which reads bundles afresh says how many before
    # it starts: a cold root of thousands took minutes without a word. A warm one shows nothing.
    looked_up = []
    for entry in entries:
        key = _key(entry)
        looked_up.append((entry, key, index.get(entry.location, key)))
    fresh = sum(kept is None for _, _, kept in looked_up)
    told = progress if progress is not None and fresh else None
    if told is not None:
        told.started(fresh)
    try:
        for entry, key, kept in looked_up:
            seen.add(entry.location)
            if kept is not None:
                cached += 1
                fields, text = kept
                live = _still_written(store, entry, fields[2], moment)
                run = Run(fields, functools.partial(_text_of, text), live=live)
            else:
                bundle = store.display(entry.location)
                try:
                    trace, passed_over = _reduce(store, entry)
                    summary = summarize(trace, bundle)
                    if passed_over:
                        # Kept as made without it: reduce-all, which takes the index's word
                        # for an up-to-date state.json, rebuilds that one instead.
                        key = [entry.trace_mtime, None, entry.rewards_mtime]
                except (BundleError, ReductionError) as error:
                    summary = _unreadable(bundle, str(error))
                except OSError as error:
                    summary = _unreadable(bundle, describe_store_error(store, error, named=False))
                live = _still_written(store, entry, summary["integrity"], moment)
                run = Run.of(summary, live=live)
                index.keep(entry.location, key, run)
                reduced += 1
                if told is not None:
                    told.advanced(1, bad=int(summary["status"] == "unreadable"))
            runs.append(run)
    finally:
        if told is not None:
            told.finished()
    gone = set(index.entries) - seen
    if gone:
        index.forget(gone)
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


def parse_reward_filter(text: str, *, name: str = "--reward") -> tuple[str, str, float]:
    """`KEY>=X` (or <=, >, <, =, !=) as (key, operator, value); ValueError says why not,
    calling the value `name`."""
    match = _REWARD.match(text)
    if match is None:
        raise ValueError(f"{name} expects KEY>=X (or <=, >, <, =, !=), got {text!r}")
    try:
        value = float(match[3])
    except ValueError:
        raise ValueError(f"{name} {text!r}: {match[3]!r} is not a number") from None
    if math.isnan(value):
        raise ValueError(f"{name} {text!r}: the value must be a number")
    return match[1], match[2], value


def parse_since(text: str, now: datetime | None = None, *, name: str = "--since") -> datetime:
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
            f"{name} expects an ISO date or time, or an age such as 30m, 2h, 7d; got {text!r}"
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

    def matches(self, run: Mapping[str, Any]) -> bool:
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
            if _FIELD_END in needle:
                # It could span two fields of the joined text: each field alone, then.
                fields = _searched_fields(run)
                if not any(needle in value.lower() for value in fields):
                    return False
            elif needle not in (
                run.searched_text() if isinstance(run, Run) else _searched_text(run)
            ):
                return False
        return True

    @classmethod
    def of(cls, values: Mapping[str, Sequence[str]], *, prefix: str = "--") -> RunFilter:
        """The filter `values` describe, by FILTER_NAMES (each name's values as given:
        repeated, or a,b; since and text their last); ValueError names a bad one, spelt
        prefix + name (`list`'s flags, the served list's query parameters)."""

        def given(name: str) -> Sequence[str]:
            return values.get(name, ())

        since = given("since")
        text = given("text")
        return cls(
            statuses=split_values(
                given("status"),
                flag=f"{prefix}status",
                known=STATUS_NAMES,
                other_words=API_STATUS_WORDS,
            ),
            # Upper case, the word every surface shows; clean, ... (what list once showed) is
            # still taken, so no script that filters on it breaks.
            integrities=split_values(
                given("integrity"), flag=f"{prefix}integrity", known=INTEGRITY_NAMES, upper=True
            ),
            models=split_values(given("model")),
            rewards=tuple(
                parse_reward_filter(condition, name=f"{prefix}reward")
                for condition in given("reward")
            ),
            since=parse_since(since[-1], name=f"{prefix}since") if since and since[-1] else None,
            tools=frozenset(given("tool")),
            text=text[-1] if text else "",
        )


def _searched_fields(run: Mapping[str, Any]) -> tuple[str, ...]:
    """What --text searches: the run's ids (its thread's, its trace's, and for a fork its
    group's and its parent thread's, so a search finds a whole trace or fork group), model,
    bundle path, text, metadata values and tool names. The static site's page searches the
    same fields (`haystack` in view/_list.js)."""
    # An index entry is read back as written; one of another shape searches as empty there.
    fork = run["fork"] if isinstance(run["fork"], dict) else {}
    tools = run["tools"] if isinstance(run["tools"], list) else []
    return (
        run["thread_id"],
        run["trace_id"],
        str(fork.get("group_id") or ""),
        str(fork.get("parent_thread_id") or ""),
        run["model"],
        run["bundle"],
        run["text"],
        *run["metadata"].values(),
        *(str(tool) for tool in tools),
    )


# Between the fields of the searched text: a search without it matches within one field only.
_FIELD_END = "\0"


def _searched_text(run: Mapping[str, Any]) -> str:
    """_searched_fields lower-cased, joined by _FIELD_END."""
    return _FIELD_END.join(_searched_fields(run)).lower()


# The names of RunFilter.of's values: `list`'s filter flags, the served list's parameters.
FILTER_NAMES = ("status", "integrity", "model", "reward", "since", "tool", "text")


def split_values(
    values: Iterable[str],
    *,
    flag: str = "",
    known: Iterable[str] = (),
    other_words: Mapping[str, str] | None = None,
    upper: bool = False,
) -> frozenset[str]:
    """Repeated or comma-separated flag values, lower case (upper case with `upper`: a value
    is taken in either); with `known`, a value outside it is a ValueError naming `flag` (a
    filter no run can match is a typo, not an answer), and saying which known word stands for
    it when `other_words` has it."""
    fold = str.upper if upper else str.lower
    chosen = frozenset(
        fold(part.strip()) for value in values for part in value.split(",") if part.strip()
    )
    allowed = frozenset(known)
    if allowed and not chosen <= allowed:
        unknown = sorted(chosen - allowed)
        message = f"{flag} takes {', '.join(sorted(allowed))}; not {', '.join(unknown)}"
        meant = other_words or {}
        said = [f"{meant[word]} for {word}" for word in unknown if word in meant]
        if said:
            message += f" (the trace says {', '.join(said)}: docs/vocabulary.md)"
        raise ValueError(message)
    return chosen


# Every word a listing's status and integrity columns can hold.
STATUS_NAMES = frozenset(OUTCOME_WORDS.values()) | {"live", "unreadable"}
# The agent API's words for a turn (TurnStatus, `agent-server chat`'s `[interrupted]`), which a
# listing, reading the trace, says in the trace's (docs/vocabulary.md): named, not taken.
API_STATUS_WORDS = {
    "interrupted": "cancelled",
    "in_progress": "running",
    "awaiting_tool_outputs": "running",
}
INTEGRITY_NAMES = frozenset(_INTEGRITY.values())


SORT_KEYS = (
    "started",
    "duration",
    "tokens",
    "turns",
    "calls",
    "tool_calls",
    "status",
    "integrity",
    "model",
    "thread_id",
)


def sort_runs(runs: Sequence[Mapping[str, Any]], key: str) -> list[Mapping[str, Any]]:
    """By `key` (a SORT_KEYS name or reward:NAME), `-key` for descending; runs without the
    value go last either way."""
    descending = key.startswith("-")
    name = key.removeprefix("-")

    def value(run: Mapping[str, Any]) -> Any:
        if name.startswith("reward:"):
            return run["rewards"].get(name.removeprefix("reward:"))
        if name == "tokens":
            return run["tokens"]["total"]
        return run.get(name)

    keyed = [(value(run), run) for run in runs]
    present = [pair for pair in keyed if pair[0] not in (None, "")]
    missing = [run for got, run in keyed if got in (None, "")]
    present.sort(key=operator.itemgetter(0), reverse=descending)
    return [run for _, run in present] + missing


def check_sort_key(key: str, *, name: str = "--sort") -> str:
    """key, if sort_runs takes it; ValueError otherwise, calling it `name`."""
    bare = key.removeprefix("-")
    if bare in SORT_KEYS or (bare.startswith("reward:") and len(bare) > len("reward:")):
        return key
    raise ValueError(f"{name} expects one of {', '.join(SORT_KEYS)} or reward:NAME, got {key!r}")


# -- the text table -------------------------------------------------------------------------


def _rewards_text(rewards: dict[str, float]) -> str:
    return ",".join(f"{name}={value:g}" for name, value in sorted(rewards.items())) or "-"


def _tokens_text(tokens: Mapping[str, Any]) -> str:
    """The total; `?` when no call reported usage, `N+?` when some did not."""
    total = tokens.get("total")
    if total is None:
        return "?"
    return f"{total}+?" if tokens.get("unknown_calls") else str(total)


def _duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


# Headed by the key `--sort` takes for the column (and `--json` prints it under), but the
# thread's and the rewards': TOOLS read as the tools a run declares, which `--json` calls
# `tools`, where the column counts its tool calls, as the served list's "tool calls" does.
COLUMNS = (
    "THREAD",
    "MODEL",
    "STATUS",
    "TURNS",
    "CALLS",
    "TOOL_CALLS",
    "TOKENS",
    "REWARDS",
    "INTEGRITY",
    "STARTED",
    "DURATION",
)


def table_rows(runs: Sequence[Mapping[str, Any]]) -> list[tuple[str, ...]]:
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
                _tokens_text(run["tokens"]),
                _rewards_text(run["rewards"]),
                run["integrity"] or "-",
                run["started"][:19].replace("T", " ") if run["started"] else "-",
                _duration_text(run["duration"]),
            )
        )
    return rows


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    # A cell is one line, whatever the bundle or its name holds (a newline, an escape).
    rows = [tuple(one_line(cell) for cell in row) for row in table_rows(runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def public_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run as --json prints it: the summary without the search text."""
    return {key: value for key, value in run.items() if key != "text"}


def run_line(run: Mapping[str, Any]) -> str:
    """A run as `list --json` prints it: its JSON line without the search text."""
    if isinstance(run, Run):
        return run.json_line()
    return _JSON.encode(public_run(run))
