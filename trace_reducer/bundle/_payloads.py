"""Payloads: their one JSON encoding, their content address, and reassembly of chunks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from itertools import chain, repeat
from typing import Any

import orjson

from rollout.trace.v1 import record_pb2

from ._errors import PayloadError

try:
    from . import _canonical
except ImportError:  # built where a C compiler is (setup.py); the reference below otherwise
    _canonical = None  # type: ignore[assignment]


def canonical_json(obj: Any) -> bytes:
    """Compact JSON with sorted keys: how JSON payloads and request bodies are encoded.

    Decoding a payload and encoding it again gives the same bytes, so a request body rebuilt
    from its payloads is byte-identical to the one sent. The bytes are json's
    (canonical_json_reference); _canonical.c writes them for the values payloads are made of,
    several times faster, and leaves every other value to json.
    """
    if _canonical is not None:
        encoded = _canonical.encode(obj)
        if encoded is not None:
            return encoded
    return canonical_json_reference(obj)


def canonical_json_reference(obj: Any) -> bytes:
    """canonical_json by json alone: the definition of its bytes."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def canonical_json_with_list(obj: Mapping[str, Any], key: str, encoded: Iterable[bytes]) -> bytes:
    """canonical_json({**obj, key: items}) for the items whose canonical_json, in order, is
    `encoded`: the list is joined from those bytes, not encoded again (a request re-sends a
    conversation whose items are already encoded). obj's keys are str and key is not one."""
    parts: list[bytes] = []
    for name in sorted([*obj, key]):
        parts += (b"," if parts else b"{", canonical_json(name), b":")
        if name == key:
            # The list is most of the bytes, so they are copied once, by the one join below:
            # each item behind a comma (interleaved in C), the first comma made the bracket.
            start = len(parts)
            parts += chain.from_iterable(zip(repeat(b","), encoded))
            if len(parts) > start:
                parts[start] = b"["
                parts.append(b"]")
            else:
                parts.append(b"[]")
        else:
            parts.append(canonical_json(obj[name]))
    parts.append(b"}")
    return b"".join(parts)


