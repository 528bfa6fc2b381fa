"""The client's whole API against real servers: deadlines, retries, environment defaults, forks,
rewards, sampling settings, function tools from signatures, and the reducer's client."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

import grpc
import pytest

from agent_server import AgentServer, Settings
from grpc_common import GrpcServer
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout_client import (
    AgentClient,
    DeadlineExceededError,
    NotFoundError,
    ReducerClient,
    SyncAgentClient,
    Thread,
    UnavailableError,
    function_tool,
)
from tests.live_server import live_server
from trace_reducer import replay_bundle
from trace_reducer.service import SERVICE_NAME, ReducerService, add_to_server


class FlakyAgent(agent_pb2_grpc.AgentServiceServicer):
    """An AgentService that is unavailable for the first `failures` calls of each method, and
    never answers StartTurn (a hung server)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    async def _attempt(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    async def GetThread(  # noqa: N802 - the gRPC method's name
        self, request: agent_pb2.GetThreadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.GetThreadResponse:
        await self._attempt("GetThread", context)
        return agent_pb2.GetThreadResponse(thread=agent_pb2.Thread(id=request.thread_id))

    async def StartThread(  # noqa: N802
        self, request: agent_pb2.StartThreadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.StartThreadResponse:
        await self._attempt("StartThread", context)
        return agent_pb2.StartThreadResponse(thread=agent_pb2.Thread(id="thread_1"))

    async def StartTurn(  # noqa: N802
        self, request: agent_pb2.StartTurnRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.StartTurnResponse:
        self.calls["StartTurn"] = self.calls.get("StartTurn", 0) + 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def _serve(agent: FlakyAgent) -> GrpcServer:
    return await GrpcServer.start(
        "127.0.0.1:0",
        lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server),
        ["rollout.agent.v1.AgentService"],
    )


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[FlakyAgent, str]]:
    # The methods it leaves out answer UNIMPLEMENTED, as generated servicers do.
    agent = FlakyAgent(failures=2)  # type: ignore[abstract]
    server = await _serve(agent)
    try:
        yield agent, server.address
    finally:
        await server.stop(None)


async def test_idempotent_calls_are_retried_and_others_are_not(
    flaky: tuple[FlakyAgent, str],
) -> None:
    agent, address = flaky
    async with AgentClient(address) as client:
        thread = await client.thread("thread_7")
        assert thread.id == "thread_7"
        assert agent.calls["GetThread"] == 3, "two UNAVAILABLE answers, then the reply"
        with pytest.raises(UnavailableError):
            await client.start_thread()
        assert agent.calls["StartThread"] == 1, "a call that creates something is never repeated"


async def test_a_hung_server_fails_the_call_at_its_deadline(
    flaky: tuple[FlakyAgent, str],
) -> None:
    agent, address = flaky
    async with AgentClient(address, timeout=0.3) as client:
        info = agent_pb2.Thread(id="thread_1")
        turn = Thread(client, info).run_turn("hello")
        with pytest.raises(DeadlineExceededError):
            await turn.start()
        # The call's own timeout wins over the client's; with_options makes a client whose
        # default is another, on the same connection.
        slow = Thread(client.with_options(timeout=None), info).run_turn("hello", timeout=0.2)
        with pytest.raises(DeadlineExceededError):
            await slow.start()
        assert client.timeout == 0.3
        assert agent.calls["StartTurn"] == 2


async def test_the_address_and_token_come_from_the_environment(
    server: AgentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_ADDRESS", server.address)
    monkeypatch.setenv("ROLLOUT_TOKEN", "s3cret")
    async with AgentClient() as client:
        assert client.address == server.address
        assert client.metadata == (("authorization", "Bearer s3cret"),)
        assert await client.list_threads() == []
    monkeypatch.delenv("ROLLOUT_ADDRESS")
    async with AgentClient() as client:
        assert client.address == "127.0.0.1:50051"


async def test_sampling_settings_fork_and_reward(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        parent = await client.start_thread(
            instructions="Be brief.",
            capture_logprobs=True,
            request_token_ids=True,
            temperature=0.7,
            policy_version="step-3",
            tool_choice="none",
            parallel_tool_calls=False,
        )
        assert parent.info.tool_choice.mode == agent_pb2.TOOL_CHOICE_MODE_NONE
        assert parent.info.HasField("parallel_tool_calls")
        assert not parent.info.parallel_tool_calls
        assert parent.info.capture_logprobs
        assert parent.info.temperature == pytest.approx(0.7)
        group = await parent.fork(3, group_id="g-1")
        assert len(group) == 3
        assert [(t.info.fork.group_id, t.info.fork.repetition_index) for t in group] == [
            ("g-1", 0),
            ("g-1", 1),
            ("g-1", 2),
        ]
        turn = group[0].run_turn("What is 2 + 2?", temperature=0.2, policy_version="step-4")
        await turn.wait()
        reward = await group[0].record_reward("has_4", 1.0, source="rule", weight=2.0)
        for thread in [parent, *group]:
            await thread.close()
        assert Path(group[0].bundle_path).is_absolute()
    state = replay_bundle(group[0].bundle_path)
    assert Path(reward.bundle_path) == Path(group[0].bundle_path)
    (call,) = state.inference_calls.values()
    assert call.sampling.temperature == pytest.approx(0.2)
    assert call.policy_version == "step-4"
    assert [(r.name, r.value, r.weight, r.source) for r in state.rewards] == [
        ("has_4", 1.0, 2.0, "rule")
    ]


class Unit(enum.Enum):
    CELSIUS = "c"
    FAHRENHEIT = "f"


def test_function_tool_builds_the_schema_from_the_signature_and_docstring() -> None:
    @function_tool
    def weather(
        city: str,
        days: int = 1,
        unit: Unit = Unit.CELSIUS,
        detail: Literal["short", "long"] = "short",
        tags: list[str] | None = None,
        note: Annotated[str, "Anything else."] = "",
    ) -> str:
        """Today's weather in a city.

        Args:
            city: The city, as its
                inhabitants write it.
            days: How many days ahead.
        """
        return f"{city}: sunny for {days} day(s)"

    assert weather.name == "weather"
    assert weather.definition.description == "Today's weather in a city."
    assert weather.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city, as its inhabitants write it."},
            "days": {"type": "integer", "description": "How many days ahead.", "default": 1},
            "unit": {"enum": ["c", "f"]},
            "detail": {"enum": ["short", "long"], "default": "short"},
            "tags": {
                "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                "default": None,
            },
            "note": {"type": "string", "description": "Anything else.", "default": ""},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    assert weather("Oslo") == "Oslo: sunny for 1 day(s)", "still the function it wraps"

    @function_tool(strict=True)
    def add(a: float, b: float = 0.0) -> float:
        return a + b

    assert add.definition.strict
    assert add.parameters["required"] == ["a", "b"]

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(TypeError, match="'x' has no type annotation"):
        function_tool(untyped)


async def test_function_tools_answer_the_models_calls(server: AgentServer) -> None:
    @function_tool
    async def lookup(key: str) -> dict[str, str]:
        """Look a key up."""
        return {"key": key, "value": "42"}

    async with AgentClient(server.address) as client:
        thread = await client.start_thread(tools=[lookup])
        turn = thread.run_turn("Use lookup", tools=[lookup])
        outputs = [
            event.tool_call_completed
            async for event in turn
            if event.HasField("tool_call_completed")
        ]
        await thread.close()
    assert outputs, "the local model calls the thread's tool"
    assert not outputs[0].is_error
    assert json.loads(outputs[0].output)["value"] == "42"


def test_the_blocking_client_forks_and_rewards(tmp_path: Path) -> None:
    with (
        live_server("--trace-root", str(tmp_path), "--local-word-delay", "0.001") as served,
        SyncAgentClient(served.address, timeout=10) as client,
    ):
        parent = client.start_thread(temperature=1.0)
        forks = parent.fork(2)
        forks[0].run_turn("Hi").wait()
        reward = forks[1].record_reward("len", 0.5)
        assert reward.bundle_path == forks[1].bundle_path
        for thread in [parent, *forks]:
            thread.close()
        with pytest.raises(NotFoundError):
            client.record_reward("no-such-thread", "len", 0.5)


async def test_reducer_client_reduces_uploads_and_watches(
    server: AgentServer, tmp_path: Path
) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        await thread.run_turn("Hello").wait()
        await thread.close()
    bundle = Path(thread.bundle_path)
    root = bundle.parent
    reducer_server = await GrpcServer.start(
        "127.0.0.1:0", lambda s: add_to_server(ReducerService(root), s), [SERVICE_NAME]
    )
    try:
        async with ReducerClient(reducer_server.address) as reducer:
            reduced = await reducer.reduce_bundle(bundle.name, write_state=True)
            assert reduced.trace == replay_bundle(bundle)
            assert await asyncio.to_thread(Path(reduced.state_path).is_file)
            uploaded = await reducer.reduce_records((bundle / "trace.binpb").read_bytes())
            assert uploaded.root_thread_id == reduced.trace.root_thread_id
            updates = [update async for update in reducer.watch_bundle(bundle.name)]
            assert updates[-1].trace.recording_complete
            assert updates[-1].records_read == reduced.trace.integrity.records_read
            with pytest.raises(NotFoundError):
                await reducer.reduce_bundle("no-such-bundle")
    finally:
        await reducer_server.stop(None)


async def test_bundle_path_is_absolute_for_a_relative_trace_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    running = await AgentServer.start(
        Settings(listen="127.0.0.1:0", trace_root=Path("traces"), local_word_delay=0)
    )
    try:
        async with AgentClient(running.address) as client:
            thread = await client.start_thread()
            await thread.run_turn("Hello").wait()
            closed = await thread.close()
    finally:
        await running.stop()
    monkeypatch.chdir("/")
    bundle = Path(closed.bundle_path)
    assert bundle.is_absolute()
    assert bundle.parent == tmp_path / "traces"
    assert replay_bundle(bundle).recording_complete


def test_every_public_name_resolves() -> None:
    import rollout_client

    missing = [name for name in rollout_client.__all__ if not hasattr(rollout_client, name)]
    assert missing == []
    with pytest.raises(AttributeError):
        _ = rollout_client.NoSuchName
