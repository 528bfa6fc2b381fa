"""Payloads: their one JSON encoding, their content address, and reassembly of chunks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rollout.trace.v1 import record_pb2


class PayloadError(ValueError):
    """Payload records that do not fit together."""


def canonical_json(obj: Any) -> bytes:
    """Compact JSON with sorted keys: how JSON payloads and request bodies are encoded.

    Decoding a payload and encoding it again gives the same bytes, so a request body rebuilt
    from its payloads is byte-identical to the one sent.
    """
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def payload_id(data: bytes) -> str:
    """Content address of a payload: lowercase hex BLAKE2b-128 of its bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class PayloadStore:
    """Payload bytes by id, a chunked payload becoming available once all its chunks are in."""

    __slots__ = ("_chunks", "_complete")

    def __init__(self) -> None:
        self._complete: dict[str, bytes] = {}
        self._chunks: dict[str, list[bytes | None]] = {}

    def add(self, payload: record_pb2.Payload) -> None:
        """Take one payload record; a repeated whole payload is ignored (ids are content)."""
        pid = payload.payload_id
        if not pid:
            raise PayloadError("payload without an id")
        if pid in self._complete:
            return
        count = payload.chunk_count
        if count <= 1:
            self._complete[pid] = payload.data
            return
        chunks = self._chunks.get(pid)
        if chunks is None:
            chunks = self._chunks[pid] = [None] * count
        index = payload.chunk_index
        if len(chunks) != count or index >= count:
            raise PayloadError(f"payload {pid} chunk {index} of {count} does not fit the others")
        if chunks[index] is not None:
            raise PayloadError(f"payload {pid} chunk {index} repeated")
        chunks[index] = payload.data
        if all(chunk is not None for chunk in chunks):
            del self._chunks[pid]
            self._complete[pid] = b"".join(chunk or b"" for chunk in chunks)

    def get(self, pid: str) -> bytes:
        """The bytes of a complete payload; PayloadError names why it is not available."""
        data = self._complete.get(pid)
        if data is None:
            state = "incomplete" if pid in self._chunks else "unknown"
            raise PayloadError(f"{state} payload {pid}")
        return data

    def discard(self, pid: str) -> None:
        """Forget a payload whose bytes are no longer needed (its parsed form is kept)."""
        self._complete.pop(pid, None)


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
