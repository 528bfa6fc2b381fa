"""A corpus of real bundles recorded by the agent server, and helpers to run reduce-all."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from agent_server import AgentServer, Settings
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    completed,
    created,
    failed,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from trace_reducer import replay_bundle, state_to_json

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
# Keeps a Ray that a test starts on loopback, quiet, and out of the shared /tmp/ray.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    # Ray waits 30 s for its GCS server to bind; on a fresh machine whose first vLLM engine is
    # starting at the same time (the suite starts it in the background) that was not enough
    # once. Ray's own choice for a slow store is 120 s.
    "RAY_gcs_server_port_wait_time_s": "120",
}


LOOKUP = agent_pb2.FunctionTool(
    name="lookup",
    description="Look something up.",
    parameters_json=json.dumps({"type": "object", "properties": {"query": {"type": "string"}}}),
)


@dataclass
class Corpus:
    """Bundles of real threads, and what the script that made them says is in them."""

    root: Path
    # model -> [input tokens, output tokens] over its completed calls.
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # provider error code -> failed calls.
    failed_codes: Counter[str] = field(default_factory=Counter)
    # interrupted turn id -> the text it streamed before the interrupt.
    discarded: dict[str, str] = field(default_factory=dict)
    # (tool name, arguments JSON, output submitted) of every tool call, as the client saw it.
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)
    threads: int = 0

    @property
    def bundles(self) -> list[Path]:
        return sorted(p.parent for p in self.root.rglob("trace.binpb"))


class _Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)

    async def thread(self, model: str, *turns: str) -> list[agent_pb2.Turn]:
        """A thread whose turns run to their end, one after the other; then closed."""
        started = await self.stub.StartThread(
            agent_pb2.StartThreadRequest(model=model, metadata={"suite": "batch"})
        )
        thread_id = started.thread.id
        events = self.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
        stream = aiter(events)
        done = []
        for text in turns:
            turn = (await self._start_turn(thread_id, text)).turn
            while True:
                event = (await anext(stream)).event
                if event.HasField("turn_completed") and event.turn_id == turn.id:
                    done.append(event.turn_completed.turn)
                    break
        events.cancel()
        await self.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
        return done

    async def interrupted(self, model: str, text: str, streamed: str) -> str:
        """A thread whose only turn is interrupted once `streamed` reached the client; the
        turn's id. (Deltas may arrive merged, so the text is what is awaited.)"""
        started = await self.stub.StartThread(agent_pb2.StartThreadRequest(model=model))
        thread_id = started.thread.id
        events = self.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
        stream = aiter(events)
        turn = (await self._start_turn(thread_id, text)).turn
        seen = ""
        while seen != streamed:
            event = (await anext(stream)).event
            if event.HasField("agent_message_delta"):
                seen += event.agent_message_delta.delta
        await self.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread_id, turn_id=turn.id))
        events.cancel()
        await self.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
        return str(turn.id)

    async def with_tools(
        self, text: str, tools: list[agent_pb2.FunctionTool], answer: str
    ) -> list[tuple[str, str, str]]:
        """A thread whose turn calls tools, each answered with `answer`; what was called."""
        started = await self.stub.StartThread(agent_pb2.StartThreadRequest(tools=tools))
        thread_id = started.thread.id
        events = self.stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread_id))
        stream = aiter(events)
        turn = (await self._start_turn(thread_id, text)).turn
        calls = []
        while True:
            event = (await anext(stream)).event
            if event.HasField("tool_call_requested"):
                call = event.tool_call_requested
                calls.append((call.name, call.arguments, answer))
                await self.stub.SubmitToolOutputs(
                    agent_pb2.SubmitToolOutputsRequest(
                        thread_id=thread_id,
                        turn_id=turn.id,
                        outputs=[agent_pb2.ToolOutput(call_id=call.call_id, output=answer)],
                    )
                )
            elif event.HasField("turn_completed") and event.turn_id == turn.id:
                break
        events.cancel()
        await self.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))
        return calls

    async def _start_turn(self, thread_id: str, text: str) -> agent_pb2.StartTurnResponse:
        request = agent_pb2.StartTurnRequest(
            thread_id=thread_id, input=[agent_pb2.UserInput(text=text)]
        )
        response: agent_pb2.StartTurnResponse = await self.stub.StartTurn(request)
        return response


