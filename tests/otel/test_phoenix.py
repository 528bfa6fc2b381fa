"""End to end: `trace-reducer export-otlp` into a real Arize Phoenix, read back through its API."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from google.protobuf import timestamp_pb2

from tests.otel.conftest import (
    DISCARDED_TEXT,
    FIRST_ANSWER,
    FIRST_PROMPT,
    INSTRUCTIONS,
    KEPT_ANSWER,
    Bundles,
    Phoenix,
)
from tests.otel.test_cli import export_cli
from trace_reducer import replay_bundle

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROJECT = "rollout-trace-export"
# Phoenix takes spans in a queue and writes them in the background.
INGEST_SECONDS = 60.0

Span = dict[str, Any]


async def phoenix_spans(client: httpx.AsyncClient, trace_id: str) -> list[Span]:
    reply = await client.get(
        f"/v1/projects/{PROJECT}/spans", params={"trace_id": trace_id, "limit": 1000}
    )
    if reply.status_code == 404:  # the project appears with its first span
        return []
    reply.raise_for_status()
    data: list[Span] = reply.json()["data"]
    return data


async def wait_for_spans(client: httpx.AsyncClient, trace_id: str, count: int) -> list[Span]:
    deadline = time.monotonic() + INGEST_SECONDS
    while True:
        spans = await phoenix_spans(client, trace_id)
        if len(spans) >= count:
            return spans
        assert time.monotonic() < deadline, f"phoenix has {len(spans)} of {count} spans"
        await asyncio.sleep(0.2)


def when(stamp: timestamp_pb2.Timestamp) -> datetime:
    return stamp.ToDatetime(tzinfo=UTC)


def phoenix_time(text: str) -> datetime:
    return datetime.fromisoformat(text)


async def test_phoenix_shows_the_exported_rollouts(bundles: Bundles, phoenix: Phoenix) -> None:
    conversation = replay_bundle(bundles.conversation)
    retried = replay_bundle(bundles.retried)
    # The standard variable names the Phoenix project, as a user would set it.
    env = {"OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}"}
    grpc_args = ["--endpoint", phoenix.grpc_endpoint, "--include-content"]
    # Exported twice: the span ids repeat, so Phoenix keeps one copy.
    for _ in range(2):
        run = await export_cli(str(bundles.conversation), *grpc_args, **env)
        assert (run.code, run.stderr) == (0, ""), run.stderr
    http_args = ["--protocol", "http/protobuf", "--endpoint", phoenix.url]
    run = await export_cli(str(bundles.retried), *http_args, **env)
    assert (run.code, run.stderr) == (0, ""), run.stderr

    async with httpx.AsyncClient(base_url=phoenix.url, timeout=10) as client:
        retried_spans = await wait_for_spans(client, retried.trace_id, 4)
        spans = await wait_for_spans(client, conversation.trace_id, 5)
        # Sent after both copies of the conversation, the retried trace is in; the
        # conversation still has each span once.
        assert len(await phoenix_spans(client, conversation.trace_id)) == 5

    by_id = {span["context"]["span_id"]: span for span in spans}
    [root] = [span for span in spans if span["parent_id"] is None]
    [thread] = conversation.threads.values()
    assert (root["name"], root["span_kind"]) == ("invoke_agent", "AGENT")
    assert root["attributes"]["session.id"] == thread.thread_id
    assert root["attributes"]["rollout.recording.complete"] is True
    assert phoenix_time(root["start_time"]) == when(thread.execution.started_at)
    assert phoenix_time(root["end_time"]) == when(thread.execution.ended_at)

    turns = sorted(
        (span for span in spans if span["name"] == "turn"),
        key=lambda span: span["attributes"]["rollout.turn.index"],
    )
    assert [turn["parent_id"] for turn in turns] == [root["context"]["span_id"]] * 2
    chats = {
        by_id[span["parent_id"]]["attributes"]["rollout.turn.index"]: span
        for span in spans
        if span["name"] == "chat test-model"
    }
    assert sorted(chats) == [1, 2]

    first = chats[1]["attributes"]
    assert chats[1]["span_kind"] == "LLM"
    assert chats[1]["status_code"] == "UNSET"
    assert first["llm.model_name"] == "test-model"
    assert first["llm.input_messages.0.message.role"] == "system"
    assert first["llm.input_messages.0.message.content"] == INSTRUCTIONS
    assert first["llm.input_messages.1.message.content"] == FIRST_PROMPT
    assert first["llm.output_messages.0.message.content"] == FIRST_ANSWER
    assert (first["llm.token_count.prompt"], first["llm.token_count.completion"]) == (3, 2)
    assert first["gen_ai.response.id"] == "resp-first"

    second = chats[2]
    assert second["attributes"]["llm.output_messages.0.message.content"] == KEPT_ANSWER
    assert second["attributes"]["llm.finish_reason"] == "error"
    assert second["attributes"]["rollout.execution.status"] == "CANCELLED"
    assert DISCARDED_TEXT not in str(second["attributes"])
    assert [event["name"] for event in second["events"]] == [
        "rollout.interrupt",
        "rollout.output_discarded",
    ]
    discarded = second["events"][1]["attributes"]
    assert discarded["rollout.output.partial_text"] == DISCARDED_TEXT
    assert turns[1]["events"][0]["attributes"]["rollout.interrupt.requested_by"].startswith(
        "ipv4:127.0.0.1:"
    )

    failed = [span for span in retried_spans if span["status_code"] == "ERROR"]
    assert [span["name"] for span in failed] == ["chat test-model"]
    assert failed[0]["status_message"] == "provider answered HTTP 503: overloaded"
    assert failed[0]["attributes"]["error.type"] == "server_overloaded"
    assert failed[0]["attributes"]["rollout.inference_call.attempt"] == 1
