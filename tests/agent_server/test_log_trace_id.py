"""Log lines name their bundle's trace id, the one its OpenTelemetry spans carry."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent_server import AgentServer, Settings
from agent_server.logs import fields_of
from rollout_client import AgentClient
from trace_reducer import replay_bundle


async def test_thread_and_turn_lines_carry_the_trace_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent_server")
    server = await AgentServer.start(
        Settings(listen="127.0.0.1:0", trace_root=tmp_path, local_word_delay=0)
    )
    try:
        async with AgentClient(server.address) as client:
            thread = await client.start_thread()
            await thread.run_turn("Hello").wait()
            closed = await thread.close()
    finally:
        await server.stop()
    trace_id = replay_bundle(closed.bundle_path).trace_id
    lines = {
        record.getMessage(): fields_of(record)
        for record in caplog.records
        if fields_of(record).get("thread") == closed.id
    }
    for message in ("thread started", "turn started", "turn ended", "thread closed"):
        assert lines[message]["trace_id"] == trace_id, message