def _reply(text: str, usage: dict[str, int], n: int) -> str:
    item = message(text, f"msg-{n}")
    words = text.split(" ")
    deltas = [text_delta(w if i == 0 else f" {w}", f"msg-{n}") for i, w in enumerate(words)]
    return sse(
        created(f"resp-{n}"),
        item_added(item),
        *deltas,
        item_done(item),
        completed(f"resp-{n}", usage),
    )


async def _record(root: Path) -> Corpus:
    corpus = Corpus(root)
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
    replies = 0
    try:
        # Completed threads: each call reports its own token usage.
        for model, turns in (("model-a", 1), ("model-a", 2), ("model-b", 1), ("model-c", 3)):
            for _ in range(turns):
                replies += 1
                usage = {"input_tokens": 7 * replies, "output_tokens": 3 * replies + 1}
                usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
                provider.queue(_reply(f"answer number {replies} from {model}", usage, replies))
                totals = corpus.tokens.setdefault(model, [0, 0])
                totals[0] += usage["input_tokens"]
                totals[1] += usage["output_tokens"]
            await client.thread(model, *(f"question {i}" for i in range(turns)))
            corpus.threads += 1
        # Failed calls, one per thread, each with the provider's error code.
        for status, code in (
            (500, "server_error"),
            (429, "rate_limit_exceeded"),
            (400, "invalid_request_error"),
        ):
            provider.queue_error(status, {"error": {"code": code, "message": f"scripted {code}"}})
            corpus.failed_codes[code] += 1
            await client.thread("model-b", "this call fails")
            corpus.threads += 1
        provider.queue(sse(created("resp-failed"), failed("resp-failed")))
        corpus.failed_codes["server_error"] += 1
        await client.thread("model-a", "this stream fails")
        corpus.threads += 1
        # Interrupted turns: the provider holds the stream open after a few words.
        for n, words in enumerate((["Partial", " words"], ["Only", " a", " start"])):
            gate = asyncio.Event()
            item = message("never finished", f"msg-held-{n}")
            deltas = [text_delta(w, f"msg-held-{n}") for w in words]
            provider.queue(sse(created(f"resp-held-{n}"), item_added(item), *deltas), gate)
            turn_id = await client.interrupted("model-c", "tell me a long story", "".join(words))
            corpus.discarded[turn_id] = "".join(words)
            corpus.threads += 1
            gate.set()
    finally:
        await client.channel.close(None)
        await server.stop()
        await provider.stop()
    # A tool call, on the built-in local model (it calls the tools a message names).
    local = await AgentServer.start(
        replace(settings, provider_url=None, model="local-echo-1", local_word_delay=0.0)
    )
    client = _Client(local.address)
    try:
        corpus.tool_calls += await client.with_tools(
            "please lookup the tallest mountain", [LOOKUP], "Mount Everest"
        )
        corpus.threads += 1
    finally:
        await client.channel.close(None)
        await local.stop()
    return corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """Made once per session; tests reduce copies of it (reduce-all writes into the tree)."""
    root = tmp_path_factory.mktemp("corpus") / "traces"
    return asyncio.run(_record(root))


@pytest.fixture
def traces(corpus: Corpus, tmp_path: Path) -> Path:
    """A fresh copy of the corpus for one test."""
    target = tmp_path / "traces"
    shutil.copytree(corpus.root, target)
    return target


def bundles_under(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("trace.binpb"))


def expected_state(bundle: Path) -> str:
    """What `reduce` would write: the state.json every path must produce."""
    return state_to_json(replay_bundle(bundle))


def reduce_all(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`trace-reducer reduce-all ARGS` as a user runs it (output piped: not a terminal)."""
    return subprocess.run(
        [TRACE_REDUCER, "reduce-all", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def age(path: Path, seconds: float) -> None:
    """Set a file's modification time `seconds` into the past (an old, finished bundle)."""
    stat = path.stat()
    os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))


def many_copies(traces: Path, tmp_path: Path, copies: int) -> Path:
    """`copies` bundles: the corpus's bundles, copied over and over."""
    root = tmp_path / "many"
    sources = bundles_under(traces)
    for n in range(copies):
        source = sources[n % len(sources)]
        target = root / f"{n:05d}"
        target.mkdir(parents=True)
        shutil.copy2(source / "trace.binpb", target / "trace.binpb")
    return root
