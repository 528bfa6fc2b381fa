"""P1's peer: the same records as Codex-style JSONL, and a reducer for it built on orjson.

Codex writes a rollout as JSON lines `{"timestamp", "type", "payload"}`: `session_meta` first,
`response_item` for each item entering the conversation, `turn_context` per model request, and
`event_msg` for everything else (deltas as `agent_message_delta`). A bundle converts to that
record for record: payload records are inlined where they are referred to, so every other
record is one line. The reducer folds the lines into the same shape of answer as the
trace reducer's (threads, turns, inference calls with their request and response items,
conversation items with their content, discarded partial text), with the same rules for the
common path; it is what someone would write instead of a binary format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from itertools import compress, count
from operator import methodcaller
from pathlib import Path
from typing import Any

import orjson
from google.protobuf import json_format

from trace_reducer import read_bundle


def _line(timestamp: str, kind: str, payload: dict[str, Any]) -> bytes:
    return orjson.dumps({"timestamp": timestamp, "type": kind, "payload": payload})


def _lines(bundle: Path) -> Iterator[bytes]:
    payloads: dict[str, bytes] = {}
    base = datetime(1970, 1, 1, tzinfo=UTC)

    def item(pid: str) -> Any:
        return orjson.loads(payloads[pid])

    with read_bundle(bundle) as reader:
        for record in reader:
            kind = record.WhichOneof("body")
            stamp = (base + timedelta(microseconds=record.time_us)).isoformat(
                timespec="milliseconds"
            )
            if kind == "header":
                header = record.header
                base = header.created_at.ToDatetime(tzinfo=UTC)
                meta = {"id": header.trace_id, "thread_id": header.thread_id}
                yield _line(stamp, "session_meta", meta | {"originator": header.producer_name})
            elif kind == "payload":
                payloads[record.payload.payload_id] = record.payload.data
            elif kind == "output_text_delta":
                delta = record.output_text_delta
                body = {"type": "agent_message_delta", "call": delta.call, "delta": delta.delta}
                yield _line(stamp, "event_msg", body)
            elif kind == "turn_started":
                started = record.turn_started
                body = {"type": "task_started", "turn_id": started.turn_id}
                yield _line(stamp, "event_msg", body)
                for pid in started.input_payload_ids:
                    yield _line(stamp, "response_item", item(pid))
            elif kind == "inference_started":
                call = record.inference_started
                context = {
                    "inference_call_id": call.inference_call_id,
                    "attempt": call.attempt,
                    "model": call.model,
                    "input_prefix_count": call.input_prefix_count,
                    "input": [item(pid) for pid in call.input_payload_ids],
                }
                yield _line(stamp, "turn_context", context)
            elif kind == "output_item_done":
                done = record.output_item_done
                yield _line(stamp, "response_item", item(done.item_payload_id))
            elif kind is not None and kind != "footer":
                body = json_format.MessageToDict(
                    getattr(record, kind), preserving_proto_field_name=True
                )
                yield _line(stamp, "event_msg", {"type": kind, **body})


def write_codex_jsonl(bundle: Path, out: Path) -> int:
    """Write the bundle's records as Codex-style JSON lines; return how many lines."""
    count = 0
    with out.open("wb") as file:
        for line in _lines(bundle):
            file.write(line + b"\n")
            count += 1
    return count


# Every delta line starts `{"timestamp":"<29 characters>","type":"event_msg","payload":{"type":`
# then the event's name: the lazy reader tells a delta line by these bytes without parsing it.
_DELTA_MARK = b'"agent_message_delta"'
_DELTA_WINDOW = 128
_NOT_FOUND = -1


