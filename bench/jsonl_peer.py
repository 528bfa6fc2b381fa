"""P1's peer: the same records as Codex-style JSONL, and a reducer for it built on orjson.

Codex writes a rollout as JSON lines `{"timestamp", "type", "payload"}`: `session_meta` first,
`response_item` for each item entering the conversation, `turn_context` per model request, and
`event_msg` for everything else (deltas as `agent_message_delta`). A bundle converts to that
record for record: payload records are inlined where they are referred to (an item as its own
`response_item` line, a request's sampling settings in its `turn_context`), so every other
record is one line. The reducer folds the lines into the answer the trace reducer gives, as far
as the lines carry it: the thread, its turns, inference calls and tool calls with their status,
times and fields, and the conversation items with their content, producer and request
membership, and discarded partial text, with the same rules for the common path. It is what
someone would write instead of a binary format; what the lines do not hold (record seqs, payload
ids, microsecond times) it does not make up.
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

# What a turn_context line carries of its request's settings: the envelope's keys the trace
# reducer reads its SamplingSettings from.
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "max_output_tokens",
    "max_tokens",
    "top_logprobs",
    "include",
    "logprobs",
    "return_token_ids",
)


def _line(timestamp: str, kind: str, payload: dict[str, Any]) -> bytes:
    return orjson.dumps({"timestamp": timestamp, "type": kind, "payload": payload})


def _event(stamp: str, kind: str, body: Any) -> bytes:
    fields = json_format.MessageToDict(body, preserving_proto_field_name=True)
    return _line(stamp, "event_msg", {"type": kind, **fields})


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
                envelope = (
                    item(call.request_envelope_payload_id)
                    if call.request_envelope_payload_id
                    else {}
                )
                context = {
                    "inference_call_id": call.inference_call_id,
                    "attempt": call.attempt,
                    "model": call.model,
                    "provider_base_url": call.provider_base_url,
                    "sampling": {k: envelope[k] for k in _SAMPLING_KEYS if k in envelope},
                    "input_prefix_count": call.input_prefix_count,
                    "input": [item(pid) for pid in call.input_payload_ids],
                }
                yield _line(stamp, "turn_context", context)
            elif kind == "output_item_done":
                done = record.output_item_done
                yield _line(stamp, "response_item", item(done.item_payload_id))
            elif kind in ("tool_output_submitted", "tool_call_ended"):
                # The function_call_output item follows its event, as Codex writes it.
                body = getattr(record, kind)
                yield _event(stamp, kind, body)
                if body.output_item_payload_id:
                    yield _line(stamp, "response_item", item(body.output_item_payload_id))
            elif kind is not None and kind != "footer":
                yield _event(stamp, kind, getattr(record, kind))


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
_RUNNING = "EXECUTION_STATUS_RUNNING"


def reduce_codex_jsonl(path: Path, *, lazy: bool = False) -> dict[str, Any]:
    """Fold the lines into the thread, turns, calls, tool calls and items; return the state.

    lazy: skip delta lines without parsing them (told by their first bytes, kept as raw bytes)
    and parse them only when their item never completes and its partial text is needed, as
    the trace reducer leaves delta text undecoded when a completed item brings it whole.
    """
    loads = orjson.loads
    items: dict[str, dict[str, Any]] = {}
    turns: dict[str, dict[str, Any]] = {}
    calls: dict[str, dict[str, Any]] = {}
    tools: dict[str, dict[str, Any]] = {}
    by_key: dict[bytes, str] = {}
    history: list[str] = []
    state: dict[str, Any] = {
        "thread": {},
        "items": items,
        "turns": turns,
        "calls": calls,
        "tool_calls": tools,
    }
    thread: dict[str, Any] = state["thread"]
    turn: dict[str, Any] | None = None
    call: dict[str, Any] | None = None
    tool: dict[str, Any] | None = None
    # What produced the next response_item line: the turn (its input), the call or the tool.
    source = ""
    # The open item's delta text (eager) or its raw delta lines (lazy).
    parts: list[str] = []
    # Lazy: the line from which skipped delta lines are the open item's.
    pending_from = 0

    def add_item(payload: dict[str, Any], producer: str, turn_id: str, stamp: str) -> str:
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
            "turn_id": turn_id,
            "first_seen_at": stamp,
        }
        thread["items"].append(item_id)
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
                turn = {
                    "turn_id": payload["turn_id"],
                    "status": _RUNNING,
                    "started_at": line["timestamp"],
                    "calls": [],
                    "inputs": [],
                    "tool_calls": [],
                }
                turns[turn["turn_id"]] = turn
                thread["turns"].append(turn["turn_id"])
                source = "turn"
            elif event == "output_item_added":
                parts = []
                pending_from = index + 1
            elif event == "response_created" and call is not None:
                call["response_id"] = payload["response_id"]
            elif event == "inference_ended" and call is not None:
                call["status"] = payload["status"]
                call["ended_at"] = line["timestamp"]
                call["response_id"] = payload.get("response_id", call["response_id"])
                call["usage"] = payload.get("usage")
                call["end_reason"] = payload.get("reason", "")
                call["stop_reason"] = payload.get("stop_reason", "")
                if lazy:
                    skipped = range(pending_from, index)
                    pending = [raws[k] for k in skipped if marks[k] != _NOT_FOUND]
                    if pending:
                        parts = [loads(delta)["payload"]["delta"] for delta in pending]
                    pending_from = index + 1
                if parts:
                    call["discarded"] = "".join(parts)
                    parts = []
            elif event == "tool_call_started" and call is not None and turn is not None:
                wanted = payload.get("item_id", "")
                # The function_call item the same call accepted just before.
                call_item = next(
                    (
                        i
                        for i in reversed(call["response"])
                        if items[i]["responses_item_id"] == wanted
                    ),
                    "",
                )
                tool = {
                    "tool_call_id": payload["tool_call_id"],
                    "call_id": payload.get("call_id", ""),
                    "name": payload.get("name", ""),
                    "turn_id": turn["turn_id"],
                    "requested_by": call["id"],
                    "call_item_id": call_item,
                    "arguments": payload.get("arguments_payload_id", ""),
                    "status": _RUNNING,
                    "started_at": line["timestamp"],
                    "output_item_id": "",
                }
                tools[tool["tool_call_id"]] = tool
                turn["tool_calls"].append(tool["tool_call_id"])
            elif event == "tool_output_submitted" and tool is not None:
                tool["submitted_by"] = payload.get("submitted_by", "")
                tool["is_error"] = payload.get("is_error", False)
                source = "tool"
            elif event == "tool_call_ended" and tool is not None:
                tool["status"] = payload["status"]
                tool["ended_at"] = line["timestamp"]
                if not tool["output_item_id"]:
                    source = "tool"
            elif event == "turn_ended" and turn is not None:
                turn["status"] = payload.get("status", "")
                turn["ended_at"] = line["timestamp"]
            elif event == "thread_started":
                thread.update(
                    thread_id=payload["thread_id"],
                    model=payload.get("model", ""),
                    status=_RUNNING,
                    started_at=line["timestamp"],
                    turns=[],
                    items=[],
                )
            elif event == "thread_ended":
                thread["status"] = payload.get("status", "")
                thread["ended_at"] = line["timestamp"]
        elif kind == "response_item":
            stamp = line["timestamp"]
            if source == "call" and call is not None and turn is not None:
                item_id = add_item(payload, call["id"], turn["turn_id"], stamp)
                call["response"].append(item_id)
                history.append(item_id)
                parts = []
                pending_from = index + 1
            elif source == "tool" and tool is not None and turn is not None:
                item_id = tool["output_item_id"] = add_item(
                    payload, tool["tool_call_id"], turn["turn_id"], stamp
                )
                source = ""
            elif turn is not None:
                item_id = add_item(payload, turn["turn_id"], turn["turn_id"], stamp)
                turn["inputs"].append(item_id)
            else:
                continue
            # What the agent sends back next is the item itself.
            by_key[orjson.dumps(payload)] = item_id
        elif kind == "turn_context" and turn is not None:
            prefix = payload["input_prefix_count"]
            request = history[:prefix]
            stamp = line["timestamp"]
            for entry in payload["input"]:
                key = orjson.dumps(entry)
                request.append(by_key.get(key) or add_item(entry, "input", turn["turn_id"], stamp))
            # The request is what was sent; the history grows on with the responses (one
            # list for both would put every response item into its own request).
            history = request.copy()
            call = {
                "id": payload["inference_call_id"],
                "turn": turn["turn_id"],
                "attempt": payload["attempt"],
                "model": payload["model"],
                "provider_base_url": payload.get("provider_base_url", ""),
                "sampling": payload.get("sampling", {}),
                "status": _RUNNING,
                "started_at": stamp,
                "response_id": "",
                "request": request,
                "response": [],
            }
            calls[call["id"]] = call
            turn["calls"].append(call["id"])
            source = "call"
        elif kind == "session_meta":
            state["meta"] = payload
    state["lines"] = lines
    return state
