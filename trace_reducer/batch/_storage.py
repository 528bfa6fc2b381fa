"""Where reduce-all finds bundles and puts state.json: a local tree or an fsspec URL."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import posixpath
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from google.protobuf import json_format

from rollout.trace.v1 import record_pb2, state_pb2

from ..bundle._confine import open_found_trace, open_regular_file
from ..bundle._discover import walk_bundles
from ..bundle._errors import (
    BundleError,
    BundleNotFoundError,
    NotABundleError,
    describe_os_error,
    os_error_reason,
)
from ..bundle._layout import REWARDS_FILE_NAME, STATE_FILE_NAME, TRACE_FILE_NAME
from ..bundle._liveness import being_written, writer_holds_file
from ..bundle._reader import BundleReader, FrameDecoder
from ..bundle._rewards import RewardFile, decode_rewards, read_rewards
from ..reduce._forks import BundleForkResolver, is_bundle_name
from ..reduce._parents import ForkResolver
from ..reduce._state_json import state_to_json, write_state_json

StorageOptions = tuple[tuple[str, str], ...]

# An http(s) root's connect and read timeout, in seconds: fsspec's HTTP file system sets none,
# and aiohttp's default waits 300 s on each request a server accepted and never answers.
# `--storage-option timeout=SECONDS` sets it (fsspec's own options are strings on the command
# line, which cannot spell the aiohttp ClientTimeout its `client_kwargs` would take).
HTTP_TIMEOUT = 30.0
HTTP_TIMEOUT_OPTION = "timeout"


class StoreTimeoutError(BundleError):
    """An http(s) root did not answer within its timeout."""


def url_filesystem(url: str, options: StorageOptions) -> tuple[Any, str, float | None]:
    """fsspec's file system and path for url (fsspec.core.url_to_fs), and for an http(s) one
    its connect and read timeout (HTTP_TIMEOUT, or the `timeout` option; else None). Raises
    ValueError for a timeout that is no number of seconds above 0."""
    import fsspec  # only URL roots need it

    kwargs: dict[str, Any] = dict(options)
    seconds = None
    if urllib.parse.urlsplit(url).scheme.lower() in ("http", "https"):
        import aiohttp  # fsspec's HTTP file system is built on it

        seconds = _timeout_seconds(kwargs.pop(HTTP_TIMEOUT_OPTION, None))
        # A whole request may take as long as it needs; a silence may not.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
        kwargs.setdefault("client_kwargs", {"timeout": timeout})
    filesystem, path = fsspec.core.url_to_fs(url, **kwargs)
    return filesystem, str(path), seconds


def _timeout_seconds(text: str | None) -> float:
    if text is None:
        return HTTP_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"--storage-option {HTTP_TIMEOUT_OPTION}=SECONDS expects a number of seconds above 0, "
            f"got {text!r}"
        )
    return seconds


def describe_store_error(store: Store, error: OSError, *, named: bool = True) -> str:
    """Why a request to the store failed, in a few words (`named`: with the file the OS
    names): for an http(s) root's timeout, how long it waited and how to wait longer
    (aiohttp's timeout says nothing at all)."""
    if isinstance(store, FsspecStore) and store.timed_out(error):
        return store.silence()
    return describe_os_error(error) if named else os_error_reason(error)


@dataclass(frozen=True, slots=True)
class BundleEntry:
    """A bundle directory found under the root, with what the listing said about it."""

    location: str
    trace_mtime: float | None
    state_mtime: float | None
    # A reward recorded after the last reduce makes the state.json stale too; one in the same
    # tick of the clock as the state.json might have missed it, so only a later state counts.
    rewards_mtime: float | None = None

    @property
    def state_is_fresh(self) -> bool:
        # Object stores keep whole seconds, so "as new as" counts: a state.json written in the
        # same second as the upload it reduced is not stale. A live bundle never gets a
        # state.json, so nothing appended later can hide behind that second.
        return (
            self.trace_mtime is not None
            and self.state_mtime is not None
            and self.state_mtime >= self.trace_mtime
            and (self.rewards_mtime is None or self.state_mtime > self.rewards_mtime)
        )


class Store(Protocol):
    """The operations reduce-all needs, whatever holds the bundles."""

    root: str
    # Only this process sees the bundles (memory://): no worker process can reduce them.
    process_local: bool

    def discover(self, warn: Callable[[str], None]) -> list[BundleEntry]: ...

    def display(self, location: str) -> str: ...

    def open_trace(self, location: str) -> BinaryIO: ...

    def trace_mtime(self, location: str) -> float | None: ...

    def writer_holds(self, location: str) -> bool | None: ...

    def write_state(self, location: str, trace: state_pb2.RolloutTrace) -> None: ...

    def read_state(self, location: str) -> state_pb2.RolloutTrace: ...

    def read_head(self, location: str) -> state_pb2.RolloutTrace: ...

    def read_rewards(self, location: str) -> RewardFile: ...

    def fork_resolver(self, location: str) -> ForkResolver: ...


def is_url(root: str) -> bool:
    return "://" in root


class LocalStore:
    """Bundles in a local directory tree; state.json through write_state_json (atomic)."""

    process_local = False

    def __init__(self, root: str, *, bundle_root_refused: bool = True) -> None:
        self.root = os.path.abspath(root)
        # False for a root served as it changes: a trace.binpb put in it later is passed over
        # (the walk starts below the root), not every page of it refused.
        self._bundle_root_refused = bundle_root_refused

    def discover(self, warn: Callable[[str], None]) -> list[BundleEntry]:
        if not os.path.lexists(self.root):
            raise BundleNotFoundError(f"no such file or directory: {self.root}")
        if not os.path.isdir(self.root):
            # Said for what it is (a FIFO, a link to nothing, a file), never opened. Loaded
            # here alone: grpc_common's package loads asyncio, which a listing never needs.
            from grpc_common._files import path_kind

            raise NotABundleError(f"not a directory: {self.root} is {path_kind(self.root)}")
        if self._bundle_root_refused and os.path.lexists(os.path.join(self.root, TRACE_FILE_NAME)):
            # A bundle is never a root (walk_bundles starts below it): say so, not "none here".
            raise NotABundleError(
                f"{self.root} is a bundle, not a root of bundles: give the directory holding it"
            )

        try:
            return [
                BundleEntry(found.path, found.trace_mtime, found.state_mtime, found.rewards_mtime)
                for found in walk_bundles(self.root, irregular=True, warn=warn)
            ]
        except OSError as error:
            raise NotABundleError(f"cannot list {self.root}: {error.strerror or error}") from error

    def display(self, location: str) -> str:
        return location

    def open_trace(self, location: str) -> BinaryIO:
        # Never a FIFO waited on, nor a symbolic link followed: one bad bundle never stops
        # the batch, nor reads outside the root.
        return open_found_trace(location)

    def trace_mtime(self, location: str) -> float | None:
        return _stat_mtime(os.path.join(location, TRACE_FILE_NAME))

    def writer_holds(self, location: str) -> bool | None:
        return writer_holds_file(os.path.join(location, TRACE_FILE_NAME))

    def write_state(self, location: str, trace: state_pb2.RolloutTrace) -> None:
        write_state_json(trace, os.path.join(location, STATE_FILE_NAME))

    def read_state(self, location: str) -> state_pb2.RolloutTrace:
        fd = open_regular_file(os.path.join(location, STATE_FILE_NAME), os.O_RDONLY)
        with open(fd, encoding="utf-8") as file:
            return json_format.Parse(file.read(), state_pb2.RolloutTrace())

    def read_head(self, location: str) -> state_pb2.RolloutTrace:
        fd = open_regular_file(os.path.join(location, STATE_FILE_NAME), os.O_RDONLY)
        with open(fd, "rb") as file:
            return read_head_from(file)

    def read_rewards(self, location: str) -> RewardFile:
        return read_rewards(Path(location))

    def fork_resolver(self, location: str) -> ForkResolver:
        # The resolver `trace-reducer reduce` uses: parents beside the bundle.
        return BundleForkResolver(Path(location))


class FsspecStore:
    """Bundles behind an fsspec URL (s3://, memory://, ...).

    state.json is written with one put: object stores make an object visible whole or not at
    all, which is the atomicity a reader needs.
    """

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.root = url
        self.fs, self.path, self.timeout = url_filesystem(url, options)
        self.path = self.path.rstrip("/")
        self.process_local = "memory" in _protocols(self.fs)

    def timed_out(self, error: BaseException) -> bool:
        """Whether error is (or was raised from) a request of an http(s) root timing out:
        fsspec's HTTP file system says FileNotFoundError for whatever stopped a file's
        `info`, an aiohttp timeout among it."""
        seen: BaseException | None = error
        while seen is not None and self.timeout is not None:
            if isinstance(seen, TimeoutError) and seen.errno is None:
                return True
            seen = seen.__cause__ or seen.__context__
        return False

    def silence(self) -> str:
        """What a request that timed out is said as."""
        return (
            f"no answer within {self.timeout:g} s "
            f"(--storage-option {HTTP_TIMEOUT_OPTION}=SECONDS to wait longer)"
        )

    def discover(self, warn: Callable[[str], None]) -> list[BundleEntry]:
        try:
            found: dict[str, dict[str, Any]] = self.fs.find(self.path, withdirs=False, detail=True)
            if not found:
                # fsspec's walk passes over what it cannot read, so a host nothing answers (or
                # a name that does not resolve) finds nothing, as an empty root does: the root
                # itself asked for says which it is. Nothing there at all is an empty root, as
                # on S3.
                with contextlib.suppress(FileNotFoundError):
                    self.fs.ls(self.path, detail=False)
        except OSError as error:
            if not self.timed_out(error):
                raise
            raise StoreTimeoutError(f"cannot list {self.root}: {self.silence()}") from error
        states: dict[str, float | None] = {}
        traces: dict[str, float | None] = {}
        rewards: dict[str, float | None] = {}
        for name, info in found.items():
            directory, base = posixpath.split(name.rstrip("/"))
            if base == TRACE_FILE_NAME:
                traces[directory] = _info_mtime(info)
            elif base == STATE_FILE_NAME:
                states[directory] = _info_mtime(info)
            elif base == REWARDS_FILE_NAME:
                rewards[directory] = _info_mtime(info)
        # In the order the local walk hands them out: depth first, by name.
        return [
            BundleEntry(directory, mtime, states.get(directory), rewards.get(directory))
            for directory, mtime in sorted(traces.items(), key=lambda kv: kv[0].split("/"))
        ]

    def display(self, location: str) -> str:
        return str(self.fs.unstrip_protocol(location))

    def open_trace(self, location: str) -> BinaryIO:
        opened: BinaryIO = self.fs.open(f"{location}/{TRACE_FILE_NAME}", "rb")
        return opened

    def trace_mtime(self, location: str) -> float | None:
        path = f"{location}/{TRACE_FILE_NAME}"
        self.fs.invalidate_cache(path)
        try:
            return _info_mtime(self.fs.info(path))
        except FileNotFoundError:
            return None

    def writer_holds(self, location: str) -> bool | None:
        # No lock reaches a writer through object storage: the file's age decides.
        return None

    def write_state(self, location: str, trace: state_pb2.RolloutTrace) -> None:
        target = f"{location}/{STATE_FILE_NAME}"
        data = state_to_json(trace).encode("utf-8")
        try:
            self.fs.pipe_file(target, data)
        except OSError:
            raise
        except Exception as error:
            # The store refused it (an HTTP server that takes no PUT, a bucket read-only to
            # these credentials): the store's answer, not an internal error of ours.
            raise BundleError(
                f"cannot write {self.display(target)}: {type(error).__name__}: {error}"
            ) from error

    def read_state(self, location: str) -> state_pb2.RolloutTrace:
        data = self.fs.cat_file(f"{location}/{STATE_FILE_NAME}")
        return json_format.Parse(data.decode("utf-8"), state_pb2.RolloutTrace())

    def read_head(self, location: str) -> state_pb2.RolloutTrace:
        with self.fs.open(f"{location}/{STATE_FILE_NAME}", "rb") as file:
            return read_head_from(file)

    def read_rewards(self, location: str) -> RewardFile:
        try:
            data: bytes = self.fs.cat_file(f"{location}/{REWARDS_FILE_NAME}")
        except FileNotFoundError:
            return RewardFile([], "")
        return decode_rewards(data)

    def fork_resolver(self, location: str) -> ForkResolver:
        return _StoreForkResolver(self, location)


class _StoreForkResolver(BundleForkResolver):
    """Parents beside a bundle in an fsspec store: the sibling the fork names."""

    def __init__(self, store: FsspecStore, location: str) -> None:
        super().__init__(None)
        self._store = store
        self._directory = posixpath.dirname(location)

    def _locate(self, forked: record_pb2.ThreadForked) -> Path | None:
        if not is_bundle_name(forked.parent_bundle):
            return None
        sibling = posixpath.join(self._directory, forked.parent_bundle)
        if not self._store.fs.exists(f"{sibling}/{TRACE_FILE_NAME}"):
            return None
        return Path(sibling)

    def _open(self, path: Path) -> BundleReader:
        location = path.as_posix()
        return BundleReader(Path(location, TRACE_FILE_NAME), self._store.open_trace(location))


@functools.lru_cache(maxsize=8)
def open_store(
    root: str, options: StorageOptions = (), *, bundle_root_refused: bool = True
) -> Store:
    """The store for root; cached so a worker process opens each once, not once per bundle."""
    if root.startswith("file://"):
        return LocalStore(root.removeprefix("file://"), bundle_root_refused=bundle_root_refused)
    if is_url(root):
        return FsspecStore(root, options)
    return LocalStore(root, bundle_root_refused=bundle_root_refused)


# state_to_json writes the top-level keys sorted, two spaces in, and a raw newline is never
# inside a JSON string: this is the top-level key, and the first "\n  }" after it closes it.
_INTEGRITY_KEY = b'\n  "integrity": {'
_INTEGRITY_END = b"\n  }"
# Its trace id, a top-level string on a line of its own after the integrity: `"trace_id": "…",`.
_TRACE_ID_KEY = b'\n  "trace_id": '
_COUNTS = frozenset(
    field.name
    for field in state_pb2.Integrity.DESCRIPTOR.fields
    if field.cpp_type == field.CPPTYPE_UINT64
)


# Read this much of a state.json at a time looking for its integrity; the integrity object
# itself is never this large. A state.json laid out otherwise is parsed whole only up to
# _WHOLE_PARSE_BYTES: past it, it is rebuilt from its bundle (a reduce, whose memory does not
# grow with the bundle) rather than read into memory whole.
_CHUNK_BYTES = 1 << 20
_WHOLE_PARSE_BYTES = 64 << 20


def integrity_from_state_json(data: bytes) -> state_pb2.Integrity:
    """read_head_from a state.json's bytes, its integrity."""
    return read_head_from(io.BytesIO(data)).integrity


def read_head_from(file: BinaryIO) -> state_pb2.RolloutTrace:
    """A state.json's integrity and trace id (all reduce-all needs of an up-to-date bundle's)
    without parsing the rest of it (the bulk: every item, call and turn) nor holding it in
    memory: read a chunk at a time up to its trace id. One not laid out as state_to_json
    writes it is parsed whole, up to _WHOLE_PARSE_BYTES. Raises (ValueError, protobuf's
    ParseError, ...) when it holds no integrity that can be read."""
    value: Any = None
    trace_id: Any = None
    found = _integrity_object(file)
    if found is not None:
        try:
            value = json.loads(found[0])
            trace_id = _trace_id_after(file, found[1])
        except ValueError:
            value = None
    if not isinstance(value, dict) or not isinstance(trace_id, str):
        file.seek(0)
        whole = file.read(_WHOLE_PARSE_BYTES + 1)
        if len(whole) > _WHOLE_PARSE_BYTES:
            raise ValueError("a state.json not laid out as reduce writes it, too large to parse")
        parsed = json.loads(whole)
        value, trace_id = parsed["integrity"], parsed.get("trace_id", "")
        if not isinstance(trace_id, str):
            raise ValueError("a state.json whose trace_id is not a string")
    return state_pb2.RolloutTrace(trace_id=trace_id, integrity=_integrity_of(value))


def _integrity_of(value: Any) -> state_pb2.Integrity:
    try:
        # What ParseDict makes of state_to_json's integrity (its counts as strings, its status
        # by name), at a tenth of its cost: ParseDict was most of reading an integrity.
        fields: dict[str, Any] = {
            key: int(item) if key in _COUNTS else item for key, item in value.items()
        }
        return state_pb2.Integrity(**fields)
    except (TypeError, ValueError):  # a field unknown, or of the wrong type: ParseDict says
        return json_format.ParseDict(value, state_pb2.Integrity())


def _integrity_object(file: BinaryIO) -> tuple[bytes, bytes] | None:
    """The bytes of the top-level integrity object (`{` to its `}`), read a chunk at a time,
    and those read after it; None when there is none where state_to_json puts it."""
    overlap = len(_INTEGRITY_KEY) - 1
    carried = b""
    while True:
        chunk = file.read(_CHUNK_BYTES)
        if not chunk:
            return None
        window = carried + chunk
        at = window.find(_INTEGRITY_KEY)
        if at >= 0:
            found = window[at + overlap :]
            break
        carried = window[-overlap:]
    while True:
        end = found.find(_INTEGRITY_END)
        if end >= 0:
            end += len(_INTEGRITY_END)
            return found[:end], found[end:]
        chunk = file.read(_CHUNK_BYTES)
        if not chunk or len(found) > _CHUNK_BYTES:
            return None
        found += chunk


def _trace_id_after(file: BinaryIO, read: bytes) -> str | None:
    """The top-level trace_id's value, looked for from the integrity on (`read` the bytes
    already read past it): "" when the state has none (an empty
    id is not written), None when it is not where state_to_json puts it."""
    overlap = len(_TRACE_ID_KEY) - 1
    window = read
    while True:
        at = window.find(_TRACE_ID_KEY)
        if at >= 0:
            line = window[at + len(_TRACE_ID_KEY) :]
            while b"\n" not in line:
                chunk = file.read(_CHUNK_BYTES)
                if not chunk or len(line) > _CHUNK_BYTES:
                    return None
                line += chunk
            value = json.loads(line[: line.index(b"\n")].rstrip(b","))
            return value if isinstance(value, str) else None
        chunk = file.read(_CHUNK_BYTES)
        if not chunk:
            return ""
        window = window[-overlap:] + chunk


_CLEAN_OR_UNCLOSED = frozenset(
    {state_pb2.INTEGRITY_STATUS_CLEAN, state_pb2.INTEGRITY_STATUS_UNCLOSED}
)
_CUT_SHORT = frozenset({state_pb2.INTEGRITY_STATUS_TRUNCATED, state_pb2.INTEGRITY_STATUS_CORRUPT})
_HEADER_READ_BYTES = 4096


def state_mismatch(store: Store, location: str, state: state_pb2.RolloutTrace) -> str | None:
    """Why a state.json newer than its trace.binpb is still not that bundle's reduction, None
    when it is: it must name the trace id of the bundle's header, and its integrity must
    account for the file as it is (every byte read when CLEAN or UNCLOSED, fewer when
    TRUNCATED or CORRUPT). Its time alone says nothing of a state.json copied from another
    bundle, a stub written by hand, or a trace.binpb put back with an older time."""
    with store.open_trace(location) as file:
        records: list[record_pb2.TraceRecord] = []
        decoder = FrameDecoder()
        while not records and not decoder.stopped:
            chunk = file.read(_HEADER_READ_BYTES)
            if not chunk:
                break
            records = decoder.feed(chunk)
        size = file.seek(0, os.SEEK_END)
    header = records[0].header if records and records[0].HasField("header") else None
    if not state.trace_id:
        return "names no trace"
    if header is None or header.trace_id != state.trace_id:
        return "is another bundle's (its trace id differs)"
    integrity = state.integrity
    read_all = integrity.bytes_read == size
    if (integrity.status in _CLEAN_OR_UNCLOSED and read_all) or (
        integrity.status in _CUT_SHORT and integrity.bytes_read < size
    ):
        return None
    return "does not account for trace.binpb as it is"


def still_written(store: Store, location: str, window: float) -> bool:
    """Whether an unfinished bundle is being written: bundle.being_written's rule."""
    return being_written(
        store.writer_holds(location), store.trace_mtime(location), time.time(), window
    )


def parse_storage_options(pairs: list[str]) -> StorageOptions:
    """KEY=VALUE flags as fsspec keyword arguments (strings; fsspec coerces what it needs)."""
    options = []
    for n, pair in enumerate(pairs, 1):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Not echoed: a value typed without its key (a secret key, say) would be shown.
            problem = "no '='" if not sep else "no KEY before '='"
            raise ValueError(f"--storage-option expects KEY=VALUE; option {n} has {problem}")
        options.append((key, value))
    return tuple(options)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _stat_mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _info_mtime(info: dict[str, Any]) -> float | None:
    # Each fsspec implementation names its modification time differently.
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
