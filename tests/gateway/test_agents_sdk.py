"""The OpenAI Agents SDK, unmodified, running an agent with a function tool through the gateway."""

from __future__ import annotations

import agents
import pytest
from agents import Agent, ModelSettings, Runner, function_tool

from agent_server.gateway import Gateway
from rollout.trace.v1 import common_pb2, state_pb2
from tests.gateway.conftest import calls, only_trace, sdk

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
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
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
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
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
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
    result = await Runner.run(_agent(model, seen), "use lookup_weather for Lima")
    assert seen, "the agent never called its tool"
    assert result.final_output
    await gateway.stop()
    _assert_tool_loop(only_trace(gateway.settings.trace_root), f"sunny in {seen[0]}")


async def test_agent_streamed_over_the_chat_completions_model(gateway: Gateway) -> None:
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)
    seen: list[str] = []
    model = agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
    run = Runner.run_streamed(_agent(model, seen), "use lookup_weather for Rome")
    async for _ in run.stream_events():
        pass
    assert seen
    assert run.final_output
    await gateway.stop()
    _assert_tool_loop(only_trace(gateway.settings.trace_root), f"sunny in {seen[0]}")


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_handoff_stays_in_the_runs_bundle(gateway: Gateway, api: str) -> None:
    # A handoff gives the conversation to an agent with other instructions. On Chat
    # Completions they are the first (system) message, so the next request extended no
    # exchange. Was: the run split in two bundles, the first with its handoff call unanswered,
    # the second starting with the whole history (on the Responses API, where instructions are
    # no part of `input`, it stayed one).
    client = sdk(base_url=gateway.url, api_key="unused", max_retries=0)

    def model() -> agents.Model:
        if api == "chat":
            return agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
        return agents.OpenAIResponsesModel(model="local", openai_client=client)

    weather = Agent(name="weather", instructions="You answer about the weather.", model=model())
    triage = Agent(name="triage", instructions="Route the user.", handoffs=[weather], model=model())
    result = await Runner.run(triage, "use transfer_to_weather")
    assert result.last_agent is weather
    await gateway.stop()
    trace = only_trace(gateway.settings.trace_root)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    assert len(trace.turns) == 1
    assert len(calls(trace)) == 2
    (handoff,) = trace.tool_calls.values()
    assert handoff.name == "transfer_to_weather"
    assert handoff.execution.status == COMPLETED
