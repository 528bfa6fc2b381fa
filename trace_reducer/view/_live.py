"""`trace-reducer watch`: a bundle's transcript printed live, from successive reduced states."""

from __future__ import annotations

import contextlib
import os
from typing import TextIO

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._names import ROLE_WORDS, execution_word
from ..bundle._shown import one_line, shown_lines
from ._watch import WatchUpdate, follow_bundle

_RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
_UNSPECIFIED = common_pb2.EXECUTION_STATUS_UNSPECIFIED


def status_name(status: common_pb2.ExecutionStatus.ValueType) -> str:
    """COMPLETED, FAILED, ... as a person reads it."""
    return execution_word(status)


def _seconds(stamp: timestamp_pb2.Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def _duration(execution: state_pb2.Execution) -> str:
    if not execution.HasField("ended_at") or not execution.HasField("started_at"):
        return ""
    return f" · {_seconds(execution.ended_at) - _seconds(execution.started_at):.2f} s"


def _error(error: common_pb2.TraceError) -> str:
    if not (error.code or error.message):
        return ""
    http = f" (HTTP {error.http_status})" if error.http_status else ""
    return f" · error {error.code or '?'}{http}: {error.message}"


def _usage(call: state_pb2.InferenceCall) -> str:
    if not call.HasField("usage"):
        # An answer without usage (a Chat stream without stream_options.include_usage): its
        # count is unknown, not 0. A call that failed or was cut off says nothing here.
        completed = call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
        return " · tokens unknown" if completed else ""
    usage = call.usage
    if not usage.total_tokens and not usage.input_tokens and not usage.output_tokens:
        return ""
    return f" · {usage.input_tokens} in / {usage.output_tokens} out tokens"


def item_text(item: state_pb2.ConversationItem) -> str:
    """The readable text of an item: its content, or a function call and its arguments."""
    if item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL:
        return f"{item.name or '?'}({item.arguments})"
    if item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT:
        return item.output or "".join(part.text for part in item.content)
    return "".join(part.text for part in item.content)


def item_label(item: state_pb2.ConversationItem) -> str:
    """Who speaks in an item: user, assistant, reasoning, tool call, ..."""
    kind = item.kind
    if kind == state_pb2.ITEM_KIND_FUNCTION_CALL:
        return "tool call"
    if kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT:
        return "tool output"
    if kind == state_pb2.ITEM_KIND_REASONING:
        return "reasoning"
    role = ROLE_WORDS.get(item.role, "unspecified")
    label = "item" if role == "unspecified" else role
    if any(part.type == "refusal" for part in item.content):
        label += " (refusal)"
    return label


class LiveTranscript:
    """Prints what is new in each reduced state: items, text as it streams, status changes."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self.records_read = 0
        self._statuses: dict[str, int] = {}
        self._printed: set[str] = set()
        self._interrupts: set[str] = set()
        # Text printed of outputs still streaming, by (call, key), and the one whose line is open.
        self._streamed: dict[tuple[str, str], str] = {}
        self._open_line: tuple[str, str] | None = None
        self._stray: dict[str, list[str]] = {}
        self._discarded: set[tuple[str, str]] = set()

    def _emit(self, text: str) -> None:
        # The bundle's text, never an escape sequence the terminal would act on.
        self._out.write(shown_lines(text))

    def _write(self, text: str) -> None:
        self.close_line()
        self._emit(text + "\n")

    def close_line(self) -> None:
        """End a line of streamed text, so that what follows starts on its own line."""
        if self._open_line is not None:
            self._emit("\n")
            self._open_line = None

    def _changed(self, key: str, status: int) -> bool:
        if self._statuses.get(key) == status:
            return False
        self._statuses[key] = status
        return True

    def show(self, update: WatchUpdate) -> None:
        """Print what update adds to the states shown before."""
        self.records_read = update.records_read
        trace = update.trace
        # Items no turn input nor call brought (tool outputs not sent back yet), by turn.
        self._stray = {}
        for item_id, item in trace.conversation_items.items():
            if item_id not in self._printed and item.produced_by:
                self._stray.setdefault(item.turn_id, []).append(item_id)
        threads = sorted(trace.threads.values(), key=lambda t: t.thread_id != trace.root_thread_id)
        for thread in threads:
            if thread.thread_id not in self._statuses:
                self._write(
                    f"thread {one_line(thread.thread_id)} · model {one_line(thread.model)} · "
                    f"{trace.producer_name} {trace.producer_version}"
                )
                self._statuses[thread.thread_id] = _RUNNING
            for turn_id in thread.turn_ids:
                self._show_turn(trace, trace.turns[turn_id])
            status = thread.execution.status
            if status != _RUNNING and self._changed(thread.thread_id, status):
                self._write(f"[thread {thread.thread_id} · {status_name(status)}]")
        self._out.flush()

    def _show_item(self, trace: state_pb2.RolloutTrace, item_id: str) -> None:
        if item_id in self._printed:
            return
        self._printed.add(item_id)
        item = trace.conversation_items[item_id]
        text = item_text(item)
        streamed_key = self._streamed_key(item)
        if streamed_key is not None:
            streamed = self._streamed.pop(streamed_key)
            if text.startswith(streamed):
                if self._open_line != streamed_key:
                    self.close_line()
                    self._emit(f"{item_label(item)} (cont.): ")
                self._emit(text[len(streamed) :] + "\n")
                self._open_line = None
                return
        self._write(f"{item_label(item)}: {text}")

    def _streamed_key(self, item: state_pb2.ConversationItem) -> tuple[str, str] | None:
        for producer in item.produced_by:
            if producer.WhichOneof("producer") == "inference":
                key = (producer.inference.inference_call_id, item.responses_item_id)
                if key in self._streamed:
                    return key
                # The provider gave the item no id while it streamed.
                unnamed = (producer.inference.inference_call_id, "#0")
                return unnamed if unnamed in self._streamed else None
        return None

    def _show_turn(self, trace: state_pb2.RolloutTrace, turn: state_pb2.Turn) -> None:
        turn_id = turn.turn_id
        if turn_id not in self._statuses:
            self._write(f"\n── turn {turn_id} ──")
            self._statuses[turn_id] = _RUNNING
        for item_id in turn.input_item_ids:
            self._show_item(trace, item_id)
        for call_id in turn.inference_call_ids:
            self._show_call(trace, trace.inference_calls[call_id])
        for tool_call_id in turn.tool_call_ids:
            tool = trace.tool_calls[tool_call_id]
            status = tool.execution.status
            if status != _RUNNING and self._changed(tool_call_id, status):
                who = f" · output from {tool.submitted_by}" if tool.submitted_by else ""
                self._write(f"[tool call {tool.name} {tool_call_id} · {status_name(status)}{who}]")
        for item_id in self._stray.get(turn_id, ()):
            self._show_item(trace, item_id)
        if turn.HasField("interrupt") and turn_id not in self._interrupts:
            self._interrupts.add(turn_id)
            self._write(f"[interrupt requested by {turn.interrupt.requested_by or 'unknown'}]")
        status = turn.execution.status
        if status not in (_RUNNING, _UNSPECIFIED) and self._changed(turn_id, status):
            self._write(
                f"[turn {turn_id} · {status_name(status)}{_duration(turn.execution)}"
                f"{_error(turn.error)}]"
            )

    def _show_call(self, trace: state_pb2.RolloutTrace, call: state_pb2.InferenceCall) -> None:
        call_id = call.inference_call_id
        status = call.execution.status
        if call_id not in self._statuses:
            self._write(f"[call {call_id} · attempt {call.attempt} · {call.model}]")
            self._statuses[call_id] = _RUNNING
        # What the request brought that no earlier step showed (tool outputs, seeded history).
        for item_id in call.request_item_ids:
            if item_id not in self._printed:
                item = trace.conversation_items[item_id]
                if item.first_seen_seq == call.execution.started_seq:
                    self._show_item(trace, item_id)
        for item_id in call.response_item_ids:
            self._show_item(trace, item_id)
        running = status == _RUNNING
        for index, output in enumerate(call.discarded_outputs):
            key = (call_id, output.provider_item_id or f"#{index}")
            if running:
                self._stream(key, output.partial_text)
            else:
                self._discard(key, output.partial_text)
        if not running and self._changed(call_id, status):
            self._write(
                f"[call {call_id} · {status_name(status)}{_usage(call)}"
                f"{_duration(call.execution)}{_error(call.error)}]"
            )

    def _stream(self, key: tuple[str, str], text: str) -> None:
        shown = self._streamed.get(key)
        if shown is None or not text.startswith(shown):
            self.close_line()
            self._emit("assistant: ")
            shown = ""
        elif self._open_line != key:
            self.close_line()
            self._emit("assistant (cont.): ")
        self._emit(text[len(shown) :])
        self._streamed[key] = text
        self._open_line = key

    def _discard(self, key: tuple[str, str], text: str) -> None:
        if key in self._discarded:
            return
        self._discarded.add(key)
        shown = self._streamed.pop(key, None)
        if shown is None:
            self._write(f"discarded output (never completed): {text}")
            return
        rest = text[len(shown) :] if text.startswith(shown) else ""
        if self._open_line == key:
            self._emit(f"{rest} [discarded: never completed]\n")
            self._open_line = None
        elif rest:
            self._write(f"assistant (cont.): {rest} [discarded: never completed]")
        else:
            self._write("[output discarded: never completed]")


async def follow_and_print(
    trace_file: str | os.PathLike[str], printer: LiveTranscript
) -> state_pb2.RolloutTrace:
    """Print the transcript of a bundle as it is written; return the state at its end."""
    last = state_pb2.RolloutTrace()
    async with contextlib.aclosing(follow_bundle(trace_file)) as updates:
        async for update in updates:
            printer.show(update)
            last = update.trace
    printer.close_line()
    return last
