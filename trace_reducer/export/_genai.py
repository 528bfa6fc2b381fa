"""The OpenTelemetry GenAI view of a reduced trace: its spans, attributes and events as data."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._bulk import DeltaRun
from ..bundle._errors import PayloadError
from ..bundle._integrity import integrity_name
from ..bundle._names import KIND_WORDS, ROLE_WORDS, execution_word
from ..bundle._payloads import PayloadStore, payload_json
from ..bundle._reader import read_bundle
from ..bundle._records import parse_traceparent

AttributeValue = str | bool | int | float | list[str]
Attributes = dict[str, AttributeValue]

_RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
_COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
_FAILED = common_pb2.EXECUTION_STATUS_FAILED
_CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED

# Provider events whose `response` object names the model that answered and why it stopped.
_TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
# Chat Completions keeps its chunks (and a whole completion) verbatim: they name the model
# and carry the choice's finish reason.
_CHAT_EVENTS = frozenset({"chat.completion.chunk", "chat.completion"})
_CHAT_FINISH_REASON = re.compile(r'"finish_reason"\s*:\s*"')
# Provider events that are not a chunk of the response stream.
_NOT_CHUNKS = frozenset({"http_error"})
# Responses API `incomplete_details.reason` → the conventions' finish reason.
_INCOMPLETE_FINISH = {"max_output_tokens": "length", "content_filter": "content_filter"}
# Chat Completions `finish_reason` → the conventions' (`tool_calls` is `tool_call` there).
_CHAT_FINISH = {
    "stop": "stop",
    "length": "length",
    "content_filter": "content_filter",
    "tool_calls": "tool_call",
    "function_call": "tool_call",
}
# The content switch of the GenAI instrumentations: `true` (the boolean form), or the enum of
# the newer ones, of which only the span forms put content on spans.
CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_CAPTURE_ON = frozenset({"true", "span_only", "span_and_event"})
# The first chunk of a call's stream, whatever its kind.
_CHUNK_BODIES = frozenset(
    {
        "response_created",
        "output_item_added",
        "output_text_delta",
        "output_item_done",
        "provider_event",
    }
)
# Hosts with a well-known `gen_ai.provider.name`; any other host speaks the OpenAI Responses
# API to the agent, which is what the attribute discriminates.
_PROVIDER_HOSTS = (
    ("api.openai.com", "openai"),
    (".openai.azure.com", "azure.ai.openai"),
    ("api.anthropic.com", "anthropic"),
    ("generativelanguage.googleapis.com", "gcp.gemini"),
    ("aiplatform.googleapis.com", "gcp.vertex_ai"),
    ("api.x.ai", "x_ai"),
    ("api.groq.com", "groq"),
    ("api.deepseek.com", "deepseek"),
    ("api.mistral.ai", "mistral_ai"),
    ("api.perplexity.ai", "perplexity"),
)
_DEFAULT_PROVIDER = "openai"

_HEX_TRACE_ID = re.compile(r"[0-9a-f]{32}")
# The attributes only content capture sets (span attributes and the discarded-output event's):
# what a span too large for any export request goes without.
CONTENT_ATTRIBUTES = frozenset(
    {
        "gen_ai.system_instructions",
        "gen_ai.tool.definitions",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
        "rollout.output.partial_text",
    }
)


@dataclass(frozen=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: Attributes


@dataclass
class SpanPlan:
    """One span: ids, name, times, attributes, events and status, ready for the SDK."""

    span_id: int
    parent_span_id: int | None
    name: str
    client: bool
    start_ns: int
    end_ns: int
    attributes: Attributes
    events: list[SpanEvent] = field(default_factory=list)
    # Set when the operation failed: the span status is then ERROR with this description.
    error: str | None = None
    # (trace id, span id, flags) of a span outside the bundle that is this one's parent (the
    # W3C traceparent a turn was started under); the span and its children join that trace.
    remote_parent: tuple[int, int, int] | None = None


@dataclass
class TracePlan:
    """The spans of one bundle, parents before children."""

    trace_id: int
    resource: Attributes
    spans: list[SpanPlan]


@dataclass
class BundleDetails:
    """What the reduced state does not keep and the spans show: request envelopes,
    instructions, and what the provider's terminal event said."""

    payloads: dict[str, bytes] = field(default_factory=dict)
    response_models: dict[str, str] = field(default_factory=dict)
    incomplete_reasons: dict[str, str] = field(default_factory=dict)
    # A Chat Completions call's finish reason, in the conventions' words.
    finish_reasons: dict[str, str] = field(default_factory=dict)
    # Seconds from a call's request to the first chunk of its stream.
    first_chunk_seconds: dict[str, float] = field(default_factory=dict)

    def json(self, payload_id: str) -> Any:
        data = self.payloads.get(payload_id)
        if data is None:
            return None
        try:
            return payload_json(data)
        except ValueError:
            return None

    def text(self, payload_id: str) -> str | None:
        data = self.payloads.get(payload_id)
        return None if data is None else data.decode("utf-8", "replace")


