"""`agent-server demo`: one thread through the Python client library, then its bundle reduced."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_server.config import Settings
from agent_server.server import AgentServer
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from rollout_client import AgentClient, function_tool
from trace_reducer import (
    STATE_FILE_NAME,
    replay_bundle,
    require_reducible,
    write_state_json,
    write_view,
)

FIRST_PROMPT = "What does rollout-trace record?"
TOOL_PROMPT = "Please lookup the tallest mountain on Earth."
WAITING_PROMPT = "Now lookup the deepest lake, but I will not wait for it."
SECOND_PROMPT = "Tell me the whole story again, slowly."
LOOKUP = function_tool(
    "lookup",
    "Look a fact up in the demo's tiny encyclopedia.",
    {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
# Deltas of the second turn to see before interrupting it: mid-stream, never at its end.
_DELTAS_BEFORE_INTERRUPT = 5


async def _converse(address: str) -> Path:
    async with AgentClient(address) as client:
        thread = await client.start_thread(
            instructions="Answer in a few sentences.",
            metadata={"source": "demo"},
            tools=[LOOKUP],
        )
        print(f"thread {thread.id} on model {thread.model}, with the tool `lookup`")

        print(f"\nuser: {FIRST_PROMPT}\nassistant: ", end="")
        first = thread.run_turn(FIRST_PROMPT)
        async for event in first:
            _show(event)
        print(f"\n[turn 1: {first.status_name}]")

        # The local model calls the tool the message names; the client answers the call.
        print(f"\nuser: {TOOL_PROMPT}\nassistant: ", end="")
        tool_turn = thread.run_turn(TOOL_PROMPT, tools={"lookup": _lookup})
        async for event in tool_turn:
            _show(event)
        print(f"\n[turn 2: a tool round trip: {tool_turn.status_name}]")

        # Here nobody answers the call: the turn waits for its output until interrupted.
        print(f"\nuser: {WAITING_PROMPT}\nassistant: ", end="")
        waiting = thread.run_turn(WAITING_PROMPT)
        async for event in waiting:
            _show(event)
            if event.HasField("turn_awaiting_tool_outputs"):
                await waiting.interrupt()
        print(f"\n[turn 3: interrupted while awaiting a tool output: {waiting.status_name}]")

        print(f"\nuser: {SECOND_PROMPT}\nassistant: ", end="")
        second = thread.run_turn(SECOND_PROMPT)
        deltas = 0
        async for event in second:
            _show(event)
            if event.HasField("agent_message_delta"):
                deltas += 1
                if deltas == _DELTAS_BEFORE_INTERRUPT:
                    await second.interrupt()
        # With --local-word-delay 0 the whole reply can arrive before the interrupt does.
        how = (
            "interrupted mid-stream by the client"
            if second.status_name == "INTERRUPTED"
            else "the reply ended before the client's interrupt arrived"
        )
        print(f"\n[turn 4: {how}: {second.status_name}]")
        closed = await thread.close()
        status = agent_pb2.ThreadStatus.Name(closed.status).removeprefix("THREAD_STATUS_")
        print(f"[thread {status}]")
        return Path(closed.bundle_path)


_FACTS = {"mountain": "Mount Everest, 8,849 m", "lake": "Lake Baikal, 1,642 m deep"}


async def _lookup(arguments: dict[str, object]) -> str:
    query = str(arguments.get("query", "")).lower()
    return next((fact for key, fact in _FACTS.items() if key in query), "not in the encyclopedia")


def _show(event: agent_pb2.ThreadEvent) -> None:
    if event.HasField("agent_message_delta"):
        print(event.agent_message_delta.delta, end="", flush=True)
    elif event.HasField("tool_call_requested"):
        call = event.tool_call_requested
        print(f"[calls {call.name}({call.arguments})] ", end="", flush=True)
    elif event.HasField("tool_call_completed"):
        print(f"[{event.tool_call_completed.output!r}] ", end="", flush=True)


def _status(status: common_pb2.ExecutionStatus.ValueType) -> str:
    return common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")


def _summary(trace: state_pb2.RolloutTrace) -> list[str]:
    integrity = state_pb2.IntegrityStatus.Name(trace.integrity.status)
    lines = [
        # The transcript above is in the API's words, this in state.json's: one turn may show
        # both (docs/vocabulary.md), so the summary says whose words they are.
        "the reduced bundle, in state.json's words (an INTERRUPTED turn is CANCELLED there):",
        f"recording complete: {str(trace.recording_complete).lower()} "
        f"({integrity.removeprefix('INTEGRITY_STATUS_')}, {trace.integrity.records_read} records)",
    ]
    for thread in trace.threads.values():
        for turn_id in thread.turn_ids:
            turn = trace.turns[turn_id]
            lines.append(f"turn {turn_id}: {_status(turn.execution.status)}")
            for call_id in turn.inference_call_ids:
                call = trace.inference_calls[call_id]
                lines.append(
                    f"  call {call_id}: {_status(call.execution.status)}, "
                    f"{len(call.request_item_ids)} input items, "
                    f"{len(call.response_item_ids)} accepted, "
                    f"{len(call.discarded_outputs)} discarded"
                )
                for item_id in call.response_item_ids:
                    item = trace.conversation_items[item_id]
                    text = "".join(part.text for part in item.content) or item.arguments
                    lines.append(f"    accepted {item.responses_item_id}: {text[:60]!r}...")
            for tool_call_id in turn.tool_call_ids:
                tool_call = trace.tool_calls[tool_call_id]
                output = trace.conversation_items[tool_call.output_item_id].output
                lines.append(
                    f"  tool call {tool_call.name} {tool_call.call_id}: "
                    f"{_status(tool_call.execution.status)}, output {output[:60]!r}"
                )
        lines.append(f"conversation items: {len(thread.conversation_item_ids)}")
    return lines


async def run(settings: Settings) -> int:
    """Serve on the local model, converse, shut down, reduce; print what happened."""
    server = await AgentServer.start(settings)
    try:
        bundle = await _converse(server.address)
    finally:
        await server.stop()
    trace = await asyncio.to_thread(replay_bundle, bundle)
    require_reducible(trace.integrity, salvage=False, source=str(bundle))
    state_path = bundle / STATE_FILE_NAME
    await asyncio.to_thread(write_state_json, trace, state_path)
    print()
    for line in _summary(trace):
        print(line)
    print(f"state.json: {state_path}")
    view_path = await asyncio.to_thread(write_view, bundle)
    print(f"view.html: {view_path}")
    return 0
