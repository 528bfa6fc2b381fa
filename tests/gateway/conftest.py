"""Fixtures: an in-process gateway (on the local model or a scripted upstream) and its bundles."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from agent_server.config import Settings
from agent_server.gateway import Gateway, GatewaySettings
from rollout.trace.v1 import state_pb2
from tests.agent_server.scripted_provider import ScriptedProvider
from trace_reducer import replay_bundle

StartGateway = Callable[..., Awaitable[Gateway]]

# The SDK clients the running test opened (sdk, sync_sdk): closed when it ends, so that none
# leaves its connections for the garbage collector (a ResourceWarning each).
_OPENED: list[openai.AsyncOpenAI | openai.OpenAI] = []


def sdk(**options: Any) -> openai.AsyncOpenAI:
    """openai.AsyncOpenAI(**options), closed when the test ends."""
    client = openai.AsyncOpenAI(**options)
    _OPENED.append(client)
    return client


def sync_sdk(**options: Any) -> openai.OpenAI:
    """openai.OpenAI(**options), closed when the test ends."""
    client = openai.OpenAI(**options)
    _OPENED.append(client)
    return client


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A connection left for the garbage collector fails the gateway's tests (the collector
    reports it as an unraisable ResourceWarning, which only warned)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.filterwarnings("error::ResourceWarning"))
            item.add_marker(
                pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
            )


@pytest.fixture(autouse=True)
async def _close_sdk_clients() -> AsyncIterator[None]:
    yield
    while _OPENED:
        client = _OPENED.pop()
        if isinstance(client, openai.AsyncOpenAI):
            await client.close()
        else:
            client.close()


@pytest.fixture
async def start_gateway(tmp_path: Path) -> AsyncIterator[StartGateway]:
    """start_gateway(upstream=None, **settings): a gateway on 127.0.0.1:0 recording under
    tmp_path/traces (the built-in local model, word delay 0, unless an upstream is given)."""
    started: list[Gateway] = []

    async def start(upstream: str | None = None, **fields: Any) -> Gateway:
        agent_fields = {
            name: fields.pop(name) for name in list(fields) if name in Settings.__dataclass_fields__
        }
        agent = Settings(
            provider_url=upstream,
            trace_root=agent_fields.pop("trace_root", tmp_path / "traces"),
            local_word_delay=agent_fields.pop("local_word_delay", 0.0),
            **agent_fields,
        )
        settings = GatewaySettings(agent=agent, listen="127.0.0.1:0", **fields)
        gateway = await Gateway.start(settings)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        await gateway.stop()


@pytest.fixture
async def gateway(start_gateway: StartGateway) -> Gateway:
    return await start_gateway()


@pytest.fixture
async def provider() -> AsyncIterator[ScriptedProvider]:
    scripted = await ScriptedProvider().start()
    yield scripted
    await scripted.stop()


def bundles(root: Path) -> list[Path]:
    """The bundle directories under root, oldest first."""
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.exists() else []


def reduce_all(root: Path) -> list[state_pb2.RolloutTrace]:
    return [replay_bundle(path) for path in bundles(root)]


def only_trace(root: Path) -> state_pb2.RolloutTrace:
    traces = reduce_all(root)
    assert len(traces) == 1, f"expected one bundle, found {len(traces)}"
    return traces[0]


def calls(trace: state_pb2.RolloutTrace) -> list[state_pb2.InferenceCall]:
    """The trace's inference calls in the order they started."""
    return sorted(trace.inference_calls.values(), key=lambda c: c.execution.started_seq)


def items_text(trace: state_pb2.RolloutTrace, ids: Any) -> str:
    return "".join(
        part.text for item_id in ids for part in trace.conversation_items[item_id].content
    )