def read_details(path: str | os.PathLike[str], trace: state_pb2.RolloutTrace) -> BundleDetails:
    """One pass over the bundle for the payloads and provider events the spans need."""
    wanted = {call.request_envelope_payload_id for call in trace.inference_calls.values()}
    wanted.update(thread.instructions_payload_id for thread in trace.threads.values())
    wanted.discard("")
    store = PayloadStore(budget=None)
    call_ids: dict[int, str] = {}
    # call ordinal → the time its request started, until its first chunk is seen
    waiting: dict[int, int] = {}
    details = BundleDetails()
    with read_bundle(path) as reader:
        for batch in reader.batches():
            for record in batch:
                if isinstance(record, DeltaRun):
                    continue  # text deltas, read in bulk: an item was added before them
                body = record.WhichOneof("body")
                if body == "payload":
                    if record.payload.payload_id in wanted:
                        try:
                            store.add(record.payload)
                        except PayloadError:
                            # The reducer has judged the records; a payload that does not fit
                            # only leaves its attributes out.
                            continue
                    continue
                if body == "inference_started":
                    started = record.inference_started
                    call_ids[started.call] = started.inference_call_id
                    waiting[started.call] = record.time_us
                    continue
                if body not in _CHUNK_BODIES:
                    continue
                message = getattr(record, body)
                if message.call in waiting and (
                    body != "provider_event" or message.event_type not in _NOT_CHUNKS
                ):
                    started_us = waiting.pop(message.call)
                    call_id = call_ids.get(message.call)
                    if call_id:
                        details.first_chunk_seconds[call_id] = (
                            max(0, record.time_us - started_us) / 1e6
                        )
                if body == "provider_event":
                    call_id = call_ids.get(message.call)
                    if not call_id:
                        continue
                    if message.event_type in _TERMINAL_EVENTS:
                        _take_terminal_event(details, call_id, message.data)
                    elif message.event_type in _CHAT_EVENTS:
                        _take_chat_event(details, call_id, message.data)
    for pid in wanted:
        try:
            details.payloads[pid] = store.get(pid)
        except PayloadError:
            continue
    return details


def _take_terminal_event(details: BundleDetails, call_id: str, data: str) -> None:
    try:
        event = payload_json(data)
    except ValueError:
        return
    response = event.get("response") if isinstance(event, dict) else None
    if not isinstance(response, dict):
        return
    model = response.get("model")
    if isinstance(model, str) and model:
        details.response_models[call_id] = model
    incomplete = response.get("incomplete_details")
    reason = incomplete.get("reason") if isinstance(incomplete, dict) else None
    if isinstance(reason, str) and reason:
        details.incomplete_reasons[call_id] = reason


def _take_chat_event(details: BundleDetails, call_id: str, data: str) -> None:
    # Every chunk names the model; only the last ones carry a finish reason: a chunk is
    # parsed only while it can still tell something.
    if call_id in details.response_models and not _CHAT_FINISH_REASON.search(data):
        return
    try:
        chunk = payload_json(data)
    except ValueError:
        return
    if not isinstance(chunk, dict):
        return
    model = chunk.get("model")
    if isinstance(model, str) and model and call_id not in details.response_models:
        details.response_models[call_id] = model
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                details.finish_reasons[call_id] = _CHAT_FINISH.get(reason, reason)


def capture_content(given: bool | None = None) -> bool:
    """Whether spans carry content: as given (a flag), else as
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT says (`true`, `span_only`,
    `span_and_event`), else not."""
    if given is not None:
        return given
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in _CAPTURE_ON


# -- ids and times ----------------------------------------------------------------------------