def reduce_codex_jsonl(path: Path, *, lazy: bool = False) -> dict[str, Any]:
    """Fold the lines into threads, turns, calls and items; return the state.

    lazy: skip delta lines without parsing them (told by their first bytes, kept as raw bytes)
    and parse them only when their item never completes and its partial text is needed, as
    the trace reducer leaves delta text undecoded when a completed item brings it whole.
    """
    loads = orjson.loads
    items: dict[str, dict[str, Any]] = {}
    turns: dict[str, dict[str, Any]] = {}
    calls: dict[str, dict[str, Any]] = {}
    by_key: dict[bytes, str] = {}
    history: list[str] = []
    state: dict[str, Any] = {"items": items, "turns": turns, "calls": calls}
    turn: dict[str, Any] | None = None
    call: dict[str, Any] | None = None
    # The open item's delta text (eager) or its raw delta lines (lazy).
    parts: list[str] = []
    # Lazy: the line from which skipped delta lines are the open item's.
    pending_from = 0

    def add_item(payload: dict[str, Any], producer: str) -> str:
        content = payload.get("content")
        texts = (
            [part.get("text", "") for part in content if isinstance(part, dict)]
            if isinstance(content, list)
            else [content]
            if isinstance(content, str)
            else []
        )
        item_id = f"item-{len(items) + 1}"
        items[item_id] = {
            "role": payload.get("role", ""),
            "kind": payload.get("type", ""),
            "content": texts,
            "responses_item_id": payload.get("id", ""),
            "produced_by": producer,
        }
        return item_id

    with path.open("rb") as file:
        data = file.read()
    raws = data.split(b"\n")
    if raws and not raws[-1]:
        raws.pop()
    lines = len(raws)
    if lazy:
        # Which lines are deltas, and the others' indexes, in passes that take no Python step
        # a line: a peer as quick to skip as the trace reducer's C scanner allows in Python.
        marks = list(map(methodcaller("find", _DELTA_MARK, 0, _DELTA_WINDOW), raws))
        kept: Iterable[int] = list(compress(count(), map(_NOT_FOUND.__eq__, marks)))
    else:
        kept = range(lines)
    for index in kept:
        line = loads(raws[index])
        payload = line["payload"]
        kind = line["type"]
        if kind == "event_msg":
            event = payload["type"]
            if event == "agent_message_delta":
                parts.append(payload["delta"])
            elif event == "task_started":
                turn = {"turn_id": payload["turn_id"], "calls": [], "inputs": []}
                turns[turn["turn_id"]] = turn
            elif event == "output_item_added":
                parts = []
                pending_from = index + 1
            elif event == "inference_ended" and call is not None:
                call["status"] = payload.get("status", 0)
                call["usage"] = payload.get("usage")
                if lazy:
                    skipped = range(pending_from, index)
                    pending = [raws[k] for k in skipped if marks[k] != _NOT_FOUND]
                    if pending:
                        parts = [loads(delta)["payload"]["delta"] for delta in pending]
                    pending_from = index + 1
                if parts:
                    call["discarded"] = "".join(parts)
                    parts = []
            elif event == "turn_ended" and turn is not None:
                turn["status"] = payload.get("status", 0)
            elif event == "session_meta":
                state["meta"] = payload
        elif kind == "response_item":
            if call is not None and turn is not None and call["turn"] == turn["turn_id"]:
                item_id = add_item(payload, call["id"])
                call["response"].append(item_id)
                history.append(item_id)
                # What the agent sends back next turn is the item itself.
                by_key[orjson.dumps(payload)] = item_id
                parts = []
                pending_from = index + 1
            elif turn is not None:
                item_id = add_item(payload, turn["turn_id"])
                turn["inputs"].append(item_id)
                by_key[orjson.dumps(payload)] = item_id
        elif kind == "turn_context" and turn is not None:
            prefix = payload["input_prefix_count"]
            request = history[:prefix]
            for entry in payload["input"]:
                key = orjson.dumps(entry)
                request.append(by_key.get(key) or add_item(entry, "input"))
            # The request is what was sent; the history grows on with the responses (one
            # list for both would put every response item into its own request).
            history = request.copy()
            call = {
                "id": payload["inference_call_id"],
                "turn": turn["turn_id"],
                "request": request,
                "response": [],
            }
            calls[call["id"]] = call
            turn["calls"].append(call["id"])
        elif kind == "session_meta":
            state["meta"] = payload
    state["lines"] = lines
    return state
