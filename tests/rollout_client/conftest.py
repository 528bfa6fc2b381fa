"""Fixtures: an in-process agent server on its local model, a scripted one, a live process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent_server import AgentServer, Settings
from tests.agent_server.conftest import provider  # noqa: F401 - a fixture
from tests.agent_server.scripted_provider import ScriptedProvider
from tests.live_server import LiveServer, live_server


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[AgentServer]:
    """An agent server on its built-in local model, recording under tmp_path/traces."""
    running = await AgentServer.start(
        Settings(listen="127.0.0.1:0", trace_root=tmp_path / "traces", local_word_delay=0.001)
    )
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def scripted_server(
    provider: ScriptedProvider,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> AsyncIterator[AgentServer]:
    """An agent server whose provider answers what the test queues."""
    running = await AgentServer.start(
        Settings(
            listen="127.0.0.1:0",
            provider_url=provider.url,
            model="test-model",
            trace_root=tmp_path / "traces",
            max_retries=0,
        )
    )
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    """`agent-server serve` on its local model, for blocking clients (shared by a module)."""
    with live_server("--local-word-delay", "0.002") as served:
        yield served