def payload_id(data: bytes) -> str:
    """Content address of a payload: lowercase hex BLAKE2b-128 of its bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# Payload bytes nobody has parsed yet are kept up to this much; the oldest go first. A real
# bundle holds little that is never parsed (its request envelopes and instructions), so only a
# crafted one reaches it, and what it claims then costs at most this.
UNPARSED_PAYLOAD_BUDGET = 16 * 1024 * 1024


class _Partial:
    """The chunks of one payload read so far; nothing is sized by what a record claims."""

    __slots__ = ("count", "parts", "size")

    def __init__(self, count: int) -> None:
        self.count = count
        self.parts: dict[int, bytes] = {}
        self.size = 0


class PayloadStore:
    """Payload bytes by id, a chunked payload becoming available once all its chunks are in.

    Bytes are kept until they are parsed (discard) or, past UNPARSED_PAYLOAD_BUDGET, until
    newer payloads push them out; a later reference to one pushed out finds it unknown.
    """

    __slots__ = ("_budget", "_held", "_size")

    def __init__(self, budget: int | None = UNPARSED_PAYLOAD_BUDGET) -> None:
        """budget: bytes kept before the oldest go; None keeps all (for those who need every
        payload of a bundle, such as a request body or a page that rebuilds them)."""
        self._budget = budget
        # Complete payloads (bytes) and payloads still being assembled (_Partial), oldest first.
        self._held: dict[str, bytes | _Partial] = {}
        self._size = 0

    def add(self, payload: record_pb2.Payload) -> None:
        """Take one payload record; a repeated whole payload is ignored (ids are content)."""
        pid = payload.payload_id
        if not pid:
            raise PayloadError("payload without an id")
        held = self._held.get(pid)
        if isinstance(held, bytes):
            return
        data = payload.data
        count = payload.chunk_count
        if count <= 1:
            if held is not None:
                # The whole payload makes chunks of it moot.
                self._forget(pid)
            self._hold(pid, data, len(data))
            return
        index = payload.chunk_index
        if held is None:
            held = _Partial(count)
            self._held[pid] = held
        if held.count != count or index >= count:
            raise PayloadError(f"payload {pid} chunk {index} of {count} does not fit the others")
        if index in held.parts:
            raise PayloadError(f"payload {pid} chunk {index} repeated")
        held.parts[index] = data
        held.size += len(data)
        self._size += len(data)
        if len(held.parts) == count:
            del self._held[pid]
            self._size -= held.size
            parts = held.parts
            self._hold(pid, b"".join(parts[i] for i in range(count)), held.size)
        else:
            self._evict(keep=pid)

    def _hold(self, pid: str, data: bytes, size: int) -> None:
        self._held[pid] = data
        self._size += size
        self._evict(keep=pid)

    def _evict(self, keep: str) -> None:
        held = self._held
        budget = self._budget
        while budget is not None and self._size > budget and len(held) > 1:
            oldest = next(iter(held))
            if oldest == keep:
                # The newest payload stays, however large: the next record needs it.
                held[oldest] = held.pop(oldest)
                continue
            self._forget(oldest)

    def _forget(self, pid: str) -> None:
        gone = self._held.pop(pid)
        self._size -= len(gone) if isinstance(gone, bytes) else gone.size

    def get(self, pid: str) -> bytes:
        """The bytes of a complete payload; PayloadError names why it is not available."""
        data = self._held.get(pid)
        if not isinstance(data, bytes):
            state = "incomplete" if data is not None else "unknown"
            raise PayloadError(f"{state} payload {pid}")
        return data

    def holds(self, pid: str) -> bool:
        """Whether the complete bytes of payload pid are here."""
        return isinstance(self._held.get(pid), bytes)

    def ids(self) -> frozenset[str]:
        """The ids of the complete payloads held."""
        return frozenset(pid for pid, data in self._held.items() if isinstance(data, bytes))

    def discard(self, pid: str) -> None:
        """Forget a payload whose bytes are no longer needed (its parsed form is kept)."""
        if pid in self._held:
            self._forget(pid)


def resolve_inputs(previous: list[str], body: record_pb2.InferenceStarted) -> list[str]:
    """The complete ordered input payload ids of an inference call.

    previous is the complete input of the thread's previous call.
    """
    prefix = body.input_prefix_count
    if prefix > len(previous):
        raise PayloadError(
            f"input_prefix_count {prefix} exceeds the {len(previous)} inputs of the previous call"
        )
    return [*previous[:prefix], *body.input_payload_ids]


# orjson reads an integer past 64 bits as a float where json keeps it exact: JSON with a run of
# this many digits anywhere is left to json (found by mapping every digit to 0 and anything else
# to a space: two passes in C, where a regular expression takes ten times).
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
LONG_NUMBER_DIGITS = 19
_LONG_NUMBER = b"0" * LONG_NUMBER_DIGITS


def payload_json(data: bytes | str) -> Any:
    """json.loads of a payload, for whatever reads one (the reducer, the page, the spans):
    JSON nested past what json reads is a ValueError too, as JSON that does not parse is; it
    was a RecursionError out of whatever showed the bundle (an `internal error`)."""
    try:
        return json.loads(data)
    except RecursionError as error:
        raise ValueError("JSON nested too deep to read") from error


def fast_json(data: bytes) -> tuple[bool, Any]:
    """(True, value) where orjson reads data to exactly what json.loads reads (several times
    cheaper); else (False, None), for the caller to read it with json as before. orjson refuses
    what json reads differently or not at all (invalid UTF-8, lone surrogates, NaN, infinities,
    nesting past 1,024), and a run of 19 digits never goes to it."""
    if _LONG_NUMBER in data.translate(_DIGITS_AS_ZEROS):
        return False, None
    try:
        return True, orjson.loads(data)
    except orjson.JSONDecodeError:
        return False, None
