"""Parquet tables of many reduced bundles: one row per entity, partitioned by day."""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

Row = dict[str, Any]
# Rows as they travel from a worker to the driver: values in schema order (no repeated keys
# to pickle), by table.
Packed = dict[str, list[tuple[Any, ...]]]

# A file per (table, day) holds at most this many rows; the driver flushes then.
ROWS_PER_FILE = 50_000
# Buffered rows across all tables before everything is flushed, to bound the driver's memory.
MAX_BUFFERED_ROWS = 200_000

_TS = pa.timestamp("us", tz="UTC")
_IDS = pa.list_(pa.string())
_STR = pa.string()
_I64 = pa.int64()
_BOOL = pa.bool_()

Columns = list[tuple[str, pa.DataType]]

_KEY: Columns = [("bundle_path", _STR), ("trace_id", _STR), ("integrity", _STR)]
_WINDOW: Columns = [("status", _STR), ("started_at", _TS), ("ended_at", _TS)]
_ERROR: Columns = [("error_code", _STR), ("error_message", _STR), ("error_http_status", _I64)]
_TOKENS: Columns = [("input_tokens", _I64), ("output_tokens", _I64), ("total_tokens", _I64)]


def _schema(columns: Iterable[tuple[str, pa.DataType]]) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in columns])


SCHEMAS: dict[str, pa.Schema] = {
    "bundles": _schema(
        [
            *_KEY,
            ("root_thread_id", _STR),
            ("recording_complete", _BOOL),
            ("records_read", _I64),
            ("bytes_read", _I64),
            ("integrity_detail", _STR),
            ("bad_frame_offset", _I64),
            ("bad_frame_seq", _I64),
            ("unknown_records", _I64),
            ("producer_name", _STR),
            ("producer_version", _STR),
            ("started_at", _TS),
            ("ended_at", _TS),
            ("thread_count", _I64),
            ("turn_count", _I64),
            ("inference_call_count", _I64),
            ("conversation_item_count", _I64),
            ("tool_call_count", _I64),
            ("error", _STR),
        ]
    ),
    "threads": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("model", _STR),
            *_WINDOW,
            ("turn_count", _I64),
            ("conversation_item_count", _I64),
            *_TOKENS,
            ("metadata", pa.map_(_STR, _STR)),
            ("instructions_payload_id", _STR),
        ]
    ),
    "turns": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("turn_id", _STR),
            ("turn_index", _I64),
            *_WINDOW,
            *_ERROR,
            ("interrupted", _BOOL),
            ("interrupt_requested_by", _STR),
            ("interrupt_requested_at", _TS),
            ("inference_call_count", _I64),
            *_TOKENS,
            ("input_item_ids", _IDS),
            ("inference_call_ids", _IDS),
            ("tool_call_ids", _IDS),
        ]
    ),
    "inference_calls": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("turn_id", _STR),
            ("inference_call_id", _STR),
            ("attempt", _I64),
            *_WINDOW,
            ("model", _STR),
            ("provider_base_url", _STR),
            ("response_id", _STR),
            ("end_reason", _STR),
            *_ERROR,
            *_TOKENS,
            ("cached_input_tokens", _I64),
            ("reasoning_tokens", _I64),
            ("request_item_count", _I64),
            ("response_item_count", _I64),
            ("discarded_output_count", _I64),
            ("request_item_ids", _IDS),
            ("response_item_ids", _IDS),
        ]
    ),
    "conversation_items": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("turn_id", _STR),
            ("item_id", _STR),
            ("position", _I64),
            ("role", _STR),
            ("kind", _STR),
            ("text", _STR),
            ("content_types", _IDS),
            ("call_id", _STR),
            ("name", _STR),
            ("arguments", _STR),
            ("output", _STR),
            ("responses_item_id", _STR),
            ("producer_kind", _STR),
            ("producer_id", _STR),
            (
                "produced_by",
                pa.list_(pa.struct([pa.field("kind", _STR), pa.field("id", _STR)])),
            ),
            ("first_seen_at", _TS),
            ("first_seen_seq", _I64),
            ("payload_id", _STR),
        ]
    ),
    "tool_calls": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("turn_id", _STR),
            ("tool_call_id", _STR),
            ("call_id", _STR),
            ("name", _STR),
            ("requested_by_inference_call_id", _STR),
            ("call_item_id", _STR),
            ("output_item_id", _STR),
            *_WINDOW,
            ("is_error", _BOOL),
            ("submitted_by", _STR),
            ("arguments", _STR),
            ("output", _STR),
            ("arguments_payload_id", _STR),
            ("output_payload_id", _STR),
        ]
    ),
    "discarded_outputs": _schema(
        [
            *_KEY,
            ("thread_id", _STR),
            ("turn_id", _STR),
            ("inference_call_id", _STR),
            ("position", _I64),
            ("provider_item_id", _STR),
            ("item_type", _STR),
            ("partial_text", _STR),
            ("call_status", _STR),
        ]
    ),
}

