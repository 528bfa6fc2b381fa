"""The rows reduce-all's tables get from one reduced bundle: columns, order, values."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._names import EXECUTION_WORDS, INTEGRITY_WORDS, enum_words, rollout_group
from ..bundle._rewards import mean_reward

Row = dict[str, Any]
# Rows as they travel from a worker to the driver: values in column order (no repeated keys
# to pickle), by table.
Packed = dict[str, list[tuple[Any, ...]]]
# (name, kind): kinds are string, int64, double, bool, timestamp (microseconds, UTC), strings (a
# list), map (string to string) and producers (a list of {kind, id}); _tables.py maps them to
# Arrow types. Workers build rows without importing pyarrow.
Column = tuple[str, str]

_KEY: tuple[Column, ...] = (
    ("bundle_path", "string"),
    ("trace_id", "string"),
    ("integrity", "string"),
)
_WINDOW: tuple[Column, ...] = (
    ("status", "string"),
    ("started_at", "timestamp"),
    ("ended_at", "timestamp"),
)
_ERROR: tuple[Column, ...] = (
    ("error_code", "string"),
    ("error_message", "string"),
    ("error_http_status", "int64"),
)
_TOKENS: tuple[Column, ...] = (
    ("input_tokens", "int64"),
    ("output_tokens", "int64"),
    ("total_tokens", "int64"),
)

COLUMNS: dict[str, tuple[Column, ...]] = {
    "bundles": (
        *_KEY,
        ("root_thread_id", "string"),
        ("recording_complete", "bool"),
        ("records_read", "int64"),
        ("bytes_read", "int64"),
        ("integrity_detail", "string"),
        ("bad_frame_offset", "int64"),
        ("bad_frame_seq", "int64"),
        ("unknown_records", "int64"),
        ("producer_name", "string"),
        ("producer_version", "string"),
        ("started_at", "timestamp"),
        ("ended_at", "timestamp"),
        ("thread_count", "int64"),
        ("turn_count", "int64"),
        ("inference_call_count", "int64"),
        ("conversation_item_count", "int64"),
        ("tool_call_count", "int64"),
        ("reward_count", "int64"),
        ("error", "string"),
    ),
    "threads": (
        *_KEY,
        ("thread_id", "string"),
        ("model", "string"),
        *_WINDOW,
        ("turn_count", "int64"),
        ("conversation_item_count", "int64"),
        *_TOKENS,
        ("metadata", "map"),
        ("instructions_payload_id", "string"),
        # What export-rl's sample of the thread says of its group and reward, so that a query
        # needs no join to rewards to group GRPO rollouts or score them.
        ("parent_thread_id", "string"),
        ("group_id", "string"),
        ("repetition_index", "int64"),
        ("reward", "double"),
    ),
    "turns": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("turn_index", "int64"),
        *_WINDOW,
        *_ERROR,
        ("interrupted", "bool"),
        ("interrupt_requested_by", "string"),
        ("interrupt_requested_at", "timestamp"),
        ("inference_call_count", "int64"),
        *_TOKENS,
        ("input_item_ids", "strings"),
        ("inference_call_ids", "strings"),
        ("tool_call_ids", "strings"),
    ),
    "inference_calls": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("inference_call_id", "string"),
        ("attempt", "int64"),
        *_WINDOW,
        ("model", "string"),
        ("provider_base_url", "string"),
        ("response_id", "string"),
        ("end_reason", "string"),
        *_ERROR,
        *_TOKENS,
        ("cached_input_tokens", "int64"),
        ("reasoning_tokens", "int64"),
        ("request_item_count", "int64"),
        ("response_item_count", "int64"),
        ("discarded_output_count", "int64"),
        ("request_item_ids", "strings"),
        ("response_item_ids", "strings"),
    ),
    "conversation_items": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("item_id", "string"),
        ("position", "int64"),
        ("role", "string"),
        ("kind", "string"),
        ("text", "string"),
        ("content_types", "strings"),
        ("call_id", "string"),
        ("name", "string"),
        ("arguments", "string"),
        ("output", "string"),
        ("responses_item_id", "string"),
        ("producer_kind", "string"),
        ("producer_id", "string"),
        ("produced_by", "producers"),
        ("first_seen_at", "timestamp"),
        ("first_seen_seq", "int64"),
        ("payload_id", "string"),
    ),
    "tool_calls": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("tool_call_id", "string"),
        ("call_id", "string"),
        ("name", "string"),
        ("requested_by_inference_call_id", "string"),
        ("call_item_id", "string"),
        ("output_item_id", "string"),
        *_WINDOW,
        ("is_error", "bool"),
        ("submitted_by", "string"),
        ("arguments", "string"),
        ("output", "string"),
        ("arguments_payload_id", "string"),
        ("output_payload_id", "string"),
    ),
    "discarded_outputs": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("inference_call_id", "string"),
        ("position", "int64"),
        ("provider_item_id", "string"),
        ("item_type", "string"),
        ("partial_text", "string"),
        ("call_status", "string"),
    ),
    "rewards": (
        *_KEY,
        ("thread_id", "string"),
        ("turn_id", "string"),
        ("item_id", "string"),
        ("conversation_item_id", "string"),
        ("target_found", "bool"),
        ("name", "string"),
        ("value", "double"),
        ("weight", "double"),
        ("source", "string"),
        ("metadata", "map"),
        ("recorded_at", "timestamp"),
        ("recorded_by", "string"),
        ("seq", "int64"),
    ),
}

TABLES = tuple(COLUMNS)
NAMES = {table: [name for name, _ in columns] for table, columns in COLUMNS.items()}
# The int64 columns of each table, by position: a count a bundle holds past what int64 can
# (its uint64 fields can, a crafted or broken writer's may) is null in its cell, so one bad
# value never costs the table, nor the batch.
_INT64_COLUMNS = {
    table: [index for index, (_, kind) in enumerate(columns) if kind == "int64"]
    for table, columns in COLUMNS.items()
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _fit(table: str, row: tuple[Any, ...]) -> tuple[Any, ...]:
    cells = None
    for index in _INT64_COLUMNS[table]:
        value = row[index]
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            cells = cells if cells is not None else list(row)
            cells[index] = None
    return row if cells is None else tuple(cells)


_EXECUTION = EXECUTION_WORDS
_INTEGRITY = INTEGRITY_WORDS
# The tables' columns hold the enum's own names (USER, FUNCTION_CALL): SQL compares them as the
# proto spells them.
_ROLE = enum_words(state_pb2.ConversationRole.items(), "CONVERSATION_ROLE_")
_KIND = enum_words(state_pb2.ItemKind.items(), "ITEM_KIND_")


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
    bundle_path: str,
    trace: state_pb2.RolloutTrace | None,
    error: str | None = None,
    *,
    entities: bool = True,
) -> Row:
    """The row of the bundles table; trace is None when the bundle could not be read.

    Each count is the rows the bundle has in that table: 0 for a bundle whose entities are
    not in the tables (CORRUPT and not salvaged), whatever its records held."""
    if trace is None:
        row: Row = dict.fromkeys(NAMES["bundles"])
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
        "thread_count": len(trace.threads) if entities else 0,
        "turn_count": len(trace.turns) if entities else 0,
        "inference_call_count": len(trace.inference_calls) if entities else 0,
        "conversation_item_count": len(trace.conversation_items) if entities else 0,
        "tool_call_count": len(trace.tool_calls) if entities else 0,
        "reward_count": len(trace.rewards) if entities else 0,
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
    rows = {"bundles": [bundle_row(bundle_path, trace, error, entities=entities)]}
    if entities and trace is not None:
        rows.update(entity_rows(bundle_path, trace))
    packed: Packed = {}
    for table, table_rows in rows.items():
        names = NAMES[table]
        for row in table_rows:
            # A row must hold exactly its table's columns: a drift fails here, not silently.
            if len(row) != len(names):
                raise ValueError(f"{table} row has columns {sorted(row)}, expected {names}")
        packed[table] = [_fit(table, tuple(row[name] for name in names)) for row in table_rows]
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
    # The bundle's own thread is export-rl's sample: its group, its parent when it is a fork,
    # and its reward (every reward of the bundle is its thread's); other threads have none.
    group_id, repetition_index = rollout_group(trace)
    sample = {
        "parent_thread_id": trace.fork.parent_thread_id or None,
        "group_id": group_id or None,
        "repetition_index": repetition_index,
        "reward": mean_reward(trace.rewards),
    }
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
                **(sample if thread.thread_id == trace.root_thread_id else dict.fromkeys(sample)),
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
    for reward in trace.rewards:
        target = reward.target
        rows["rewards"].append(
            {
                **key,
                "thread_id": target.thread_id or None,
                "turn_id": target.turn_id or None,
                "item_id": target.item_id or None,
                "conversation_item_id": target.conversation_item_id or None,
                "target_found": target.found,
                "name": reward.name,
                # As in export-rl's samples: a value no JSON or mean can hold (NaN, an
                # infinity, from a sidecar another tool wrote) is NULL.
                "value": reward.value if math.isfinite(reward.value) else None,
                "weight": reward.weight if math.isfinite(reward.weight) else None,
                "source": reward.source or None,
                "metadata": sorted(reward.metadata.items()),
                "recorded_at": _time(reward, "recorded_at"),
                "recorded_by": reward.recorded_by or None,
                "seq": reward.seq,
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
