"""Provider faults: each ends in the right status, retried per policy, nothing accepted lost."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent_server.config import Secret
from agent_server.provider import _retry_after
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.scripted_provider import (
    RESET,
    Reply,
    ScriptedProvider,
    answer,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from trace_reducer import read_bundle

FAILED = common_pb2.EXECUTION_STATUS_FAILED
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED


async def run_turn(agent: Harness) -> tuple[agent_pb2.Turn, list[agent_pb2.ThreadEvent], str]:
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    turn = await agent.start_turn(thread.id, "hello")
    final = await events.turn_completed(turn.id)
    return final, events.events, thread.id


async def reduced(agent: Harness) -> state_pb2.RolloutTrace:
    await agent.server.stop()
    [bundle] = agent.bundles()
    rollout = await reduce_with_cli(bundle)
    assert rollout.recording_complete
    return rollout


def calls_in_order(rollout: state_pb2.RolloutTrace) -> list[state_pb2.InferenceCall]:
    [turn] = rollout.turns.values()
    return [rollout.inference_calls[call_id] for call_id in turn.inference_call_ids]


def errors(events: list[agent_pb2.ThreadEvent]) -> list[tuple[str, bool]]:
    return [(e.error.code, e.error.will_retry) for e in events if e.HasField("error")]


async def test_server_errors_are_retried_as_new_calls(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_retries=2)
    provider.queue_error(500)
    provider.queue_error(429, headers={"Retry-After": "0"})
    provider.queue(answer("finally"))
    final, events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert errors(events) == [("server_error", True), ("server_error", True)]

    calls = calls_in_order(await reduced(agent))
    assert [(c.attempt, c.execution.status) for c in calls] == [
        (1, FAILED),
        (2, FAILED),
        (3, COMPLETED),
    ]
    assert [c.error.http_status for c in calls] == [500, 429, 0]
    header_ids = [r.headers["x-rollout-inference-call-id"] for r in provider.requests]
    assert header_ids == [c.inference_call_id for c in calls]
    assert len(set(header_ids)) == 3
    # Every attempt sent the same input.
    assert len({json.dumps(json.loads(r.body)["input"]) for r in provider.requests}) == 1


async def test_retries_are_bounded(provider: ScriptedProvider, start_agent: StartAgent) -> None:
    agent = await start_agent(max_retries=1)
    provider.queue_error(503)
    provider.queue_error(503, {"error": {"message": "overloaded", "code": "overloaded"}})
    final, events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert (final.error.code, final.error.http_status) == ("overloaded", 503)
    assert "overloaded" in final.error.message
    assert errors(events) == [("server_error", True), ("overloaded", False)]
    assert [c.execution.status for c in calls_in_order(await reduced(agent))] == [FAILED] * 2


async def test_client_errors_are_not_retried(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_retries=3)
    provider.queue_error(400, {"error": {"message": "bad model", "code": "model_not_found"}})
    final, _events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert (final.error.code, final.error.http_status) == ("model_not_found", 400)
    assert len(provider.requests) == 1


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b'{"error": {"message": "bad \\ud800 value", "code": "x"}}', "x", "bad \ufffd value"),
        (b'{"error": {"message": "bad", "code": "\\udc00"}}', "\ufffd", "bad"),
        (b'{"error": {"message": "a\xed\xa0\x80b", "code": "x"}}', "x", "a\ufffdb"),
        (b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "http_400", "[[["),
    ],
    ids=["escaped-surrogate", "surrogate-code", "surrogate-bytes", "nested-100000"],
)
async def test_an_error_body_of_any_shape_fails_the_turn_with_its_status(
    provider: ScriptedProvider, start_agent: StartAgent, body: bytes, code: str, message: str
) -> None:
    # Was: the turn FAILED `internal` ("internal error: UnicodeEncodeError" / RecursionError),
    # the provider's 400 and its message lost; through the gateway, a 500 for the 400.
    agent = await start_agent(max_retries=3)
    provider.replies.append(Reply(status=400, body=body))
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert (final.error.code, final.error.http_status) == (code, 400)
    assert message in final.error.message
    [call] = calls_in_order(await reduced(agent))
    assert (call.execution.status, call.error.code) == (FAILED, code)


async def test_malformed_event_fails_the_attempt(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_retries=3)
    provider.queue(sse(created()) + "data: {not json\n\n")
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "malformed_event"
    [call] = calls_in_order(await reduced(agent))
    assert call.execution.status == FAILED
    assert len(provider.requests) == 1


async def test_stream_ending_without_terminal_event(
    agent: Harness, provider: ScriptedProvider
) -> None:
    item = message("kept", "msg-kept")
    provider.queue(sse(created(), item_added(item), item_done(item)))
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "stream_ended"
    [call] = calls_in_order(await reduced(agent))
    assert call.execution.status == FAILED
    assert len(call.response_item_ids) == 1
    # A Responses stream has no choices: no word of them.
    assert call.error.message == "the provider stream ended without a terminal event"


async def test_reset_after_accepted_output_keeps_it_and_is_not_retried(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_retries=3)
    item = message("kept", "msg-kept")
    provider.queue(
        sse(created(), item_added(item), text_delta("kept"), item_done(item)),
        sse(item_added(message("", "msg-lost")), text_delta("lost")),
        RESET,
    )
    final, events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "connection_error"
    assert errors(events) == [("connection_error", False)]
    rollout = await reduced(agent)
    [call] = calls_in_order(rollout)
    assert call.execution.status == FAILED
    [output_id] = call.response_item_ids
    assert rollout.conversation_items[output_id].responses_item_id == "msg-kept"
    assert [d.provider_item_id for d in call.discarded_outputs] == ["msg-lost"]
    assert len(provider.requests) == 1


async def test_reset_before_any_output_is_retried(
    provider: ScriptedProvider, start_agent: StartAgent
) -> None:
    agent = await start_agent(max_retries=1)
    provider.queue(sse(created()), RESET)
    provider.queue(answer("second try"))
    final, events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert errors(events) == [("connection_error", True)]


async def test_idle_stream_times_out(provider: ScriptedProvider, start_agent: StartAgent) -> None:
    agent = await start_agent(stream_idle_timeout=0.2)
    provider.queue(sse(created()), asyncio.Event())
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "stream_idle_timeout"


async def test_incomplete_and_error_events_fail_the_turn(
    provider: ScriptedProvider, agent: Harness
) -> None:
    # Withheld by a filter (not cut at the output limit, which is an answer: see
    # test_training_tokens), the response fails the turn.
    provider.queue(
        sse(
            created(),
            {
                "type": "response.incomplete",
                "response": {"id": "resp-1", "incomplete_details": {"reason": "content_filter"}},
            },
        )
    )
    provider.queue(sse({"type": "error", "code": "rate_limit_exceeded", "message": "slow down"}))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    first = await agent.start_turn(thread.id, "one")
    incomplete = await events.turn_completed(first.id)
    assert incomplete.status == agent_pb2.TURN_STATUS_FAILED
    assert incomplete.error.code == "response_incomplete"
    assert "content_filter" in incomplete.error.message
    second = await agent.start_turn(thread.id, "two")
    error = await events.turn_completed(second.id)
    assert (error.error.code, error.error.message) == ("rate_limit_exceeded", "slow down")
    rollout = await reduced(agent)
    statuses = [c.execution.status for c in rollout.inference_calls.values()]
    assert statuses == [FAILED, FAILED]
    reasons = sorted(c.end_reason for c in rollout.inference_calls.values())
    assert reasons == ["error", "response.incomplete"]


async def test_the_api_key_is_sent_as_a_header_and_written_nowhere(
    provider: ScriptedProvider, start_agent: StartAgent, caplog: pytest.LogCaptureFixture
) -> None:
    key = "sk-test-in-process-SECRET-4242"
    agent = await start_agent(api_key=Secret(key), max_retries=1)
    provider.queue_error(401, {"error": {"message": "invalid key", "code": "invalid_api_key"}})
    provider.queue_error(500)
    provider.queue(sse(created()) + "data: {broken\n\n")
    with caplog.at_level(logging.DEBUG):
        final, _, thread_id = await run_turn(agent)
        assert final.status == agent_pb2.TURN_STATUS_FAILED
        retried = await agent.start_turn(thread_id, "again")
        assert (await agent.logs[0].turn_completed(retried.id)).error.code == "malformed_event"
        reply = await agent.stub.GetThread(agent_pb2.GetThreadRequest(thread_id=thread_id))
        await agent.server.stop()
    assert [r.headers["authorization"] for r in provider.requests] == [f"Bearer {key}"] * 3
    [bundle] = agent.bundles()
    outputs = [
        *(path.read_bytes() for path in bundle.rglob("*") if path.is_file()),
        reply.SerializeToString(),
        *(event.SerializeToString() for event in agent.logs[0].events),
        *(caplog.text.encode(), *(record.getMessage().encode() for record in caplog.records)),
        *(request.body for request in provider.requests),
    ]
    assert all(key.encode() not in output for output in outputs)


@pytest.mark.parametrize("status", [429, 503])
async def test_retry_after_is_honoured_over_the_backoff(
    provider: ScriptedProvider, start_agent: StartAgent, status: int
) -> None:
    # With an hour of back-off, only honouring Retry-After lets the retry come in time.
    agent = await start_agent(max_retries=1, retry_base_delay=3600.0)
    provider.queue_error(status, headers={"Retry-After": "0"})
    provider.queue(answer("after waiting as told"))
    final, events, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_COMPLETED
    assert [will_retry for _, will_retry in errors(events)] == [True]
    assert len(provider.requests) == 2


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("2", 2.0),
        (" 1.5 ", 1.5),
        ("-1", None),
        ("nan", None),
        ("soon", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),
        ("99999999", 600.0),
    ],
)
def test_retry_after_header_forms(header: str, expected: float | None) -> None:
    assert _retry_after(header) == expected


def test_retry_after_http_date_in_the_future() -> None:
    later = datetime.now(UTC) + timedelta(seconds=120)
    seconds = _retry_after(email.utils.format_datetime(later, usegmt=True))
    assert seconds is not None
    assert 100 < seconds <= 120


async def test_unknown_event_types_are_recorded_and_ignored(
    provider: ScriptedProvider, agent: Harness
) -> None:
    item = message("still fine", "msg-fine")
    unknown: list[dict[str, Any]] = [
        {"type": "response.in_progress", "response": {"id": "resp-1"}},
        {"type": "response.reasoning_summary_text.delta", "delta": "thinking"},
        {"type": "response.some_future_event", "payload": {"x": 1}},
    ]
    provider.queue(
        sse(created(), unknown[0], item_added(item), unknown[1], text_delta("still fine"))
        + sse(unknown[2], item_done(item), {"type": "response.completed", "response": {"id": "r"}})
    )
    provider.queue(answer("and the next turn too"))
    thread = await agent.start_thread()
    events = agent.events(thread.id)
    for text in ("one", "two"):
        turn = await agent.start_turn(thread.id, text)
        assert (await events.turn_completed(turn.id)).status == agent_pb2.TURN_STATUS_COMPLETED
    assert not [e for e in events.events if e.HasField("error")]
    await agent.server.stop()
    [bundle] = agent.bundles()
    with read_bundle(bundle) as reader:
        raw = [
            (r.provider_event.event_type, json.loads(r.provider_event.data))
            for r in reader
            if r.HasField("provider_event")
        ]
    for event in unknown:
        assert (event["type"], event) in raw
    rollout = await reduce_with_cli(bundle)
    assert len(rollout.conversation_items) == 4


async def test_a_refused_connection_says_refused(start_agent: StartAgent) -> None:
    # A port nothing listens on: bound, then closed, so the kernel refuses at once.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = await start_agent(provider_url=f"http://127.0.0.1:{port}/v1")
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    assert final.error.code == "connection_error"
    assert final.error.message == (
        f"provider connection failed: cannot connect to 127.0.0.1:{port}: connection refused"
    )
    assert "timed out" not in final.error.message
    assert "ssl" not in final.error.message


@pytest.mark.parametrize("path", ["", "/v1"])
async def test_a_404_from_a_provider_url_without_a_path_says_to_add_v1(
    provider: ScriptedProvider, start_agent: StartAgent, path: str
) -> None:
    # Was `provider answered HTTP 404: {"detail":"Not Found"}` alone: vLLM's answer to
    # --provider-url http://HOST:8000, which `vllm serve` prints, its API being under /v1.
    agent = await start_agent(provider_url=provider.url + path, max_retries=0)
    provider.replies.append(Reply(status=404, body=b'{"detail":"Not Found"}'))
    final, _, _ = await run_turn(agent)
    assert final.status == agent_pb2.TURN_STATUS_FAILED
    said = 'provider answered HTTP 404: {"detail":"Not Found"}'
    if not path:
        said += (
            f"; the provider URL {provider.url} has no path, and an OpenAI-compatible server "
            f"serves under /v1: give {provider.url}/v1"
        )
    assert (final.error.http_status, final.error.message) == (404, said)
    [call] = calls_in_order(await reduced(agent))
    assert call.error.message == said