TABLES = tuple(SCHEMAS)


# -- rows -------------------------------------------------------------------------------------


def _enum_names(values: Iterable[tuple[str, int]], prefix: str) -> dict[int, str]:
    return {number: name.removeprefix(prefix) for name, number in values}


_EXECUTION = _enum_names(common_pb2.ExecutionStatus.items(), "EXECUTION_STATUS_")
_INTEGRITY = _enum_names(state_pb2.IntegrityStatus.items(), "INTEGRITY_STATUS_")
_ROLE = _enum_names(state_pb2.ConversationRole.items(), "CONVERSATION_ROLE_")
_KIND = _enum_names(state_pb2.ItemKind.items(), "ITEM_KIND_")


def _micros(stamp: timestamp_pb2.Timestamp) -> int:
    return stamp.seconds * 1_000_000 + stamp.nanos // 1000


def _time(message: Any, field: str) -> int | None:
    return _micros(getattr(message, field)) if message.HasField(field) else None


def _window(execution: state_pb2.Execution) -> Row:
    return {
        "status": _EXECUTION.get(execution.status, str(execution.status)),
        "started_at": _time(execution, "started_at"),
        "ended_at": _time(execution, "ended_at"),
    }


def _error(holder: Any) -> Row:
    if not holder.HasField("error"):
        return {"error_code": None, "error_message": None, "error_http_status": None}
    error = holder.error
    return {
        "error_code": error.code or None,
        "error_message": error.message or None,
        "error_http_status": error.http_status or None,
    }


def _tokens(usages: list[common_pb2.TokenUsage]) -> Row:
    if not usages:
        return {"input_tokens": None, "output_tokens": None, "total_tokens": None}
    return {
        "input_tokens": sum(u.input_tokens for u in usages),
        "output_tokens": sum(u.output_tokens for u in usages),
        "total_tokens": sum(u.total_tokens for u in usages),
    }


def bundle_day(trace: state_pb2.RolloutTrace | None, fallback: float | None) -> str:
    """The partition of a bundle: the UTC day it started (or its file's day if unknown)."""
    if trace is not None and trace.HasField("started_at"):
        seconds = float(trace.started_at.seconds)
    else:
        seconds = fallback or 0.0
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d")


def bundle_row(
    bundle_path: str, trace: state_pb2.RolloutTrace | None, error: str | None = None
) -> Row:
    """The row of the bundles table; trace is None when the bundle could not be read."""
    if trace is None:
        row: Row = dict.fromkeys(SCHEMAS["bundles"].names)
        row.update(bundle_path=bundle_path, error=error)
        return row
    integrity = trace.integrity
    damaged = integrity.status in (
        state_pb2.INTEGRITY_STATUS_CORRUPT,
        state_pb2.INTEGRITY_STATUS_TRUNCATED,
    )
    return {
        "bundle_path": bundle_path,
        "trace_id": trace.trace_id or None,
        "integrity": _INTEGRITY.get(integrity.status, str(integrity.status)),
        "root_thread_id": trace.root_thread_id or None,
        "recording_complete": trace.recording_complete,
        "records_read": integrity.records_read,
        "bytes_read": integrity.bytes_read,
        "integrity_detail": integrity.detail or None,
        "bad_frame_offset": integrity.bad_frame_offset if damaged else None,
        "bad_frame_seq": integrity.bad_frame_seq if damaged else None,
        "unknown_records": integrity.unknown_records,
        "producer_name": trace.producer_name or None,
        "producer_version": trace.producer_version or None,
        "started_at": _time(trace, "started_at"),
        "ended_at": _time(trace, "ended_at"),
        "thread_count": len(trace.threads),
        "turn_count": len(trace.turns),
        "inference_call_count": len(trace.inference_calls),
        "conversation_item_count": len(trace.conversation_items),
        "tool_call_count": len(trace.tool_calls),
        "error": error,
    }


