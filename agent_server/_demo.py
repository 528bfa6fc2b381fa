"""`agent-server demo`: one thread through a real gRPC client, then its bundle reduced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import grpc

from agent_server.config import Settings
from agent_server.server import AgentServer
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import common_pb2, state_pb2
from trace_reducer import (
    STATE_FILE_NAME,
    replay_bundle,
    require_reducible,
    write_state_json,
    write_view,
)

FIRST_PROMPT = "What does rollout-trace record?"
SECOND_PROMPT = "Tell me the whole story again, slowly."
# Deltas of the second turn to see before interrupting it: mid-stream, never at its end.
_DELTAS_BEFORE_INTERRUPT = 5


class _Events:
    """The thread's event stream, read in the background, awaited by predicate."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[
            agent_pb2.StreamEventsRequest, agent_pb2.StreamEventsResponse
        ],
    ) -> None:
        self._call = call
        self._queue: asyncio.Queue[agent_pb2.ThreadEvent | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for response in self._call:
                await self._queue.put(response.event)
        finally:
            await self._queue.put(None)

    async def until(self, done: Callable[[agent_pb2.ThreadEvent], bool]) -> agent_pb2.ThreadEvent:
        while True:
            event = await self._queue.get()
            if event is None:
                raise RuntimeError("the event stream ended early")
            if event.HasField("agent_message_delta"):
                print(event.agent_message_delta.delta, end="", flush=True)
            if done(event):
                return event

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task


def _turn_completed(turn_id: str) -> Callable[[agent_pb2.ThreadEvent], bool]:
    return lambda event: event.turn_id == turn_id and event.HasField("turn_completed")


async def _converse(address: str) -> Path:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        started = await stub.StartThread(
            agent_pb2.StartThreadRequest(
                instructions="Answer in a few sentences.", metadata={"source": "demo"}
            )
        )
        thread = started.thread
        print(f"thread {thread.id} on model {thread.model}")
        events = _Events(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id)))
        try:
            print(f"\nuser: {FIRST_PROMPT}\nassistant: ", end="")
            first = await stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text=FIRST_PROMPT)]
                )
            )
            done = await events.until(_turn_completed(first.turn.id))
            status = agent_pb2.TurnStatus.Name(done.turn_completed.turn.status)
            print(f"\n[turn 1: {status}]")

            print(f"\nuser: {SECOND_PROMPT}\nassistant: ", end="")
            second = await stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text=SECOND_PROMPT)]
                )
            )
            deltas = 0

            def enough(event: agent_pb2.ThreadEvent) -> bool:
                nonlocal deltas
                deltas += event.HasField("agent_message_delta")
                return deltas >= _DELTAS_BEFORE_INTERRUPT

            await events.until(enough)
            interrupted = await stub.Interrupt(
                agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=second.turn.id)
            )
            await events.until(_turn_completed(second.turn.id))
            status = agent_pb2.TurnStatus.Name(interrupted.turn.status)
            print(f"\n[turn 2: interrupted by the client: {status}]")
            closed = await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            print(f"[thread {agent_pb2.ThreadStatus.Name(closed.thread.status)}]")
        finally:
            await events.close()
        return Path(closed.thread.bundle_path)


def _status(status: common_pb2.ExecutionStatus.ValueType) -> str:
    return common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")


def _summary(trace: state_pb2.RolloutTrace) -> list[str]:
    integrity = state_pb2.IntegrityStatus.Name(trace.integrity.status)
    lines = [
        f"recording complete: {str(trace.recording_complete).lower()} "
        f"({integrity.removeprefix('INTEGRITY_STATUS_')}, {trace.integrity.records_read} records)"
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
                    text = "".join(part.text for part in item.content)
                    lines.append(f"    accepted {item.responses_item_id}: {text[:60]!r}...")
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
