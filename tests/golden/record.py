"""Records the golden corpus: `python -m tests.golden.record` (then commit `tests/golden/`).

`python -m tests.golden.record --states` keeps the bundles and writes only their states again:
for a change that is meant to show in `state.json` (a new field), with the diff reviewed.

Real threads on the real agent server (its local model for tokens, tools and forks; a scripted
provider for a failed and an interrupted turn), rewards through RecordReward, then damaged
copies (a torn tail, a corrupt frame, a torn rewards file). Each bundle's `state.json` as
`trace-reducer reduce` writes it today goes to `states/`; `test_golden.py` holds every later
reducer to those bytes. Re-record only when a change to the state is meant, and say so.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import grpc

from agent_server import AgentServer, Settings
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    created,
    item_added,
    message,
    sse,
    text_delta,
)
from trace_reducer import TRACE_FILE_NAME
from trace_reducer.cli import main as trace_reducer

HERE = Path(__file__).parent
BUNDLES = HERE / "bundles"
STATES = HERE / "states"
# Bundles `reduce` refuses without --salvage.
SALVAGE_FILE = HERE / "salvage.json"
# A resolved fork names the directory its parent was read from; the states say this instead.
ROOT_MARK = "@CORPUS@"

LOOKUP = agent_pb2.FunctionTool(
    name="lookup",
    description="Look something up.",
    parameters_json=json.dumps({"type": "object", "properties": {"query": {"type": "string"}}}),
)


class _Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)

    async def start(self, **fields: object) -> agent_pb2.Thread:
        reply = await self.stub.StartThread(agent_pb2.StartThreadRequest(**fields))  # type: ignore[arg-type]
        return reply.thread

    async def turn(self, thread_id: str, text: str, tool_answer: str = "") -> agent_pb2.Turn:
        events = self.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
        stream = aiter(events)
        started = await self.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
        )
        try:
            while True:
                event = (await anext(stream)).event
                if event.HasField("tool_call_requested"):
                    call = event.tool_call_requested
                    await self.stub.SubmitToolOutputs(
                        agent_pb2.SubmitToolOutputsRequest(
                            thread_id=thread_id,
                            turn_id=started.turn.id,
                            outputs=[
                                agent_pb2.ToolOutput(call_id=call.call_id, output=tool_answer)
                            ],
                        )
                    )
                if event.HasField("turn_completed") and event.turn_id == started.turn.id:
                    return event.turn_completed.turn
        finally:
            events.cancel()

    async def interrupted(self, thread_id: str, text: str, streamed: str) -> None:
        events = self.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
        stream = aiter(events)
        started = await self.stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
        )
        seen = ""
        while seen != streamed:
            event = (await anext(stream)).event
            if event.HasField("agent_message_delta"):
                seen += event.agent_message_delta.delta
        await self.stub.Interrupt(
            agent_pb2.InterruptRequest(thread_id=thread_id, turn_id=started.turn.id)
        )
        while True:
            event = (await anext(stream)).event
            if event.HasField("turn_completed") and event.turn_id == started.turn.id:
                break
        events.cancel()

    async def fork(self, thread_id: str, count: int, group_id: str) -> list[agent_pb2.Thread]:
        reply = await self.stub.ForkThread(
            agent_pb2.ForkThreadRequest(thread_id=thread_id, count=count, group_id=group_id)
        )
        return list(reply.threads)

    async def reward(
        self, thread_id: str, name: str, value: float, *, turn_id: str = "", source: str = ""
    ) -> None:
        await self.stub.RecordReward(
            agent_pb2.RecordRewardRequest(
                thread_id=thread_id, name=name, value=value, turn_id=turn_id, source=source
            )
        )

    async def close(self, *threads: agent_pb2.Thread) -> None:
        for thread in threads:
            await self.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))


async def _record_local(root: Path) -> str:
    """The threads on the local model; the plain thread's bundle name."""
    settings = Settings(
        listen="127.0.0.1:0", model="local-echo-1", trace_root=root, local_word_delay=0.0
    )
    server = await AgentServer.start(settings)
    client = _Client(server.address)
    try:
        tokens = {"capture_logprobs": True, "request_token_ids": True, "temperature": 1.0}
        plain = await client.start(instructions="Answer briefly.", metadata={"corpus": "plain"})
        await client.turn(plain.id, "what is a trace bundle")
        await client.turn(plain.id, "and what reduces it")
        await client.reward(plain.id, "helpful", 0.5, source="judge")
        await client.reward(plain.id, "concise", 0.25)
        tools = await client.start(tools=[LOOKUP], metadata={"corpus": "tools"}, **tokens)
        await client.turn(tools.id, "please lookup the tallest mountain", "Mount Everest")
        # A GRPO group, one of whose members is forked again (a fork of a fork).
        parent = await client.start(
            instructions="Solve it.", metadata={"corpus": "forks"}, **tokens
        )
        first = await client.turn(parent.id, "the shared question")
        forks = await client.fork(parent.id, 2, "group-a")
        for n, child in enumerate(forks):
            turn = await client.turn(child.id, f"answer number {n}")
            await client.reward(child.id, "correct", float(n), turn_id=turn.id)
        grandchildren = await client.fork(forks[0].id, 2, "group-b")
        for n, child in enumerate(grandchildren):
            await client.turn(child.id, f"go deeper {n}")
            await client.reward(child.id, "depth", 2.0 + n)
        await client.reward(parent.id, "shared", 1.0, turn_id=first.id)
        await client.close(plain, tools, parent, *forks, *grandchildren)
        return Path(plain.bundle_path).name
    finally:
        await client.channel.close(None)
        await server.stop()