def bundle_rows(
    bundle_path: str,
    trace: state_pb2.RolloutTrace | None,
    *,
    entities: bool,
    error: str | None = None,
) -> Packed:
    """Every row one bundle contributes: its bundles row, and (entities) one per entity."""
    rows = {"bundles": [bundle_row(bundle_path, trace, error)]}
    if entities and trace is not None:
        rows.update(entity_rows(bundle_path, trace))
    packed: Packed = {}
    for table, table_rows in rows.items():
        names = SCHEMAS[table].names
        for row in table_rows:
            # A row must hold exactly its table's columns: a drift fails here, not silently.
            if len(row) != len(names):
                raise ValueError(f"{table} row has columns {sorted(row)}, expected {names}")
        packed[table] = [tuple(row[name] for name in names) for row in table_rows]
    return packed


def entity_rows(bundle_path: str, trace: state_pb2.RolloutTrace) -> dict[str, list[Row]]:
    """Rows of every entity table for one reduced bundle, in a canonical order (maps have none:
    a state parsed from state.json must give the same rows as one fresh from the reducer)."""
    key = {
        "bundle_path": bundle_path,
        "trace_id": trace.trace_id or None,
        "integrity": _INTEGRITY.get(trace.integrity.status, str(trace.integrity.status)),
    }
    rows: dict[str, list[Row]] = {name: [] for name in TABLES if name != "bundles"}
    calls = trace.inference_calls

    def usages(call_ids: Iterable[str]) -> list[common_pb2.TokenUsage]:
        return [calls[c].usage for c in call_ids if c in calls and calls[c].HasField("usage")]

    threads = sorted(trace.threads.values(), key=lambda t: (t.execution.started_seq, t.thread_id))
    turn_index: dict[str, int] = {}
    item_position: dict[str, int] = {}
    for thread in threads:
        turn_index.update((turn_id, i) for i, turn_id in enumerate(thread.turn_ids))
        item_position.update((item, i) for i, item in enumerate(thread.conversation_item_ids))
        thread_calls = [
            c.inference_call_id for c in calls.values() if c.thread_id == thread.thread_id
        ]
        rows["threads"].append(
            {
                **key,
                "thread_id": thread.thread_id,
                "model": thread.model or None,
                **_window(thread.execution),
                "turn_count": len(thread.turn_ids),
                "conversation_item_count": len(thread.conversation_item_ids),
                **_tokens(usages(thread_calls)),
                "metadata": sorted(thread.metadata.items()),
                "instructions_payload_id": thread.instructions_payload_id or None,
            }
        )

    turns = sorted(trace.turns.values(), key=lambda t: (t.execution.started_seq, t.turn_id))
    turn_status: dict[str, str] = {}
    for turn in turns:
        window = _window(turn.execution)
        turn_status[turn.turn_id] = window["status"]
        interrupted = turn.HasField("interrupt")
        rows["turns"].append(
            {
                **key,
                "thread_id": turn.thread_id,
                "turn_id": turn.turn_id,
                "turn_index": turn_index.get(turn.turn_id),
                **window,
                **_error(turn),
                "interrupted": interrupted,
                "interrupt_requested_by": turn.interrupt.requested_by or None
                if interrupted
                else None,
                "interrupt_requested_at": _time(turn.interrupt, "requested_at")
                if interrupted
                else None,
                "inference_call_count": len(turn.inference_call_ids),
                **_tokens(usages(turn.inference_call_ids)),
                "input_item_ids": list(turn.input_item_ids),
                "inference_call_ids": list(turn.inference_call_ids),
                "tool_call_ids": list(turn.tool_call_ids),
            }
        )

    for call in sorted(
        calls.values(), key=lambda c: (c.execution.started_seq, c.inference_call_id)
    ):
        window = _window(call.execution)
        has_usage = call.HasField("usage")
        usage = call.usage
        rows["inference_calls"].append(
            {
                **key,
                "thread_id": call.thread_id,
                "turn_id": call.turn_id,
                "inference_call_id": call.inference_call_id,
                "attempt": call.attempt,
                **window,
                "model": call.model or None,
                "provider_base_url": call.provider_base_url or None,
                "response_id": call.response_id or None,
                "end_reason": call.end_reason or None,
                **_error(call),
                **_tokens([usage] if has_usage else []),
                "cached_input_tokens": usage.cached_input_tokens if has_usage else None,
                "reasoning_tokens": usage.reasoning_tokens if has_usage else None,
                "request_item_count": len(call.request_item_ids),
                "response_item_count": len(call.response_item_ids),
                "discarded_output_count": len(call.discarded_outputs),
                "request_item_ids": list(call.request_item_ids),
                "response_item_ids": list(call.response_item_ids),
            }
        )
        for position, discarded in enumerate(call.discarded_outputs):
            rows["discarded_outputs"].append(
                {
                    **key,
                    "thread_id": call.thread_id,
                    "turn_id": call.turn_id,
                    "inference_call_id": call.inference_call_id,
                    "position": position,
                    "provider_item_id": discarded.provider_item_id or None,
                    "item_type": discarded.item_type or None,
                    "partial_text": discarded.partial_text,
                    "call_status": window["status"],
                }
            )

    items = trace.conversation_items
    for item in sorted(items.values(), key=lambda i: (i.first_seen_seq, i.item_id)):
        producers = [_producer(ref) for ref in item.produced_by]
        first = producers[0] if producers else {"kind": None, "id": None}
        rows["conversation_items"].append(
            {
                **key,
                "thread_id": item.thread_id,
                "turn_id": item.turn_id or None,
                "item_id": item.item_id,
                "position": item_position.get(item.item_id),
                "role": _ROLE.get(item.role, str(item.role)),
                "kind": _KIND.get(item.kind, str(item.kind)),
                "text": "".join(part.text for part in item.content),
                "content_types": [part.type for part in item.content],
                "call_id": item.call_id or None,
                "name": item.name or None,
                "arguments": item.arguments or None,
                "output": item.output or None,
                "responses_item_id": item.responses_item_id or None,
                "producer_kind": first["kind"],
                "producer_id": first["id"],
                "produced_by": producers,
                "first_seen_at": _time(item, "first_seen_at"),
                "first_seen_seq": item.first_seen_seq,
                "payload_id": item.payload_id or None,
            }
        )

    for tool in sorted(
        trace.tool_calls.values(), key=lambda t: (t.execution.started_seq, t.tool_call_id)
    ):
        call_item = items.get(tool.call_item_id) if tool.call_item_id else None
        output_item = items.get(tool.output_item_id) if tool.output_item_id else None
        rows["tool_calls"].append(
            {
                **key,
                "thread_id": tool.thread_id,
                "turn_id": tool.turn_id or None,
                "tool_call_id": tool.tool_call_id,
                "call_id": tool.call_id or None,
                "name": tool.name or None,
                "requested_by_inference_call_id": tool.requested_by_inference_call_id or None,
                "call_item_id": tool.call_item_id or None,
                "output_item_id": tool.output_item_id or None,
                **_window(tool.execution),
                "is_error": tool.is_error,
                "submitted_by": tool.submitted_by or None,
                "arguments": call_item.arguments if call_item is not None else None,
                "output": output_item.output if output_item is not None else None,
                "arguments_payload_id": tool.arguments_payload_id or None,
                "output_payload_id": tool.output_payload_id or None,
            }
        )
    return rows


