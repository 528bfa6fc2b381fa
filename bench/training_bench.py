"""T1 and T2: what recording tokens costs per token, and what forks cost beside copies of their
prefix, measured on bundles the agent server (its own process, built-in local model) wrote."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench._harness import agent_server_argv, spawn
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from trace_reducer import read_bundle, replay_bundle

QUESTION = "Tell me about the history of the question you were asked before, in detail. " * 8


async def _turn(stub: agent_pb2_grpc.AgentServiceAsyncStub, thread_id: str, text: str) -> None:
    events = stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
    turn = (
        await stub.StartTurn(
            agent_pb2.StartTurnRequest(thread_id=thread_id, input=[agent_pb2.UserInput(text=text)])
        )
    ).turn
    async for response in events:
        if response.event.turn_id == turn.id and response.event.HasField("turn_completed"):
            break


def _bytes(bundle: str) -> int:
    return (Path(bundle) / "trace.binpb").stat().st_size


@dataclass(frozen=True)
class TokenCost:
    turns: int
    tokens: int
    bytes_on: int
    bytes_off: int
    token_bytes: int

    @property
    def per_token(self) -> float:
        """Bundle bytes per output token, logprobs (top 0) and ids on."""
        return self.bytes_on / self.tokens

    @property
    def extra_per_token(self) -> float:
        """What recording the tokens adds per token, against the same turns without."""
        return (self.bytes_on - self.bytes_off) / self.tokens


def measure_token_cost(root: Path, turns: int = 20) -> TokenCost:
    """The same turns with token capture on (logprobs and engine ids) and off."""

    async def run(address: str, capture: bool) -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            stub: agent_pb2_grpc.AgentServiceAsyncStub = agent_pb2_grpc.AgentServiceStub(channel)
            thread = (
                await stub.StartThread(
                    agent_pb2.StartThreadRequest(
                        capture_logprobs=capture, request_token_ids=capture
                    )
                )
            ).thread
            for index in range(turns):
                await _turn(stub, thread.id, f"Question {index}: {QUESTION}")
            await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            return thread.bundle_path

    with spawn(agent_server_argv(trace_root=root / "t1", word_delay=0.0)) as server:
        on = asyncio.run(run(server.address, True))
        off = asyncio.run(run(server.address, False))
    trace = replay_bundle(on)
    tokens = sum(call.output_tokens.count for call in trace.inference_calls.values())
    token_bytes = 0
    with read_bundle(on) as reader:
        for record in reader:
            body = record.WhichOneof("body")
            if body == "prompt_tokens":
                token_bytes += record.ByteSize()
            elif body == "output_text_delta" and record.output_text_delta.HasField("tokens"):
                token_bytes += record.output_text_delta.tokens.ByteSize()
    return TokenCost(turns, tokens, _bytes(on), _bytes(off), token_bytes)


@dataclass(frozen=True)
class ForkCost:
    forks: int
    parent_bytes: int
    fork_bytes: list[int]
    prefix_bytes: int

    @property
    def copied_bytes(self) -> int:
        """The same forks if each copied the prefix: its records as the parent holds them."""
        return sum(self.fork_bytes) + self.forks * self.prefix_bytes


def measure_fork_cost(root: Path, history_turns: int = 20, forks: int = 8) -> ForkCost:
    """A parent of `history_turns` turns forked `forks` times, one turn on each fork."""

    async def run(address: str) -> tuple[str, list[str]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub: agent_pb2_grpc.AgentServiceAsyncStub = agent_pb2_grpc.AgentServiceStub(channel)
            parent = (
                await stub.StartThread(
                    agent_pb2.StartThreadRequest(
                        instructions="You are measured.",
                        capture_logprobs=True,
                        request_token_ids=True,
                        temperature=1.0,
                    )
                )
            ).thread
            for index in range(history_turns):
                await _turn(stub, parent.id, f"Question {index}: {QUESTION}")
            made = (
                await stub.ForkThread(agent_pb2.ForkThreadRequest(thread_id=parent.id, count=forks))
            ).threads
            await asyncio.gather(*(_turn(stub, t.id, "And now?") for t in made))
            for thread in [parent, *made]:
                await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            return parent.bundle_path, [t.bundle_path for t in made]

    with spawn(agent_server_argv(trace_root=root / "t2", word_delay=0.0)) as server:
        parent, made = asyncio.run(run(server.address))
    # The parent's records up to its footer's thread_ended: what a copy of the prefix costs.
    prefix = 0
    with read_bundle(parent) as reader:
        for record in reader:
            if record.WhichOneof("body") in ("header", "thread_ended", "footer"):
                continue
            prefix += record.ByteSize() + 2
    return ForkCost(forks, _bytes(parent), [_bytes(b) for b in made], prefix)
