"""Synthetic bundles written with the real BundleWriter, shaped like real agent runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import BundleWriter


@dataclass(frozen=True)
class Shape:
    """How a synthetic conversation looks."""

    turns: int
    deltas_per_turn: int
    words_per_delta: int = 1


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_conversation(root: Path, shape: Shape, *, thread_id: str = "bench-thread") -> Path:
    """Write one thread of `shape.turns` turns, each one call streaming its reply; return the dir.

    Every request re-sends the whole history, as the agent does, and is recorded as the agent
    records it: the previous request's input as a prefix count, then the new items.
    """
    writer = BundleWriter.create(root, thread_id, producer_name="bench")
    append = writer.append
    put = writer.put_payload
    instructions = put(b"You are a benchmark.", record_pb2.PAYLOAD_KIND_INSTRUCTIONS, "text/plain")
    append(
        record_pb2.TraceRecord(
            thread_started=record_pb2.ThreadStarted(
                thread=1,
                thread_id=thread_id,
                model="bench-model",
                instructions_payload_id=instructions,
            )
        )
    )
    envelope = put(
        _json(
            {
                "model": "bench-model",
                "instructions": "You are a benchmark.",
                "stream": True,
                "store": False,
            }
        ),
        record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE,
    )
    history: list[str] = []
    previous_input = 0
    for turn in range(1, shape.turns + 1):
        user_item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"Question number {turn}: tell me more."}],
        }
        user_payload = put(_json(user_item), record_pb2.PAYLOAD_KIND_INPUT_ITEM)
        append(
            record_pb2.TraceRecord(
                turn_started=record_pb2.TurnStarted(
                    turn=turn, thread=1, turn_id=f"turn-{turn}", input_payload_ids=[user_payload]
                )
            )
        )
        history.append(user_payload)
        append(
            record_pb2.TraceRecord(
                inference_started=record_pb2.InferenceStarted(
                    call=turn,
                    turn=turn,
                    inference_call_id=f"call-{turn}",
                    attempt=1,
                    model="bench-model",
                    provider_base_url="http://127.0.0.1:1/v1",
                    request_envelope_payload_id=envelope,
                    input_prefix_count=previous_input,
                    input_payload_ids=history[previous_input:],
                )
            )
        )
        previous_input = len(history)
        append(
            record_pb2.TraceRecord(
                response_created=record_pb2.ResponseCreated(call=turn, response_id=f"resp-{turn}")
            )
        )
        item_id = f"msg-{turn}"
        append(
            record_pb2.TraceRecord(
                output_item_added=record_pb2.OutputItemAdded(
                    call=turn,
                    item=turn,
                    provider_item_id=item_id,
                    item_type="message",
                    role="assistant",
                )
            )
        )
        words = []
        for index in range(shape.deltas_per_turn):
            delta = " ".join(f"w{turn}x{index}y{k}" for k in range(shape.words_per_delta)) + " "
            words.append(delta)
            append(
                record_pb2.TraceRecord(
                    output_text_delta=record_pb2.OutputTextDelta(call=turn, delta=delta)
                )
            )
        text = "".join(words)
        output_item = {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text}],
        }
        output_payload = put(_json(output_item), record_pb2.PAYLOAD_KIND_OUTPUT_ITEM)
        append(
            record_pb2.TraceRecord(
                output_item_done=record_pb2.OutputItemDone(
                    call=turn, item=turn, item_id=item_id, item_payload_id=output_payload
                )
            )
        )
        append(
            record_pb2.TraceRecord(
                inference_ended=record_pb2.InferenceEnded(
                    call=turn,
                    status=common_pb2.EXECUTION_STATUS_COMPLETED,
                    response_id=f"resp-{turn}",
                    usage=common_pb2.TokenUsage(
                        input_tokens=10 * turn, output_tokens=shape.deltas_per_turn
                    ),
                    reason="response.completed",
                )
            )
        )
        # What the agent sends back next turn is the accepted item itself.
        history.append(put(_json(output_item), record_pb2.PAYLOAD_KIND_INPUT_ITEM))
        append(
            record_pb2.TraceRecord(
                turn_ended=record_pb2.TurnEnded(
                    turn=turn, status=common_pb2.EXECUTION_STATUS_COMPLETED
                )
            )
        )
    append(
        record_pb2.TraceRecord(
            thread_ended=record_pb2.ThreadEnded(
                thread=1, status=common_pb2.EXECUTION_STATUS_COMPLETED, reason="closed"
            )
        )
    )
    writer.close()
    return writer.bundle_dir