def _producer(ref: state_pb2.ProducerRef) -> dict[str, str | None]:
    kind = ref.WhichOneof("producer")
    if kind == "inference":
        return {"kind": kind, "id": ref.inference.inference_call_id}
    if kind == "user_input":
        return {"kind": kind, "id": ref.user_input.turn_id}
    if kind == "tool":
        return {"kind": kind, "id": ref.tool.tool_call_id}
    return {"kind": None, "id": None}


# -- writing ----------------------------------------------------------------------------------


class TableSink:
    """Buffers rows per (table, day) and writes them as Parquet files under a staging
    directory; commit() swaps the staged tables in for the old ones, abort() drops them.

    Files are named by their order (part-00000, ...), so the same rows added in the same
    order give byte-identical files, whichever engine reduced the bundles.
    """

    def __init__(self, target: str, storage_options: dict[str, str] | None = None) -> None:
        self.target = target
        self.fs, self.base = fsspec.core.url_to_fs(target, **(storage_options or {}))
        self.base = self.base.rstrip("/")
        self.staging = posixpath.join(self.base, f".staging-{uuid.uuid4().hex}")
        self._buffers: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        self._parts: dict[tuple[str, str], int] = {}
        self._buffered = 0
        self.rows_written: dict[str, int] = dict.fromkeys(TABLES, 0)
        self._days: set[str] = set()

    def add(self, day: str, rows: Packed) -> None:
        self._days.add(day)
        for table, table_rows in rows.items():
            if not table_rows:
                continue
            buffer = self._buffers.setdefault((table, day), [])
            buffer.extend(table_rows)
            self._buffered += len(table_rows)
            if len(buffer) >= ROWS_PER_FILE:
                self._flush(table, day)
        if self._buffered >= MAX_BUFFERED_ROWS:
            for table, buffered_day in sorted(self._buffers):
                self._flush(table, buffered_day)

    def _flush(self, table: str, day: str) -> None:
        rows = self._buffers.pop((table, day), [])
        self._buffered -= len(rows)
        self._write(table, day, rows)

    def _write(self, table: str, day: str, rows: list[tuple[Any, ...]]) -> None:
        part = self._parts.get((table, day), 0)
        self._parts[(table, day)] = part + 1
        directory = posixpath.join(self.staging, table, f"day={day}")
        self.fs.makedirs(directory, exist_ok=True)
        schema = SCHEMAS[table]
        columns = list(zip(*rows, strict=True)) if rows else [() for _ in schema.names]
        arrow = pa.Table.from_arrays(
            [
                pa.array(column, type=field.type)
                for column, field in zip(columns, schema, strict=True)
            ],
            schema=schema,
        )
        with self.fs.open(posixpath.join(directory, f"part-{part:05d}.parquet"), "wb") as file:
            pq.write_table(arrow, file, compression="zstd")
        self.rows_written[table] += len(rows)

    def commit(self) -> dict[str, int]:
        """Write what is buffered, then replace the tables under target by the staged ones."""
        for table, day in sorted(self._buffers):
            self._flush(table, day)
        if self._days:
            # An empty table still gets a file, so that readers find its schema.
            first_day = min(self._days)
            for table in TABLES:
                if not self.rows_written[table]:
                    self._write(table, first_day, [])
        for table in TABLES:
            final = posixpath.join(self.base, table)
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            staged = posixpath.join(self.staging, table)
            # File by file: object stores have no directories to rename.
            for name in sorted(self.fs.find(staged)):
                target = posixpath.join(final, posixpath.relpath(name, staged))
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self.fs.mv(name, target)
        self._remove_staging()
        return dict(self.rows_written)

    def abort(self) -> None:
        self._buffers.clear()
        self._remove_staging()

    def _remove_staging(self) -> None:
        if self.fs.exists(self.staging):
            self.fs.rm(self.staging, recursive=True)
