"""The OpenAI Agents SDK, unmodified, running an agent with a function tool through the gateway."""

from __future__ import annotations

import agents
import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool

from agent_server.gateway import Gateway
from rollout.trace.v1 import common_pb2, state_pb2
from tests.gateway.conftest import calls, only_trace

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED


@pytest.fixture(autouse=True)
def _no_sdk_tracing() -> None:
    # The SDK's own tracing would post spans to OpenAI: nothing leaves this machine.
    agents.set_tracing_disabled(True)


def _agent(model: agents.Model, seen: list[str]) -> Agent:
    @function_tool
    def lookup_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    return Agent(
        name="weather",
        instructions="Answer with the tool's result.",
        tools=[lookup_weather],
        model=model,
        model_settings=ModelSettings(),
    )


def _assert_tool_loop(trace: state_pb2.RolloutTrace, tool_output: str) -> None:
    """Two calls in one turn: a function call, then an answer after its output."""
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert len(trace.turns) == 1
    first, second = calls(trace)
    assert (first.execution.status, second.execution.status) == (COMPLETED, COMPLETED)
    items = trace.conversation_items
    (call_id,) = first.response_item_ids
    function_call = items[call_id]
    assert function_call.kind == state_pb2.ITEM_KIND_FUNCTION_CALL
    assert function_call.name == "lookup_weather"
    outputs = [
        items[i]
        for i in second.request_item_ids
        if items[i].kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT
    ]
    assert [o.call_id for o in outputs] == [function_call.call_id]
    assert tool_output in outputs[0].output
    assert call_id in second.request_item_ids
    assert second.response_item_ids


async def test_agent_with_a_tool_over_the_responses_model(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIResponsesModel(model="local", openai_client=client)
    result = await Runner.run(_agent(model, seen), "use lookup_weather for Paris")
    assert seen, "the agent never called its tool"
    assert result.final_output
    await gateway.stop()
    trace = only_trace(gateway.settings.trace_root)
    _assert_tool_loop(trace, f"sunny in {seen[0]}")
    (thread,) = trace.threads.values()
    assert len(thread.conversation_item_ids) >= 4


async def test_agent_streamed_over_the_responses_model(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIResponsesModel(model="local", openai_client=client)
    run = Runner.run_streamed(_agent(model, seen), "use lookup_weather for Oslo")
    async for _ in run.stream_events():
        pass
    assert seen
    assert run.final_output
    await gateway.stop()
    _assert_tool_loop(only_trace(gateway.settings.trace_root), f"sunny in {seen[0]}")


async def test_agent_with_a_tool_over_the_chat_completions_model(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
    result = await Runner.run(_agent(model, seen), "use lookup_weather for Lima")
    assert seen, "the agent never called its tool"
    assert result.final_output
    await gateway.stop()
    _assert_tool_loop(only_trace(gateway.settings.trace_root), f"sunny in {seen[0]}")


async def test_agent_streamed_over_the_chat_completions_model(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
    run = Runner.run_streamed(_agent(model, seen), "use lookup_weather for Rome")
    async for _ in run.stream_events():
        pass
    assert seen
    assert run.final_output
    await gateway.stop()
    _assert_tool_loop(only_trace(gateway.settings.trace_root), f"sunny in {seen[0]}")
