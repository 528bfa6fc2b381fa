"""serve --otlp-endpoint: each turn's spans reach a real OTLP receiver as the turn ends."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra (make test installs it)")

from opentelemetry import trace as trace_api

from agent_server import AgentServer, Settings
from agent_server.telemetry import REGISTRY
from rollout.agent.v1 import agent_pb2
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


def _dropped(reason: str) -> float:
    value = REGISTRY.get_sample_value("rollout_agent_otlp_spans_dropped_total", {"reason": reason})
    return value or 0.0


async def test_each_turn_goes_out_as_it_ends_and_the_thread_span_at_its_close(
    tmp_path: Path,
) -> None:
    async with grpc_receiver() as (url, received):
        server = await AgentServer.start(
            Settings(
                listen="127.0.0.1:0",
                trace_root=tmp_path,
                local_word_delay=0,
                otlp_endpoint=url,
                otlp_protocol="grpc",
            )
        )
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
    server = await AgentServer.start(
        Settings(
            listen="127.0.0.1:0",
            trace_root=tmp_path,
            local_word_delay=0,
            otlp_endpoint=dead,
            otlp_protocol="http/protobuf",
        )
    )
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