async def _record_scripted(root: Path) -> None:
    provider = await ScriptedProvider().start()
    settings = Settings(
        listen="127.0.0.1:0",
        provider_url=provider.url,
        model="model-a",
        trace_root=root,
        max_retries=0,
        retry_base_delay=0.0,
    )
    server = await AgentServer.start(settings)
    client = _Client(server.address)
    try:
        provider.queue_error(500, {"error": {"code": "server_error", "message": "scripted"}})
        failed = await client.start(metadata={"corpus": "failed"})
        await client.turn(failed.id, "this call fails")
        gate = asyncio.Event()
        item = message("never finished", "msg-held")
        deltas = [text_delta(w, "msg-held") for w in ("Partial", " words")]
        provider.queue(sse(created("resp-held"), item_added(item), *deltas), gate)
        held = await client.start(metadata={"corpus": "interrupted"})
        await client.interrupted(held.id, "tell me a long story", "Partial words")
        gate.set()
        await client.close(failed, held)
    finally:
        await client.channel.close(None)
        await server.stop()
        await provider.stop()


def _damaged(bundles: Path, plain_name: str) -> list[str]:
    """Damaged copies of the plain bundle; the names that need --salvage."""
    plain = bundles / plain_name
    data = (plain / TRACE_FILE_NAME).read_bytes()
    torn = bundles / "damaged-torn"
    shutil.copytree(plain, torn)
    (torn / TRACE_FILE_NAME).write_bytes(data[: len(data) - 7])
    corrupt = bundles / "damaged-corrupt"
    shutil.copytree(plain, corrupt)
    middle = bytearray(data)
    middle[len(data) // 2] ^= 0x5A
    (corrupt / TRACE_FILE_NAME).write_bytes(bytes(middle))
    torn_rewards = bundles / "damaged-torn-rewards"
    shutil.copytree(plain, torn_rewards)
    rewards = (torn_rewards / "rewards.binpb").read_bytes()
    (torn_rewards / "rewards.binpb").write_bytes(rewards[: len(rewards) - 3])
    return [corrupt.name]


def write_states() -> None:
    """Each bundle's state as `trace-reducer reduce` writes it, the corpus root marked."""
    salvage = set(json.loads(SALVAGE_FILE.read_text()))
    shutil.rmtree(STATES, ignore_errors=True)
    STATES.mkdir()
    for bundle in sorted(BUNDLES.iterdir()):
        flags = ["--salvage"] if bundle.name in salvage else []
        out = STATES / f"{bundle.name}.json"
        code = trace_reducer(["reduce", str(bundle), "-o", str(out), *flags])
        assert code == 0, (bundle.name, code)
        out.write_bytes(out.read_bytes().replace(str(BUNDLES).encode(), ROOT_MARK.encode()))


def main(argv: list[str]) -> None:
    if argv != ["--states"]:
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch) / "traces"
            plain = asyncio.run(_record_local(root))
            asyncio.run(_record_scripted(root))
            shutil.rmtree(BUNDLES, ignore_errors=True)
            shutil.copytree(root, BUNDLES)
        salvage = _damaged(BUNDLES, plain)
        SALVAGE_FILE.write_text(json.dumps(sorted(salvage), indent=2) + "\n")
    write_states()
    print(f"{len(list(BUNDLES.iterdir()))} bundles in {BUNDLES}")


if __name__ == "__main__":
    main(sys.argv[1:])
