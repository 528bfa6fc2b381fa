"""Every span, attribute, status and event of bundles the agent server recorded, read back from
the SDK's in-memory span exporter."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (make test installs it)")

from google.protobuf import timestamp_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.scripted_provider import ScriptedProvider
from tests.otel.conftest import (
    DISCARDED_TEXT,
    FIRST_ANSWER,
    FIRST_PROMPT,
    INSTRUCTIONS,
    KEPT_ANSWER,
    RETRIED_ANSWER,
    SECOND_PROMPT,
    Bundles,
    truncate_inside,
)
from trace_reducer import export_otlp, replay_bundle
from trace_reducer.export._genai import BundleDetails, plan_trace
from trace_reducer.export._otel import plan_spans

CONTENT_KEYS = {
    "gen_ai.system_instructions",
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.definitions",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}


def export(bundle: Path, *, include_content: bool = False) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    [result] = export_otlp([bundle], exporter=exporter, include_content=include_content)
    spans = list(exporter.get_finished_spans())
    assert result.spans == len(spans)
    return spans


def ns(stamp: timestamp_pb2.Timestamp) -> int:
    return stamp.seconds * 1_000_000_000 + stamp.nanos


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan) -> list[tuple[str, int, dict[str, Any]]]:
    return [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events]


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if parent_id(s) == span_id(parent)]


def by_attribute(spans: Sequence[ReadableSpan], key: str, value: str) -> ReadableSpan:
    [span] = [s for s in spans if attributes(s).get(key) == value]
    return span


def assert_window(span: ReadableSpan, execution: state_pb2.Execution) -> None:
    assert (span.start_time, span.end_time) == (
        ns(execution.started_at),
        ns(execution.ended_at),
    )


def messages(span: ReadableSpan, key: str) -> Any:
    return json.loads(str(attributes(span)[key]))


def provider_port(provider: ScriptedProvider) -> int:
    port = urlsplit(provider.url).port
    assert port is not None
    return port


# -- the four recorded scenarios --------------------------------------------------------------


async def test_completed_turn(bundles: Bundles, provider: ScriptedProvider) -> None:
    before_export = time.time_ns()
    spans = export(bundles.conversation)
    state = replay_bundle(bundles.conversation)
    [thread] = state.threads.values()
    first = state.turns[thread.turn_ids[0]]
    [call] = [state.inference_calls[c] for c in first.inference_call_ids]

    assert len(spans) == 5
    [root] = [s for s in spans if s.parent is None]
    assert root.name == "invoke_agent"
    assert root.kind == SpanKind.INTERNAL
    assert root.context is not None
    # The bundle's own trace id, so the backend finds the trace by the id the bundle shows.
    assert format(root.context.trace_id, "032x") == state.trace_id
    assert {s.context.trace_id for s in spans if s.context} == {root.context.trace_id}
    assert attributes(root) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai",
        "gen_ai.conversation.id": thread.thread_id,
        "gen_ai.request.model": "test-model",
        "rollout.trace_id": state.trace_id,
        "rollout.thread.id": thread.thread_id,
        "rollout.recording.complete": True,
        "rollout.integrity.status": "CLEAN",
        "rollout.thread.metadata.suite": "otel",
        "rollout.execution.status": "COMPLETED",
    }
    assert root.status.status_code == StatusCode.UNSET
    assert root.events == ()
    assert_window(root, thread.execution)
    # The times the bundle recorded, not the time of the export.
    assert root.end_time is not None
    assert root.end_time < before_export
    assert root.resource.attributes["service.name"] == "rollout-trace agent-server"

    turn_spans = children(spans, root)
    assert [attributes(s)["rollout.turn.id"] for s in turn_spans] == list(thread.turn_ids)
    turn = turn_spans[0]
    assert (turn.name, turn.kind) == ("turn", SpanKind.INTERNAL)
    assert attributes(turn) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.conversation.id": thread.thread_id,
        "rollout.turn.id": first.turn_id,
        "rollout.turn.index": 1,
        "rollout.execution.status": "COMPLETED",
    }
    assert turn.status.status_code == StatusCode.UNSET
    assert turn.events == ()
    assert_window(turn, first.execution)

    [chat] = children(spans, turn)
    assert (chat.name, chat.kind) == ("chat test-model", SpanKind.CLIENT)
    chat_attributes = attributes(chat)
    # Streamed: the first chunk came after the request went out and before the call ended.
    first_chunk = chat_attributes.pop("gen_ai.response.time_to_first_chunk")
    assert chat.start_time is not None
    assert chat.end_time is not None
    assert 0 <= first_chunk <= (chat.end_time - chat.start_time) / 1e9
    assert chat_attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "test-model",
        "gen_ai.conversation.id": thread.thread_id,
        "gen_ai.request.stream": True,
        "gen_ai.response.id": "resp-first",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 2,
        "server.address": "127.0.0.1",
        "server.port": provider_port(provider),
        "rollout.inference_call.id": call.inference_call_id,
        "rollout.inference_call.attempt": 1,
        "rollout.inference_call.end_reason": "response.completed",
        "rollout.execution.status": "COMPLETED",
    }
    assert chat.status.status_code == StatusCode.UNSET
    assert chat.events == ()
    assert_window(chat, call.execution)

    content = export(bundles.conversation, include_content=True)
    chat = by_attribute(content, "rollout.inference_call.id", call.inference_call_id)
    system = [{"type": "text", "content": INSTRUCTIONS}]
    assert messages(chat, "gen_ai.system_instructions") == system
    assert messages(chat, "gen_ai.input.messages") == [
        {"role": "user", "parts": [{"type": "text", "content": FIRST_PROMPT}]}
    ]
    assert messages(chat, "gen_ai.output.messages") == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": FIRST_ANSWER}],
            "finish_reason": "stop",
        }
    ]
    [root] = [s for s in content if s.parent is None]
    assert messages(root, "gen_ai.system_instructions") == system


async def test_interrupted_turn(bundles: Bundles) -> None:
    spans = export(bundles.conversation)
    state = replay_bundle(bundles.conversation)
    [thread] = state.threads.values()
    second = state.turns[thread.turn_ids[1]]
    [call] = [state.inference_calls[c] for c in second.inference_call_ids]
    assert second.execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    requested_by = second.interrupt.requested_by
    assert requested_by.startswith("ipv4:127.0.0.1:")
    interrupt = (
        "rollout.interrupt",
        ns(second.interrupt.requested_at),
        {"rollout.interrupt.requested_by": requested_by},
    )

    turn = by_attribute(spans, "rollout.turn.id", second.turn_id)
    assert attributes(turn) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.conversation.id": thread.thread_id,
        "rollout.turn.id": second.turn_id,
        "rollout.turn.index": 2,
        "rollout.execution.status": "CANCELLED",
    }
    # A cancel is what the client asked for, not a failure.
    assert turn.status.status_code == StatusCode.UNSET
    assert events(turn) == [interrupt]
    assert_window(turn, second.execution)

    [chat] = children(spans, turn)
    chat_attributes = attributes(chat)
    assert chat_attributes["gen_ai.response.id"] == "resp-second"
    # The conventions: no final event received (cancelled) is reported as `error`.
    assert chat_attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert chat_attributes["rollout.execution.status"] == "CANCELLED"
    assert chat_attributes["rollout.inference_call.end_reason"] == "interrupted"
    assert "gen_ai.usage.input_tokens" not in chat_attributes
    assert "error.type" not in chat_attributes
    assert chat.status.status_code == StatusCode.UNSET
    discarded = (
        "rollout.output_discarded",
        ns(call.execution.ended_at),
        {
            "rollout.output.provider_item_id": "msg-partial",
            "rollout.output.item_type": "message",
            "rollout.output.partial_chars": len(DISCARDED_TEXT),
        },
    )
    assert events(chat) == [interrupt, discarded]
    assert_window(chat, call.execution)

    # With content: the accepted item is the output message; the partial text is only in the
    # discarded-output event.
    content = export(bundles.conversation, include_content=True)
    chat = by_attribute(content, "rollout.inference_call.id", call.inference_call_id)
    assert messages(chat, "gen_ai.output.messages") == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": KEPT_ANSWER}],
            "finish_reason": "error",
        }
    ]
    assert messages(chat, "gen_ai.input.messages") == [
        {"role": "user", "parts": [{"type": "text", "content": FIRST_PROMPT}]},
        {"role": "assistant", "parts": [{"type": "text", "content": FIRST_ANSWER}]},
        {"role": "user", "parts": [{"type": "text", "content": SECOND_PROMPT}]},
    ]
    assert DISCARDED_TEXT not in str(attributes(chat))
    [_, (name, _, discarded_attributes)] = events(chat)
    assert name == "rollout.output_discarded"
    assert discarded_attributes["rollout.output.partial_text"] == DISCARDED_TEXT


async def test_retried_provider_failure(bundles: Bundles) -> None:
    spans = export(bundles.retried)
    state = replay_bundle(bundles.retried)
    [turn_state] = state.turns.values()
    failed, answered = (state.inference_calls[c] for c in turn_state.inference_call_ids)
    assert (failed.attempt, answered.attempt) == (1, 2)

    [root] = [s for s in spans if s.parent is None]
    # The server's shutdown ended the thread: cancelled, not failed.
    assert attributes(root)["rollout.execution.status"] == "CANCELLED"
    assert root.status.status_code == StatusCode.UNSET
    [turn] = children(spans, root)
    assert turn.status.status_code == StatusCode.UNSET
    assert attributes(turn)["rollout.execution.status"] == "COMPLETED"
    first, second = children(spans, turn)
    assert first.name == second.name == "chat test-model"

    first_attributes = attributes(first)
    assert first.status.status_code == StatusCode.ERROR
    assert first.status.description == "provider answered HTTP 503: overloaded"
    assert first_attributes["error.type"] == "server_overloaded"
    assert first_attributes["http.response.status_code"] == 503
    assert first_attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert first_attributes["rollout.inference_call.attempt"] == 1
    assert first_attributes["rollout.inference_call.id"] == failed.inference_call_id
    assert first_attributes["rollout.execution.status"] == "FAILED"
    assert "gen_ai.response.id" not in first_attributes
    assert first.events == ()
    assert_window(first, failed.execution)

    second_attributes = attributes(second)
    assert second.status.status_code == StatusCode.UNSET
    assert "error.type" not in second_attributes
    assert second_attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert second_attributes["gen_ai.response.id"] == "resp-retried"
    assert second_attributes["rollout.inference_call.attempt"] == 2
    assert second_attributes["rollout.execution.status"] == "COMPLETED"
    assert_window(second, answered.execution)
    assert first.end_time is not None
    assert second.start_time is not None
    assert first.end_time <= second.start_time

    content = export(bundles.retried, include_content=True)
    second = by_attribute(content, "rollout.inference_call.id", answered.inference_call_id)
    [output] = messages(second, "gen_ai.output.messages")
    assert output["parts"] == [{"type": "text", "content": RETRIED_ANSWER}]


async def test_truncated_bundle(bundles: Bundles, tmp_path: Path) -> None:
    # The file ends inside the record that would have ended the first call.
    bundle = truncate_inside(bundles.conversation, "inference_ended", tmp_path / "truncated")
    state = replay_bundle(bundle)
    assert state.integrity.status == state_pb2.INTEGRITY_STATUS_TRUNCATED
    spans = export(bundle, include_content=True)

    assert len(spans) == 3
    [root] = [s for s in spans if s.parent is None]
    [turn] = children(spans, root)
    [chat] = children(spans, turn)
    recording_end = ns(state.ended_at)
    ended = (
        "rollout.recording_ended",
        recording_end,
        {
            "rollout.integrity.status": "TRUNCATED",
            "rollout.integrity.detail": state.integrity.detail,
        },
    )
    for span in (root, turn, chat):
        # Nothing ended: each span stops where the recording does, and says so.
        assert attributes(span)["rollout.execution.status"] == "RUNNING"
        assert span.status.status_code == StatusCode.UNSET
        assert span.end_time == recording_end
        assert events(span) == [ended]
    assert attributes(root)["rollout.recording.complete"] is False
    assert attributes(root)["rollout.integrity.status"] == "TRUNCATED"
    assert attributes(root)["rollout.integrity.detail"] == state.integrity.detail
    assert attributes(chat)["gen_ai.response.finish_reasons"] == ("error",)
    # What was accepted before the damage is still the output.
    [output] = messages(chat, "gen_ai.output.messages")
    assert output["parts"] == [{"type": "text", "content": FIRST_ANSWER}]


# -- ids, content ----------------------------------------------------------------------------


def _identity(spans: Sequence[ReadableSpan]) -> list[tuple[Any, ...]]:
    return sorted(
        (span.context.trace_id if span.context else 0, span_id(span), parent_id(span), span.name)
        for span in spans
    )


async def test_ids_come_from_the_bundle(bundles: Bundles) -> None:
    once = export(bundles.conversation)
    again = export(bundles.conversation)
    assert _identity(once) == _identity(again)
    assert [attributes(s) for s in once] == [attributes(s) for s in again]
    assert len({span_id(s) for s in once}) == len(once)
    other = export(bundles.retried)
    assert not {span_id(s) for s in once} & {span_id(s) for s in other}
    assert {s.context.trace_id for s in once if s.context} != {
        s.context.trace_id for s in other if s.context
    }


async def test_content_only_when_asked(bundles: Bundles) -> None:
    texts = [
        INSTRUCTIONS,
        FIRST_PROMPT,
        FIRST_ANSWER,
        SECOND_PROMPT,
        KEPT_ANSWER,
        DISCARDED_TEXT,
        RETRIED_ANSWER,
    ]
    for bundle in (bundles.conversation, bundles.retried):
        for span in export(bundle):
            assert not CONTENT_KEYS & set(attributes(span))
            shown = span.to_json()
            assert not [text for text in texts if json.dumps(text)[1:-1] in shown]
    shown = "".join(
        span.to_json()
        for bundle in (bundles.conversation, bundles.retried)
        for span in export(bundle, include_content=True)
    )
    assert [text for text in texts if json.dumps(text)[1:-1] not in shown] == []


# -- tool calls (the agent does not make them yet: a reduced state built by hand) -------------


def _stamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1_000_000_000))
    return stamp


def _execution(
    status: common_pb2.ExecutionStatus.ValueType, start: float, end: float
) -> state_pb2.Execution:
    return state_pb2.Execution(status=status, started_at=_stamp(start), ended_at=_stamp(end))


def _tool_trace() -> state_pb2.RolloutTrace:
    completed = common_pb2.EXECUTION_STATUS_COMPLETED
    trace = state_pb2.RolloutTrace(
        trace_id="9f" * 16,
        root_thread_id="thread-1",
        recording_complete=True,
        integrity=state_pb2.Integrity(status=state_pb2.INTEGRITY_STATUS_CLEAN),
        producer_name="rollout-trace agent-server",
        started_at=_stamp(100),
        ended_at=_stamp(120),
    )
    trace.threads["thread-1"].CopyFrom(
        state_pb2.Thread(
            thread_id="thread-1",
            model="gpt-test",
            execution=_execution(completed, 100, 120),
            turn_ids=["turn-1"],
        )
    )
    trace.turns["turn-1"].CopyFrom(
        state_pb2.Turn(
            turn_id="turn-1",
            thread_id="thread-1",
            execution=_execution(common_pb2.EXECUTION_STATUS_CANCELLED, 101, 119),
            inference_call_ids=["call-1", "call-2"],
            input_item_ids=["item-user"],
            interrupt=state_pb2.Interrupt(
                requested_by="ipv4:127.0.0.1:5000", requested_at=_stamp(118)
            ),
            tool_call_ids=["tool-ok", "tool-error", "tool-cancelled"],
        )
    )
    trace.inference_calls["call-1"].CopyFrom(
        state_pb2.InferenceCall(
            inference_call_id="call-1",
            thread_id="thread-1",
            turn_id="turn-1",
            attempt=1,
            execution=_execution(completed, 102, 104),
            model="gpt-test",
            provider_base_url="https://api.openai.com/v1",
            response_id="resp-tools",
            request_item_ids=["item-user"],
            response_item_ids=["item-call-ok", "item-call-error", "item-call-cancelled"],
        )
    )
    # The call that was sent the tool's result (its answer never came: the turn was cancelled).
    trace.inference_calls["call-2"].CopyFrom(
        state_pb2.InferenceCall(
            inference_call_id="call-2",
            thread_id="thread-1",
            turn_id="turn-1",
            attempt=1,
            execution=_execution(common_pb2.EXECUTION_STATUS_CANCELLED, 110, 119),
            model="gpt-test",
            provider_base_url="https://api.openai.com/v1",
            request_item_ids=["item-user", "item-call-ok", "item-output-ok"],
        )
    )
    items = {
        "item-user": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_USER,
            kind=state_pb2.ITEM_KIND_MESSAGE,
            content=[state_pb2.ContentPart(type="input_text", text="Weather in Paris?")],
        ),
        "item-call-ok": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_ASSISTANT,
            kind=state_pb2.ITEM_KIND_FUNCTION_CALL,
            call_id="call_ok",
            name="get_weather",
            arguments='{"city": "Paris"}',
        ),
        "item-output-ok": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_TOOL,
            kind=state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT,
            call_id="call_ok",
            output="rainy, 14 C",
        ),
        "item-call-error": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_ASSISTANT,
            kind=state_pb2.ITEM_KIND_FUNCTION_CALL,
            call_id="call_error",
            name="get_time",
            arguments="not json",
        ),
        "item-output-error": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_TOOL,
            kind=state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT,
            call_id="call_error",
            output="clock unavailable",
        ),
        "item-call-cancelled": state_pb2.ConversationItem(
            role=state_pb2.CONVERSATION_ROLE_ASSISTANT,
            kind=state_pb2.ITEM_KIND_FUNCTION_CALL,
            call_id="call_cancelled",
            name="book_flight",
            arguments="{}",
        ),
    }
    for item_id, item in items.items():
        item.item_id, item.thread_id, item.turn_id = item_id, "thread-1", "turn-1"
        trace.conversation_items[item_id].CopyFrom(item)
    tools: Mapping[str, tuple[str, str, str, str, common_pb2.ExecutionStatus.ValueType, bool]] = {
        "tool-ok": ("call_ok", "get_weather", "item-call-ok", "item-output-ok", completed, False),
        "tool-error": (
            "call_error",
            "get_time",
            "item-call-error",
            "item-output-error",
            common_pb2.EXECUTION_STATUS_FAILED,
            True,
        ),
        "tool-cancelled": (
            "call_cancelled",
            "book_flight",
            "item-call-cancelled",
            "",
            common_pb2.EXECUTION_STATUS_CANCELLED,
            False,
        ),
    }
    for index, (tool_id, (call_id, name, call_item, output_item, status, is_error)) in enumerate(
        tools.items()
    ):
        trace.tool_calls[tool_id].CopyFrom(
            state_pb2.ToolCall(
                tool_call_id=tool_id,
                call_id=call_id,
                name=name,
                thread_id="thread-1",
                turn_id="turn-1",
                requested_by_inference_call_id="call-1",
                call_item_id=call_item,
                output_item_id=output_item,
                execution=_execution(status, 105 + index, 106 + index),
                is_error=is_error,
                submitted_by="ipv4:127.0.0.1:6000" if output_item else "",
            )
        )
    return trace


@pytest.mark.parametrize("include_content", [False, True])
def test_tool_calls(include_content: bool) -> None:
    trace = _tool_trace()
    spans = plan_spans(plan_trace(trace, BundleDetails(), include_content=include_content))
    [turn] = [s for s in spans if s.name == "turn"]
    tools = {str(attributes(s)["rollout.tool_call.id"]): s for s in children(spans, turn)[2:]}
    assert [s.name for s in children(spans, turn)] == [
        "chat gpt-test",
        "chat gpt-test",
        "execute_tool get_weather",
        "execute_tool get_time",
        "execute_tool book_flight",
    ]
    chat = by_attribute(spans, "rollout.inference_call.id", "call-1")
    answered = by_attribute(spans, "rollout.inference_call.id", "call-2")
    assert attributes(chat)["gen_ai.response.finish_reasons"] == ("tool_call",)
    assert attributes(chat)["gen_ai.provider.name"] == "openai"
    assert (attributes(chat)["server.address"], attributes(chat)["server.port"]) == (
        "api.openai.com",
        443,
    )

    ok = tools["tool-ok"]
    assert ok.kind == SpanKind.INTERNAL
    expected: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "get_weather",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_ok",
        "gen_ai.conversation.id": "thread-1",
        "rollout.tool_call.id": "tool-ok",
        "rollout.tool_call.requested_by": "call-1",
        "rollout.tool_call.submitted_by": "ipv4:127.0.0.1:6000",
        "rollout.execution.status": "COMPLETED",
    }
    if include_content:
        expected["gen_ai.tool.call.arguments"] = '{"city": "Paris"}'
        expected["gen_ai.tool.call.result"] = "rainy, 14 C"
    assert attributes(ok) == expected
    assert ok.status.status_code == StatusCode.UNSET
    assert (ok.start_time, ok.end_time) == (105_000_000_000, 106_000_000_000)

    error = tools["tool-error"]
    assert attributes(error)["error.type"] == "tool_error"
    assert error.status.status_code == StatusCode.ERROR
    # The tool's error text is its output: content.
    assert error.status.description == (
        "clock unavailable" if include_content else "the tool reported an error"
    )
    assert "gen_ai.tool.call.result" not in attributes(error)

    cancelled = tools["tool-cancelled"]
    assert cancelled.status.status_code == StatusCode.UNSET
    assert attributes(cancelled)["rollout.execution.status"] == "CANCELLED"
    assert events(cancelled) == [
        (
            "rollout.interrupt",
            118_000_000_000,
            {"rollout.interrupt.requested_by": "ipv4:127.0.0.1:5000"},
        )
    ]
    assert "rollout.tool_call.submitted_by" not in attributes(cancelled)

    if include_content:
        [output] = messages(chat, "gen_ai.output.messages")
        assert output == {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_ok",
                    "name": "get_weather",
                    "arguments": {"city": "Paris"},
                },
                {
                    "type": "tool_call",
                    "id": "call_error",
                    "name": "get_time",
                    "arguments": "not json",
                },
                {
                    "type": "tool_call",
                    "id": "call_cancelled",
                    "name": "book_flight",
                    "arguments": {},
                },
            ],
            "finish_reason": "tool_call",
        }
        assert messages(answered, "gen_ai.input.messages") == [
            {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "parts": [
                    {
                        "type": "tool_call",
                        "id": "call_ok",
                        "name": "get_weather",
                        "arguments": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "tool",
                "parts": [
                    {"type": "tool_call_response", "id": "call_ok", "response": "rainy, 14 C"}
                ],
            },
        ]
    assert attributes(answered)["gen_ai.response.finish_reasons"] == ("error",)
