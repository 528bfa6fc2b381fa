"""Builds realistic bundles record by record with the real BundleWriter (docs/trace-format.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import BundleWriter, RecordBuilder

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
RUNNING = common_pb2.EXECUTION_STATUS_RUNNING

Item = dict[str, Any]


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
        self.records = RecordBuilder(self.writer)
        self.thread_id = thread_id
        self.model = model
        self.thread = self.records.thread_started(
            thread_id, model=model, instructions=instructions, metadata={"purpose": "test"}
        )

    @property
    def bundle_dir(self) -> Path:
        return self.writer.bundle_dir

    def append(self, **body: Any) -> int:
        """A raw record, for bundles the builder would not write (contradictions, odd fields)."""
        return self.writer.append(record_pb2.TraceRecord(**body))

    def turn(self, turn_id: str, inputs: list[Item]) -> int:
        return self.records.turn_started(self.thread, turn_id, inputs)

    def call(
        self, turn: int, call_id: str, inputs: list[Item], *, attempt: int = 1, prefix: int = 0
    ) -> int:
        """An inference call whose input is `prefix` items of the previous call's, then inputs."""
        return self.records.inference_started_after_prefix(
            turn,
            inference_call_id=call_id,
            attempt=attempt,
            model=self.model,
            provider_base_url="http://127.0.0.1:9/v1",
            envelope={"instructions": "Answer briefly.", "model": self.model, "store": False},
            prefix_count=prefix,
            new_items=inputs,
        )

    def created(self, call: int, response_id: str) -> None:
        self.records.response_created(call, response_id)

    def added(self, call: int, provider_item_id: str = "", *, item_type: str = "message") -> int:
        return self.records.output_item_added(
            call, provider_item_id=provider_item_id, item_type=item_type, role="assistant"
        )

    def delta(self, call: int, text: str, item: int = 0) -> None:
        """Text for the call's latest item, or for `item` named by its ordinal even when it is
        the latest (as another writer may): the reducer must take both."""
        if item:
            self.append(
                output_text_delta=record_pb2.OutputTextDelta(call=call, delta=text, item=item)
            )
        else:
            self.records.output_text_delta(call, item, text)

    def done(self, call: int, item: int, output: Item, *, assigned_id: str | None = None) -> str:
        """Accept output; the item id is the provider's, else assigned_id. Returns it."""
        item_id = output.get("id") or assigned_id or ""
        self.records.output_item_done(
            call, item, item_id=item_id, assigned="id" not in output, payload=output
        )
        return str(item_id)

    def event(self, call: int, event_type: str, data: object) -> None:
        self.records.provider_event(call, event_type, json.dumps(data))

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
        self.records.inference_ended(
            call, status, reason=reason, response_id=response_id, usage=usage, error=error
        )

    def interrupt(self, turn: int, requested_by: str = "ipv4:127.0.0.1:5555") -> None:
        self.records.interrupt_requested(turn, requested_by)

    def turn_ended(
        self,
        turn: int,
        status: common_pb2.ExecutionStatus.ValueType,
        error: common_pb2.TraceError | None = None,
    ) -> None:
        self.records.turn_ended(turn, status, error)
        self.writer.sync()

    def thread_ended(
        self, status: common_pb2.ExecutionStatus.ValueType = COMPLETED, reason: str = "closed"
    ) -> None:
        self.records.thread_ended(self.thread, status, reason)

    def close(self) -> Path:
        self.writer.close()
        return self.bundle_dir


def one_turn_bundle(
    root: Path,
    status: common_pb2.ExecutionStatus.ValueType = COMPLETED,
    *,
    provider_item_id: str | None = "msg-original",
    text: str = "accepted answer",
    close: bool = True,
    thread_id: str = "thread-1",
) -> Path:
    """The reference scenario: one user message, one streamed answer, then the terminal event."""
    bundle = BundleBuilder(root, thread_id)
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


def fork_of(root: Path, parent_dir: Path, prefix_items: list[Item], thread_id: str) -> Path:
    """A bundle under root that forks the parent (thread `parent`) after its turn `turn-1`,
    sharing prefix_items without copying them; closed after thread_started."""
    writer = BundleWriter.create(root, thread_id)
    records = RecordBuilder(writer)
    records.thread_forked(
        parent_thread_id="parent",
        parent_bundle=parent_dir.name,
        parent_trace_id="",
        after_turn_id="turn-1",
        group_id="g",
        repetition_index=0,
        shared_turns=1,
        prefix_items=prefix_items,
        copy_prefix=False,
    )
    records.thread_started(thread_id, model="test-model", instructions="", metadata={})
    writer.close()
    return writer.bundle_dir
