"""serve --otlp-endpoint: each turn's spans reach a real OTLP receiver as the turn ends."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra (make test installs it)")

import grpc
from opentelemetry import trace as trace_api

from agent_server import AgentServer, Settings
from agent_server.telemetry import REGISTRY
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout_client import AgentClient
from tests.otel.test_cli import Received, grpc_receiver
from trace_reducer.export._otel import bundle_spans

_WAIT = 20.0


async def _until(received: Received, condition: str) -> list[tuple[str, str]]:
    """The spans received once one named `condition` is among them (bounded wait)."""
    deadline = time.monotonic() + _WAIT
    while not any(name == condition for _, name in received.spans()):
        assert time.monotonic() < deadline, f"no {condition!r} span arrived: {received.spans()}"
        await asyncio.sleep(0.02)
    return received.spans()


def _exporting(trace_root: Path, endpoint: str, protocol: str) -> Settings:
    return Settings(
        listen="127.0.0.1:0",
        trace_root=trace_root,
        local_word_delay=0,
        otlp_endpoint=endpoint,
        otlp_protocol=protocol,
    )


def _dropped(reason: str) -> float:
    value = REGISTRY.get_sample_value("rollout_agent_otlp_spans_dropped_total", {"reason": reason})
    return value or 0.0


async def test_each_turn_goes_out_as_it_ends_and_the_thread_span_at_its_close(
    tmp_path: Path,
) -> None:
    async with grpc_receiver() as (url, received):
        server = await AgentServer.start(_exporting(tmp_path, url, "grpc"))
        try:
            async with AgentClient(server.address) as client:
                thread = await client.start_thread()
                await thread.run_turn("Hello").wait()
                # The turn's spans arrive while the thread is still open; its own span does not.
                first = await _until(received, "turn")
                assert all(not name.startswith("invoke_agent") for _, name in first)
                await thread.run_turn("Again").wait()
                deadline = time.monotonic() + _WAIT
                while sum(name == "turn" for _, name in received.spans()) < 2:
                    assert time.monotonic() < deadline, received.spans()
                    await asyncio.sleep(0.02)
                closed = await thread.close()
                await _until(received, "invoke_agent")
        finally:
            await server.stop()
    # The very spans `trace-reducer export-otlp` makes of the bundle, each sent once.
    _, planned = bundle_spans(closed.bundle_path)
    expected = sorted(
        (trace_api.format_trace_id(span.context.trace_id), span.name)
        for span in planned
        if span.context is not None
    )
    assert sorted(received.spans()) == expected
    assert len({trace_id for trace_id, _ in expected}) == 1


async def test_a_dead_collector_costs_dropped_spans_never_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "500")  # milliseconds
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    before = _dropped("export failed")
    server = await AgentServer.start(_exporting(tmp_path, dead, "http/protobuf"))
    try:
        async with AgentClient(server.address) as client:
            thread = await client.start_thread()
            turn = await thread.run_turn("Hello").wait()
            assert turn.status == agent_pb2.TURN_STATUS_COMPLETED
            await thread.close()
    finally:
        # Shutting down waits for the queued spans' last attempt.
        await server.stop()
    assert _dropped("export failed") > before
    assert any("live export: dropped" in record.getMessage() for record in caplog.records)


_REMOTE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
_REMOTE_SPAN = "00f067aa0ba902b7"


async def test_a_traceparent_on_start_turn_parents_the_turn_live_and_in_export_otlp(
    tmp_path: Path,
) -> None:
    async with grpc_receiver() as (url, received):
        server = await AgentServer.start(_exporting(tmp_path, url, "grpc"))
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
                parents = (f"00-{_REMOTE_TRACE}-{_REMOTE_SPAN}-01", "00-not-a-traceparent-01")
                for traceparent in parents:
                    events = stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id))
                    turn = await stub.StartTurn(
                        agent_pb2.StartTurnRequest(
                            thread_id=thread.id, input=[agent_pb2.UserInput(text="Hi")]
                        ),
                        metadata=(("traceparent", traceparent),),
                    )
                    async for reply in events:
                        ended = reply.event.WhichOneof("kind") == "turn_completed"
                        if ended and reply.event.turn_id == turn.turn.id:
                            break
                    events.cancel()
                closed = await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
                await _until(received, "invoke_agent")
        finally:
            await server.stop()
    sent = [
        span
        for request in received.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    turns = [span for span in sent if span.name == "turn"]
    assert len(turns) == 2
    remote = next(span for span in turns if span.trace_id.hex() == _REMOTE_TRACE)
    assert remote.parent_span_id.hex() == _REMOTE_SPAN
    # The spans under the turn (its chat call) joined the caller's trace with it.
    assert any(
        span.parent_span_id == remote.span_id and span.trace_id == remote.trace_id for span in sent
    )
    # The invalid one was left out: that turn stays in the bundle's trace, under its thread.
    other = next(span for span in turns if span is not remote)
    thread_span = next(span for span in sent if span.name == "invoke_agent")
    assert other.trace_id == thread_span.trace_id
    assert other.parent_span_id == thread_span.span_id
    # export-otlp makes the same parent from the bundle.
    _, planned = bundle_spans(closed.thread.bundle_path)
    exported = [span for span in planned if span.name == "turn" and span.parent is not None]
    assert {
        (
            trace_api.format_trace_id(span.parent.trace_id),
            trace_api.format_span_id(span.parent.span_id),
        )
        for span in exported
        if span.parent is not None and span.parent.is_remote
    } == {(_REMOTE_TRACE, _REMOTE_SPAN)}