def trace_id_of(bundle_trace_id: str) -> int:
    """The OpenTelemetry trace id of a bundle: its own id when that is 32 hex digits (so the
    backend finds it by the id the bundle shows), a digest of it otherwise."""
    if _HEX_TRACE_ID.fullmatch(bundle_trace_id) and int(bundle_trace_id, 16):
        return int(bundle_trace_id, 16)
    digest = hashlib.blake2b(bundle_trace_id.encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


def span_id_of(bundle_trace_id: str, kind: str, object_id: str) -> int:
    """A span id that depends only on the bundle's ids, so a second export repeats it."""
    key = f"{bundle_trace_id}\0{kind}\0{object_id}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def _ns(stamp: timestamp_pb2.Timestamp) -> int:
    return stamp.seconds * 1_000_000_000 + stamp.nanos


def _status_name(status: common_pb2.ExecutionStatus.ValueType) -> str:
    return execution_word(status)


# -- content in the conventions' message shape ------------------------------------------------


def _json_or_text(text: str) -> Any:
    try:
        return payload_json(text)
    except ValueError:
        return text


def _parts(item: state_pb2.ConversationItem) -> list[dict[str, Any]]:
    kind = item.kind
    if kind == state_pb2.ITEM_KIND_FUNCTION_CALL:
        return [
            {
                "type": "tool_call",
                "id": item.call_id,
                "name": item.name,
                "arguments": _json_or_text(item.arguments),
            }
        ]
    if kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT:
        return [{"type": "tool_call_response", "id": item.call_id, "response": item.output}]
    if kind == state_pb2.ITEM_KIND_REASONING:
        text = "".join(part.text for part in item.content)
        return [{"type": "reasoning", "content": text}]
    parts: list[dict[str, Any]] = []
    for part in item.content:
        if part.text or part.type.endswith("text"):
            parts.append({"type": "text", "content": part.text})
        else:
            parts.append({"type": part.type or "unknown"})
    if not parts and kind not in (state_pb2.ITEM_KIND_MESSAGE, state_pb2.ITEM_KIND_UNSPECIFIED):
        parts.append({"type": KIND_WORDS.get(kind, "unspecified")})
    return parts


def _role(item: state_pb2.ConversationItem) -> str:
    if item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT:
        return "tool"
    return ROLE_WORDS.get(item.role, "assistant")


def _dumps(value: Any) -> str:
    # Backends read these attributes as JSON strings (the conventions allow it where structured
    # span attributes are not read; Phoenix validates only the string form).
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _output_messages(
    trace: state_pb2.RolloutTrace, item_ids: Sequence[str], finish_reason: str
) -> str:
    # The Responses API returns one generation, so every accepted item is a part of one message.
    parts = []
    for item_id in item_ids:
        item = trace.conversation_items.get(item_id)
        if item is not None:
            parts.extend(_parts(item))
    return _dumps([{"role": "assistant", "parts": parts, "finish_reason": finish_reason}])


# -- the plan ---------------------------------------------------------------------------------


@dataclass
class _Planner:
    trace: state_pb2.RolloutTrace
    details: BundleDetails
    include_content: bool
    spans: list[SpanPlan] = field(default_factory=list)
    # item id → its input message as JSON
    messages: dict[str, str] = field(default_factory=dict)

    @property
    def _trace_end_ns(self) -> int:
        trace = self.trace
        return _ns(trace.ended_at) if trace.HasField("ended_at") else _ns(trace.started_at)

    def _input_messages(self, item_ids: Iterable[str]) -> str:
        # Every call re-sends the history: each item is encoded once and joined per call.
        encoded = []
        for item_id in item_ids:
            message = self.messages.get(item_id)
            if message is None:
                item = self.trace.conversation_items.get(item_id)
                if item is None:
                    continue
                message = self.messages[item_id] = _dumps(
                    {"role": _role(item), "parts": _parts(item)}
                )
            encoded.append(message)
        return f"[{','.join(encoded)}]"

    def _span_id(self, kind: str, object_id: str) -> int:
        return span_id_of(self.trace.trace_id, kind, object_id)

    def _window(
        self, execution: state_pb2.Execution, attributes: Attributes, events: list[SpanEvent]
    ) -> tuple[int, int]:
        """Start and end of a span; what never ended ends where the recording does."""
        start = _ns(execution.started_at)
        attributes["rollout.execution.status"] = _status_name(execution.status)
        if execution.HasField("ended_at"):
            return start, max(start, _ns(execution.ended_at))
        end = max(start, self._trace_end_ns)
        integrity = self.trace.integrity
        event_attributes: Attributes = {
            "rollout.integrity.status": integrity_name(integrity.status)
        }
        if integrity.detail:
            event_attributes["rollout.integrity.detail"] = integrity.detail
        events.append(SpanEvent("rollout.recording_ended", end, event_attributes))
        return start, end

    def _interrupt_event(self, turn: state_pb2.Turn) -> SpanEvent | None:
        if not turn.HasField("interrupt"):
            return None
        interrupt = turn.interrupt
        return SpanEvent(
            "rollout.interrupt",
            _ns(interrupt.requested_at),
            {"rollout.interrupt.requested_by": interrupt.requested_by},
        )

    def plan(self) -> TracePlan:
        trace = self.trace
        thread_ids = list(trace.threads)
        if trace.root_thread_id in trace.threads:
            thread_ids.remove(trace.root_thread_id)
            thread_ids.insert(0, trace.root_thread_id)
        root: int | None = None
        for thread_id in thread_ids:
            span_id = self._thread(trace.threads[thread_id], root)
            root = span_id if root is None else root
        resource: Attributes = {"service.name": trace.producer_name or "rollout-trace"}
        if trace.producer_version:
            resource["service.version"] = trace.producer_version
        return TracePlan(trace_id_of(trace.trace_id), resource, self.spans)

    def _thread(self, thread: state_pb2.Thread, parent: int | None) -> int:
        trace = self.trace
        span_id = self._span_id("thread", thread.thread_id)
        attributes: Attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": self._thread_provider(thread),
            "gen_ai.conversation.id": thread.thread_id,
            "gen_ai.request.model": thread.model,
            "rollout.trace_id": trace.trace_id,
            "rollout.thread.id": thread.thread_id,
        }
        if parent is None:
            attributes["rollout.recording.complete"] = trace.recording_complete
            attributes["rollout.integrity.status"] = integrity_name(trace.integrity.status)
            if trace.integrity.detail:
                attributes["rollout.integrity.detail"] = trace.integrity.detail
        for key, value in sorted(thread.metadata.items()):
            attributes[f"rollout.thread.metadata.{key}"] = value
        if self.include_content:
            instructions = self.details.text(thread.instructions_payload_id)
            if instructions:
                attributes["gen_ai.system_instructions"] = _dumps(
                    [{"type": "text", "content": instructions}]
                )
        events: list[SpanEvent] = []
        start, end = self._window(thread.execution, attributes, events)
        span = SpanPlan(span_id, parent, "invoke_agent", False, start, end, attributes, events)
        self._fail(span, thread.execution.status, None)
        self.spans.append(span)
        for index, turn_id in enumerate(thread.turn_ids, start=1):
            turn = trace.turns.get(turn_id)
            if turn is not None:
                self._turn(turn, index, span_id)
        return span_id

    def _thread_provider(self, thread: state_pb2.Thread) -> str:
        for turn_id in thread.turn_ids:
            turn = self.trace.turns.get(turn_id)
            for call_id in turn.inference_call_ids if turn is not None else ():
                call = self.trace.inference_calls.get(call_id)
                if call is not None and call.provider_base_url:
                    return provider_name(call.provider_base_url)
        return _DEFAULT_PROVIDER

    def _turn(self, turn: state_pb2.Turn, index: int, parent: int) -> None:
        span_id = self._span_id("turn", turn.turn_id)
        attributes: Attributes = {
            # A turn is one invocation of the agent: without an operation, GenAI backends
            # file the span under UNKNOWN.
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": turn.thread_id,
            "rollout.turn.id": turn.turn_id,
            "rollout.turn.index": index,
        }
        events: list[SpanEvent] = []
        interrupt = self._interrupt_event(turn)
        if interrupt is not None:
            events.append(interrupt)
        start, end = self._window(turn.execution, attributes, events)
        span = SpanPlan(span_id, parent, "turn", False, start, end, attributes, events)
        span.remote_parent = parse_traceparent(turn.traceparent)
        self._fail(span, turn.execution.status, turn.error if turn.HasField("error") else None)
        self.spans.append(span)
        for call_id in turn.inference_call_ids:
            call = self.trace.inference_calls.get(call_id)
            if call is not None:
                self._call(call, turn, span_id)
        for tool_call_id in turn.tool_call_ids:
            tool_call = self.trace.tool_calls.get(tool_call_id)
            if tool_call is not None:
                self._tool_call(tool_call, turn, span_id)

    @staticmethod
    def _fail(
        span: SpanPlan,
        status: common_pb2.ExecutionStatus.ValueType,
        error: common_pb2.TraceError | None,
    ) -> None:
        """ERROR status and `error.type` for what failed; a cancel is not a failure."""
        if status in (_COMPLETED, _CANCELLED, _RUNNING):
            return
        if error is not None and (error.code or error.message):
            span.attributes["error.type"] = error.code or "_OTHER"
            span.error = error.message or error.code
            if error.http_status:
                span.attributes["http.response.status_code"] = error.http_status
        else:
            span.attributes["error.type"] = "_OTHER"
            span.error = _status_name(status).lower()

    def _finish_reason(self, call: state_pb2.InferenceCall) -> str:
        chat = self.details.finish_reasons.get(call.inference_call_id)
        if chat is not None:
            return chat  # what the engine said, whatever ended the call afterwards
        if call.execution.status == _COMPLETED:
            for item_id in call.response_item_ids:
                item = self.trace.conversation_items.get(item_id)
                if item is not None and item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL:
                    return "tool_call"
            return "stop"
        incomplete = self.details.incomplete_reasons.get(call.inference_call_id, "")
        # The conventions: a finish reason expected but never received (failed, cancelled, a
        # stream that ended before its final event) is reported as `error`.
        return _INCOMPLETE_FINISH.get(incomplete, "error")

    def _call(self, call: state_pb2.InferenceCall, turn: state_pb2.Turn, parent: int) -> None:
        model = call.model or self.trace.threads[call.thread_id].model
        finish_reason = self._finish_reason(call)
        attributes: Attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider_name(call.provider_base_url),
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": call.thread_id,
            "gen_ai.response.finish_reasons": [finish_reason],
            "rollout.inference_call.id": call.inference_call_id,
            "rollout.inference_call.attempt": call.attempt,
        }
        attributes.update(_server_attributes(call.provider_base_url))
        envelope = self.details.json(call.request_envelope_payload_id)
        if isinstance(envelope, dict):
            attributes.update(_request_attributes(envelope))
            first_chunk = self.details.first_chunk_seconds.get(call.inference_call_id)
            if envelope.get("stream") is True and first_chunk is not None:
                attributes["gen_ai.response.time_to_first_chunk"] = first_chunk
        if call.response_id:
            attributes["gen_ai.response.id"] = call.response_id
        response_model = self.details.response_models.get(call.inference_call_id)
        if response_model:
            attributes["gen_ai.response.model"] = response_model
        if call.HasField("usage"):
            usage = call.usage
            attributes["gen_ai.usage.input_tokens"] = usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.output_tokens
            if usage.cached_input_tokens:
                attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_input_tokens
            if usage.reasoning_tokens:
                attributes["gen_ai.usage.reasoning.output_tokens"] = usage.reasoning_tokens
        if call.end_reason:
            attributes["rollout.inference_call.end_reason"] = call.end_reason
        if self.include_content:
            if isinstance(envelope, dict) and isinstance(envelope.get("instructions"), str):
                attributes["gen_ai.system_instructions"] = _dumps(
                    [{"type": "text", "content": envelope["instructions"]}]
                )
            if isinstance(envelope, dict) and isinstance(envelope.get("tools"), list):
                attributes["gen_ai.tool.definitions"] = _dumps(envelope["tools"])
            attributes["gen_ai.input.messages"] = self._input_messages(call.request_item_ids)
            if call.response_item_ids:
                attributes["gen_ai.output.messages"] = _output_messages(
                    self.trace, call.response_item_ids, finish_reason
                )
        events: list[SpanEvent] = []
        if call.execution.status == _CANCELLED:
            interrupt = self._interrupt_event(turn)
            if interrupt is not None:
                events.append(interrupt)
        start, end = self._window(call.execution, attributes, events)
        for discarded in call.discarded_outputs:
            # Output that streamed but was never completed: shown as what it is, never as an
            # output message.
            event_attributes: Attributes = {
                "rollout.output.provider_item_id": discarded.provider_item_id,
                "rollout.output.item_type": discarded.item_type,
                "rollout.output.partial_chars": len(discarded.partial_text),
            }
            if self.include_content:
                event_attributes["rollout.output.partial_text"] = discarded.partial_text
            events.append(SpanEvent("rollout.output_discarded", end, event_attributes))
        span = SpanPlan(
            self._span_id("call", call.inference_call_id),
            parent,
            f"chat {model}",
            True,
            start,
            end,
            attributes,
            events,
        )
        self._fail(span, call.execution.status, call.error if call.HasField("error") else None)
        self.spans.append(span)

    def _tool_call(self, tool: state_pb2.ToolCall, turn: state_pb2.Turn, parent: int) -> None:
        attributes: Attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool.name,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": tool.thread_id,
            "rollout.tool_call.id": tool.tool_call_id,
        }
        if tool.call_id:
            attributes["gen_ai.tool.call.id"] = tool.call_id
        if tool.requested_by_inference_call_id:
            attributes["rollout.tool_call.requested_by"] = tool.requested_by_inference_call_id
        if tool.submitted_by:
            attributes["rollout.tool_call.submitted_by"] = tool.submitted_by
        status = tool.execution.status
        call_item = self.trace.conversation_items.get(tool.call_item_id)
        output_item = self.trace.conversation_items.get(tool.output_item_id)
        if self.include_content:
            if call_item is not None:
                attributes["gen_ai.tool.call.arguments"] = call_item.arguments
            if output_item is not None and status == _COMPLETED and not tool.is_error:
                attributes["gen_ai.tool.call.result"] = output_item.output
        events: list[SpanEvent] = []
        if status == _CANCELLED:
            interrupt = self._interrupt_event(turn)
            if interrupt is not None:
                events.append(interrupt)
        start, end = self._window(tool.execution, attributes, events)
        span = SpanPlan(
            self._span_id("tool", tool.tool_call_id),
            parent,
            f"execute_tool {tool.name}",
            False,
            start,
            end,
            attributes,
            events,
        )
        if status not in (_COMPLETED, _CANCELLED, _RUNNING):
            if tool.is_error:
                attributes["error.type"] = "tool_error"
                # The error text is the tool's output, which is content.
                span.error = (
                    output_item.output
                    if self.include_content and output_item is not None
                    else "the tool reported an error"
                )
            else:
                attributes["error.type"] = "_OTHER"
                span.error = f"tool call {_status_name(status).lower()}"
        self.spans.append(span)


