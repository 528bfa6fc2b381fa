"""Against a real engine: vLLM's CPU build serving SmolLM2-135M-Instruct, through the agent
server, in both dialects. Greedy decoding (temperature 0) keeps the model's answers the same
from run to run; a tool call is made certain by `tool_choice: required` and a strict schema
(constrained decoding)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_server.chat_completions import CHUNK_EVENT
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import (
    AGENT_SERVER,
    TRACE_REDUCER,
    EventLog,
    Harness,
    StartAgent,
    clean_env,
    reduce_with_cli,
)
from tests.docs import block
from tests.engine import MODEL, READY_TIMEOUT, check_drift
from trace_reducer import read_bundle, request_body

pytestmark = [pytest.mark.engine, pytest.mark.timeout(READY_TIMEOUT + 600)]

APIS = ("chat", "responses")
WEATHER = agent_pb2.FunctionTool(
    name="get_weather",
    description="Get the current weather for a city.",
    parameters_json=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
    strict=True,
)
REQUIRED = agent_pb2.ToolChoice(mode=agent_pb2.TOOL_CHOICE_MODE_REQUIRED)


@pytest.fixture
def start_engine_agent(start_agent: StartAgent, vllm_url: str) -> StartAgent:
    async def start(api: str, **overrides: Any) -> Harness:
        return await start_agent(provider_url=vllm_url, provider_api=api, model=MODEL, **overrides)

    return start


async def start_turn(
    agent: Harness, thread_id: str, text: str, **fields: Any
) -> tuple[agent_pb2.Turn, EventLog]:
    events = agent.events(thread_id)
    reply = await agent.stub.StartTurn(
        agent_pb2.StartTurnRequest(
            thread_id=thread_id, input=[agent_pb2.UserInput(text=text)], **fields
        )
    )
    return reply.turn, events


async def run_turn(agent: Harness, thread_id: str, text: str, **fields: Any) -> agent_pb2.Turn:
    turn, events = await start_turn(agent, thread_id, text, **fields)
    return await events.turn_completed(turn.id)


async def closed(agent: Harness, thread: agent_pb2.Thread) -> state_pb2.RolloutTrace:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return await reduce_with_cli(Path(thread.bundle_path))


def ordered_calls(rollout: state_pb2.RolloutTrace) -> list[state_pb2.InferenceCall]:
    return sorted(rollout.inference_calls.values(), key=lambda c: c.execution.started_seq)


def texts(rollout: state_pb2.RolloutTrace, call: state_pb2.InferenceCall) -> str:
    return "".join(
        part.text
        for item_id in call.response_item_ids
        for part in rollout.conversation_items[item_id].content
    )


async def tool_round(agent: Harness, thread: agent_pb2.Thread, text: str) -> agent_pb2.Turn:
    """A turn in which the model must call get_weather; its output is submitted."""
    turn, events = await start_turn(agent, thread.id, text)
    requested = await events.wait_for(lambda e: e.HasField("tool_call_requested"))
    call = requested.tool_call_requested
    assert call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"}
    await agent.stub.SubmitToolOutputs(
        agent_pb2.SubmitToolOutputsRequest(
            thread_id=thread.id,
            turn_id=turn.id,
            outputs=[agent_pb2.ToolOutput(call_id=call.call_id, output="sunny, 21 C")],
        )
    )
    return await events.turn_completed(turn.id)


INSTRUCTIONS = "You are a helpful assistant."


@pytest.mark.parametrize("api", APIS)
async def test_a_text_turn_with_logprobs(start_engine_agent: StartAgent, api: str) -> None:
    agent = await start_engine_agent(api)
    thread = await agent.start_thread(
        instructions=INSTRUCTIONS,
        temperature=0,
        top_logprobs=2,
        request_token_ids=True,
        max_output_tokens=16,
    )
    assert thread.provider_api == api
    turn = await run_turn(agent, thread.id, "What is the capital of France?")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn.error
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert "Paris" in texts(rollout, call)
    tokens = call.output_tokens
    assert tokens.count > 0
    assert len(tokens.logprobs) == tokens.count
    assert all(value <= 0 for value in tokens.logprobs)
    assert set(tokens.top_counts) == {2}
    assert call.usage.output_tokens > 0
    assert call.sampling.token_ids
    if api == "chat":
        assert tokens.exact
        assert call.prompt_token_ids
    else:
        # vLLM's /v1/responses ignores return_token_ids: the call goes on (best effort) and
        # the trace says the tokens are not exact.
        assert not tokens.exact
        assert not call.prompt_token_ids


async def test_a_tool_round_trip_with_tool_choice_required(
    start_engine_agent: StartAgent,
) -> None:
    # In the Responses dialect; the README's conversation (below) is the Chat one.
    agent = await start_engine_agent("responses")
    thread = await agent.start_thread(
        tools=[WEATHER], tool_choice=REQUIRED, temperature=0, max_output_tokens=40
    )
    # The answer after the tool's output is cut short: the cut is an answer too.
    turn = await tool_round(agent, thread, "What is the weather in Paris?")
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn.error
    rollout = await closed(agent, thread)
    first, second = ordered_calls(rollout)
    [call_item] = first.response_item_ids
    assert rollout.conversation_items[call_item].kind == state_pb2.ITEM_KIND_FUNCTION_CALL
    assert first.stop_reason == common_pb2.STOP_REASON_COMPLETED
    # The forced choice holds for the turn's first request only: the second one answers.
    bodies = [
        json.loads(request_body(thread.bundle_path, c.inference_call_id)) for c in (first, second)
    ]
    assert [b["tool_choice"] for b in bodies] == ["required", "auto"]
    assert texts(rollout, second)


@pytest.mark.parametrize("api", APIS)
async def test_an_interrupt_mid_stream(start_engine_agent: StartAgent, api: str) -> None:
    agent = await start_engine_agent(api)
    thread = await agent.start_thread(temperature=0, max_output_tokens=400)
    turn, events = await start_turn(agent, thread.id, "Write a long story about a dragon.")
    await events.wait_for(lambda e: e.HasField("agent_message_delta"))
    interrupted = await agent.stub.Interrupt(
        agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id)
    )
    assert interrupted.turn.status == agent_pb2.TURN_STATUS_INTERRUPTED
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert call.stop_reason == common_pb2.STOP_REASON_INTERRUPTED
    # The message was still streaming: nothing accepted, its partial text discarded.
    assert not call.response_item_ids
    assert call.discarded_outputs


@pytest.mark.parametrize("api", APIS)
async def test_a_cut_at_max_output_tokens_is_length(
    start_engine_agent: StartAgent, api: str
) -> None:
    agent = await start_engine_agent(api)
    thread = await agent.start_thread(temperature=0, capture_logprobs=True)
    turn = await run_turn(
        agent, thread.id, "Write a long story about a dragon.", max_output_tokens=3
    )
    assert turn.status == agent_pb2.TURN_STATUS_COMPLETED, turn.error
    rollout = await closed(agent, thread)
    [call] = rollout.inference_calls.values()
    assert call.stop_reason == common_pb2.STOP_REASON_LENGTH
    assert call.execution.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert call.output_tokens.count == 3
    assert texts(rollout, call)


def recorded_chunks(bundle: Path) -> dict[int, list[dict[str, Any]]]:
    chunks: dict[int, list[dict[str, Any]]] = {}
    with read_bundle(bundle) as reader:
        for record in reader:
            if (
                record.WhichOneof("body") == "provider_event"
                and record.provider_event.event_type == CHUNK_EVENT
            ):
                chunks.setdefault(record.provider_event.call, []).append(
                    json.loads(record.provider_event.data)
                )
    return chunks


async def check_engine_ids_and_drift(
    bundle: Path, rollout: state_pb2.RolloutTrace, vllm_url: str, sample: dict[str, Any]
) -> None:
    """Each call's recorded ids are vLLM's own; each later call is EXACT or says exactly
    where it departs; the exported sample agrees."""
    calls = ordered_calls(rollout)
    assert len(calls) == 3
    chunks = recorded_chunks(bundle)
    async with httpx.AsyncClient(base_url=vllm_url.removesuffix("/v1"), timeout=120) as client:
        for ordinal, call in enumerate(calls, start=1):
            streamed = chunks[ordinal]
            # The engine's ids, exactly as it streamed them: the prompt on the first chunk,
            # then every chunk's ids in order.
            assert list(call.prompt_token_ids) == streamed[0]["prompt_token_ids"]
            ids = [
                i for chunk in streamed for c in chunk["choices"] for i in c.get("token_ids") or []
            ]
            assert list(call.output_tokens.ids) == ids
            assert call.output_tokens.exact
            assert call.output_tokens.source == common_pb2.TOKEN_SOURCE_ENGINE
            # And the prompt is what vLLM's own tokenizer makes of the messages that were sent.
            body = json.loads(request_body(bundle, call.inference_call_id))
            answer = await client.post(
                "/tokenize",
                json={
                    "model": MODEL,
                    "messages": body["messages"],
                    "tools": body.get("tools"),
                    "add_generation_prompt": True,
                },
            )
            assert answer.status_code == 200, answer.text
            assert list(call.prompt_token_ids) == answer.json()["tokens"]

    check_drift(calls)

    assert sample["tokens"] == "exact"
    drifted = {e["inference_call_id"]: e for e in sample["drift_events"]}
    for call in calls[1:]:
        if call.token_drift == common_pb2.TOKEN_DRIFT_EXACT:
            assert call.inference_call_id not in drifted
        else:
            event = drifted[call.inference_call_id]
            assert event["position"] == call.drift_position
            assert event["kind"] == common_pb2.TokenDrift.Name(call.token_drift).removeprefix(
                "TOKEN_DRIFT_"
            )
    # The sample's ids are the engine's: the last prompt (which holds the earlier calls where
    # it kept them), then the last call's output.
    last = calls[-1]
    assert sample["token_ids"] == [*last.prompt_token_ids, *last.output_tokens.ids]


README = Path(__file__).resolve().parents[2] / "README.md"
MAKEFILE = README.parent / "Makefile"


def readme_block(name: str, language: str) -> str:
    """The code block after `<!-- example: name -->` in the README."""
    return block(name, language)


async def test_the_readme_section_runs_as_written(vllm_url: str, tmp_path: Path) -> None:
    commands = readme_block("vllm-shell", "sh").replace("\\\n", " ").splitlines()
    make_vllm, serve_line, run_example, export_line = commands
    # The session's engine is what `make vllm` starts (on a port of its own).
    assert make_vllm == "make vllm &"
    assert "scripts/vllm-serve.sh" in MAKEFILE.read_text().split("\nvllm:", 1)[1].split("\n\n")[0]
    assert run_example == "python weather.py"
    serve_argv = shlex.split(serve_line.removesuffix("&"))
    assert serve_argv[:2] == ["agent-server", "serve"]
    serve_argv = [
        AGENT_SERVER,
        *(vllm_url if arg == "http://127.0.0.1:8000/v1" else arg for arg in serve_argv[1:]),
        "--listen",
        "127.0.0.1:0",
    ]
    assert vllm_url in serve_argv
    process = await asyncio.create_subprocess_exec(
        *serve_argv,
        cwd=tmp_path,
        env=clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        line = (await process.stdout.readline()).decode()
        assert line.startswith("listening on "), line
        address = line.removeprefix("listening on ").strip()
        namespace: dict[str, Any] = {}
        exec(compile(readme_block("vllm", "python"), "README.md", "exec"), namespace)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            await namespace["converse"](address)
    finally:
        process.send_signal(signal.SIGTERM)
        await process.communicate()
    answers = printed.getvalue().strip().splitlines()
    assert len(answers) >= 2
    export_argv = shlex.split(export_line)
    assert export_argv[0] == "trace-reducer"
    exported = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        *export_argv[1:],
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await exported.communicate()
    assert exported.returncode == 0, stderr.decode()
    summary = stdout.decode()
    assert re.match(r"wrote 1 sample \(1 with exact tokens, \d+ drifted\) to ", summary), summary
    [sample] = [json.loads(x) for x in (tmp_path / "rl" / "samples.jsonl").read_text().splitlines()]
    assert sample["tokens"] == "exact"
    drifted = int(summary.split(", ")[1].split()[0])
    assert drifted == (sample["drift"] != "EXACT")
    if drifted:
        assert "drifted" in stderr.decode()
    # A multi-turn tool conversation from the Python client, with token ids requested: every
    # id is the engine's, and drift is reported per call.
    [bundle] = (tmp_path / "traces").iterdir()
    rollout = await reduce_with_cli(bundle)
    await check_engine_ids_and_drift(bundle, rollout, vllm_url, sample)
