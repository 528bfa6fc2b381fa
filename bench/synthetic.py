"""Synthetic bundles written with the real BundleWriter, shaped like real agent runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2
from trace_reducer import BundleWriter, RecordBuilder


@dataclass(frozen=True)
class Shape:
    """How a synthetic conversation looks."""

    turns: int
    deltas_per_turn: int
    words_per_delta: int = 1


def write_conversation(root: Path, shape: Shape, *, thread_id: str = "bench-thread") -> Path:
    """Write one thread of `shape.turns` turns, each one call streaming its reply; return the dir.

    Every request re-sends the whole history, as the agent does, and is recorded as the agent
    records it (through the same RecordBuilder): the previous request's input as a prefix
    count, then the new items.
    """
    writer = BundleWriter.create(root, thread_id, producer_name="bench")
    records = RecordBuilder(writer)
    instructions = "You are a benchmark."
    thread = records.thread_started(
        thread_id, model="bench-model", instructions=instructions, metadata={}
    )
    envelope = {
        "model": "bench-model",
        "instructions": instructions,
        "stream": True,
        "store": False,
    }
    history: list[dict[str, Any]] = []
    for turn_number in range(1, shape.turns + 1):
        user_item = {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": f"Question number {turn_number}: tell me more."}
            ],
        }
        turn = records.turn_started(thread, f"turn-{turn_number}", [user_item])
        history.append(user_item)
        call = records.inference_started(
            turn,
            inference_call_id=f"call-{turn_number}",
            attempt=1,
            model="bench-model",
            provider_base_url="http://127.0.0.1:1/v1",
            envelope=envelope,
            input_items=history,
        )
        records.response_created(call, f"resp-{turn_number}")
        item_id = f"msg-{turn_number}"
        item = records.output_item_added(
            call, provider_item_id=item_id, item_type="message", role="assistant"
        )
        words = []
        for index in range(shape.deltas_per_turn):
            delta = (
                " ".join(f"w{turn_number}x{index}y{k}" for k in range(shape.words_per_delta)) + " "
            )
            words.append(delta)
            records.output_text_delta(call, item, delta)
        output_item = {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "".join(words)}],
        }
        records.output_item_done(call, item, item_id=item_id, assigned=False, payload=output_item)
        records.inference_ended(
            call,
            common_pb2.EXECUTION_STATUS_COMPLETED,
            reason="response.completed",
            response_id=f"resp-{turn_number}",
            usage=common_pb2.TokenUsage(
                input_tokens=10 * turn_number, output_tokens=shape.deltas_per_turn
            ),
        )
        # What the agent sends back next turn is the accepted item itself.
        history.append(output_item)
        records.turn_ended(turn, common_pb2.EXECUTION_STATUS_COMPLETED)
    records.thread_ended(thread, common_pb2.EXECUTION_STATUS_COMPLETED, "closed")
    writer.close()
    return writer.bundle_dir