def provider_name(base_url: str) -> str:
    """`gen_ai.provider.name` for a provider base URL."""
    host = (urlsplit(base_url).hostname or "").lower()
    for suffix, name in _PROVIDER_HOSTS:
        if host == suffix or (suffix.startswith(".") and host.endswith(suffix)):
            return name
    return _DEFAULT_PROVIDER


def _server_attributes(base_url: str) -> Attributes:
    try:
        parts = urlsplit(base_url)
        port = parts.port
    except ValueError:
        return {}
    if not parts.hostname:
        return {}
    attributes: Attributes = {"server.address": parts.hostname}
    default_port = {"http": 80, "https": 443}.get(parts.scheme)
    if port or default_port:
        attributes["server.port"] = port or default_port or 0
    return attributes


def _request_attributes(envelope: Mapping[str, Any]) -> Attributes:
    attributes: Attributes = {}
    if envelope.get("stream") is True:
        attributes["gen_ai.request.stream"] = True
    # The Responses API's names, then Chat Completions' (a gateway's Chat envelope).
    for key, name in (
        ("max_output_tokens", "gen_ai.request.max_tokens"),
        ("max_completion_tokens", "gen_ai.request.max_tokens"),
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("top_k", "gen_ai.request.top_k"),
        ("frequency_penalty", "gen_ai.request.frequency_penalty"),
        ("presence_penalty", "gen_ai.request.presence_penalty"),
        ("seed", "gen_ai.request.seed"),
    ):
        value = envelope.get(key)
        if name in attributes or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            attributes[name] = value
    choices = envelope.get("n")
    if isinstance(choices, int) and not isinstance(choices, bool) and choices != 1:
        attributes["gen_ai.request.choice.count"] = choices
    stop = envelope.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and stop and all(isinstance(one, str) for one in stop):
        attributes["gen_ai.request.stop_sequences"] = list(stop)
    return attributes


def plan_trace(
    trace: state_pb2.RolloutTrace, details: BundleDetails, *, include_content: bool = False
) -> TracePlan:
    """The spans of a reduced trace: an `invoke_agent` span per thread, a `turn` span per turn,
    a `chat {model}` span per inference call and an `execute_tool {name}` span per tool call."""
    return _Planner(trace, details, include_content).plan()
