"""Builds realistic bundles record by record with the real BundleWriter (docs/trace-format.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import BundleWriter

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
RUNNING = common_pb2.EXECUTION_STATUS_RUNNING

Item = dict[str, Any]


def compact(value: object) -> bytes:
    """The agent's payload encoding: compact JSON with sorted keys."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def user_item(text: str) -> Item:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant_output(text: str, item_id: str | None) -> Item:
    """An assistant message as the provider sends it in output_item.done."""
    item: Item = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    if item_id is not None:
        item["id"] = item_id
    return item


def as_input(output: Item, item_id: str | None = None) -> Item:
    """An accepted output as the agent sends it back in the next request."""
    item: Item = {
        "type": output["type"],
        "role": output["role"],
        "content": [{"type": p["type"], "text": p["text"]} for p in output["content"]],
    }
    if item_id is not None:
        item["id"] = item_id
    return item


class BundleBuilder:
    """One thread's bundle; each method writes what the agent records at that moment."""

    def __init__(
        self,
        root: Path,
        thread_id: str = "thread-1",
        *,
        model: str = "test-model",
        instructions: str = "Answer briefly.",
    ) -> None:
        self.writer = BundleWriter.create(root, thread_id)
        self.thread_id = thread_id
        self.model = model
        self._turns = 0
        self._calls = 0
        self._items = 0
        self.thread = 1
        pid = self.writer.put_payload(
            instructions.encode(), record_pb2.PAYLOAD_KIND_INSTRUCTIONS, "text/plain; charset=utf-8"
        )
        self.append(
            thread_started=record_pb2.ThreadStarted(
                thread=self.thread,
                thread_id=thread_id,
                model=model,
                instructions_payload_id=pid,
                metadata={"purpose": "test"},
            )
        )

    @property
    def bundle_dir(self) -> Path:
        return self.writer.bundle_dir

    def append(self, **body: Any) -> int:
        return self.writer.append(record_pb2.TraceRecord(**body))

    def turn(self, turn_id: str, inputs: list[Item]) -> int:
        self._turns += 1
        pids = [self._item_payload(item) for item in inputs]
        self.append(
            turn_started=record_pb2.TurnStarted(
                turn=self._turns, thread=self.thread, turn_id=turn_id, input_payload_ids=pids
            )
        )
        return self._turns

    def call(
        self, turn: int, call_id: str, inputs: list[Item], *, attempt: int = 1, prefix: int = 0
    ) -> int:
        """An inference call whose input is `prefix` items of the previous call's, then inputs."""
        self._calls += 1
        envelope = {"instructions": "Answer briefly.", "model": self.model, "store": False}
        envelope_id = self.writer.put_payload(
            compact(envelope), record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE
        )
        pids = [self._item_payload(item) for item in inputs]
        self.append(
            inference_started=record_pb2.InferenceStarted(
                call=self._calls,
                turn=turn,
                inference_call_id=call_id,
                attempt=attempt,
                model=self.model,
                provider_base_url="http://127.0.0.1:9/v1",
                request_envelope_payload_id=envelope_id,
                input_payload_ids=pids,
                input_prefix_count=prefix,
            )
        )
        return self._calls

    def created(self, call: int, response_id: str) -> None:
        self.append(response_created=record_pb2.ResponseCreated(call=call, response_id=response_id))

    def added(self, call: int, provider_item_id: str = "", *, item_type: str = "message") -> int:
        self._items += 1
        self.append(
            output_item_added=record_pb2.OutputItemAdded(
                call=call,
                item=self._items,
                provider_item_id=provider_item_id,
                item_type=item_type,
                role="assistant",
            )
        )
        return self._items

    def delta(self, call: int, text: str, item: int = 0) -> None:
        self.append(output_text_delta=record_pb2.OutputTextDelta(call=call, delta=text, item=item))

    def done(self, call: int, item: int, output: Item, *, assigned_id: str | None = None) -> str:
        """Accept output; the item id is the provider's, else assigned_id. Returns it."""
        pid = self.writer.put_payload(compact(output), record_pb2.PAYLOAD_KIND_OUTPUT_ITEM)
        item_id = output.get("id") or assigned_id or ""
        self.append(
            output_item_done=record_pb2.OutputItemDone(
                call=call,
                item=item,
                item_id=item_id,
                item_id_assigned="id" not in output,
                item_payload_id=pid,
            )
        )
        return str(item_id)

    def event(self, call: int, event_type: str, data: object) -> None:
        self.append(
            provider_event=record_pb2.ProviderEvent(
                call=call, event_type=event_type, data=json.dumps(data)
            )
        )

    def call_ended(
        self,
        call: int,
        status: common_pb2.ExecutionStatus.ValueType,
        *,
        response_id: str = "",
        reason: str = "",
        error: common_pb2.TraceError | None = None,
        usage: common_pb2.TokenUsage | None = None,
    ) -> None:
        self.append(
            inference_ended=record_pb2.InferenceEnded(
                call=call,
                status=status,
                response_id=response_id,
                reason=reason,
                error=error,
                usage=usage,
            )
        )

    def interrupt(self, turn: int, requested_by: str = "ipv4:127.0.0.1:5555") -> None:
        self.append(
            interrupt_requested=record_pb2.InterruptRequested(turn=turn, requested_by=requested_by)
        )

    def turn_ended(
        self,
        turn: int,
        status: common_pb2.ExecutionStatus.ValueType,
        error: common_pb2.TraceError | None = None,
    ) -> None:
        self.append(turn_ended=record_pb2.TurnEnded(turn=turn, status=status, error=error))
        self.writer.sync()

    def thread_ended(
        self, status: common_pb2.ExecutionStatus.ValueType = COMPLETED, reason: str = "closed"
    ) -> None:
        self.append(
            thread_ended=record_pb2.ThreadEnded(thread=self.thread, status=status, reason=reason)
        )

    def close(self) -> Path:
        self.writer.close()
        return self.bundle_dir

    def _item_payload(self, item: Item) -> str:
        return self.writer.put_payload(compact(item), record_pb2.PAYLOAD_KIND_INPUT_ITEM)


def one_turn_bundle(
    root: Path,
    status: common_pb2.ExecutionStatus.ValueType = COMPLETED,
    *,
    provider_item_id: str | None = "msg-original",
    text: str = "accepted answer",
    close: bool = True,
) -> Path:
    """The reference scenario: one user message, one streamed answer, then the terminal event."""
    bundle = BundleBuilder(root)
    question = user_item("answer once")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    bundle.created(call, "resp-1")
    item = bundle.added(call, provider_item_id or "")
    for word in text.split(" "):
        bundle.delta(call, word + " ")
    bundle.done(call, item, assistant_output(text, provider_item_id), assigned_id="msg-assigned-1")
    error = None
    if status == COMPLETED:
        bundle.event(call, "response.completed", {"response": {"id": "resp-1"}})
        reason = "response.completed"
    else:
        error = common_pb2.TraceError(code="server_error", message="stream failed")
        bundle.event(call, "response.failed", {"response": {"id": "resp-1"}})
        reason = "response.failed"
    usage = common_pb2.TokenUsage(input_tokens=5, output_tokens=2, total_tokens=7)
    bundle.call_ended(call, status, response_id="resp-1", reason=reason, error=error, usage=usage)
    bundle.turn_ended(turn, status, error)
    bundle.thread_ended()
    if close:
        bundle.close()
    else:
        bundle.writer.abandon()
    return bundle.bundle_dir
