"""The README's resume-from-disk example runs as written, across a restart of a real server."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from agent_server import AgentServer, Settings
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.test_readme import example


async def test_the_resume_example(tmp_path: Path) -> None:
    settings = replace(
        Settings(), listen="127.0.0.1:0", local_word_delay=0.0, trace_root=tmp_path / "traces"
    )
    server = await AgentServer.start(settings)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
            turns = []
            for text in ("first", "second"):
                events = stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id))
                turn = await stub.StartTurn(
                    agent_pb2.StartTurnRequest(
                        thread_id=thread.id, input=[agent_pb2.UserInput(text=text)]
                    )
                )
                async for response in events:
                    if response.event.HasField("turn_completed"):
                        break
                events.cancel()
                turns.append(turn.turn.id)
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    finally:
        await server.stop()
    restarted = await AgentServer.start(settings)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(example("resume"), "README.md", "exec"), namespace)
        made = await namespace["retry_from_disk"](restarted.address, thread.id, turns[0])
    finally:
        await restarted.stop()
    assert len(made) == 5
    assert len(set(made)) == 5
