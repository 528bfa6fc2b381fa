"""P8: the agent server in front of a real engine (vLLM serving SmolLM2-135M on CPU).

One streamed answer at a time, in alternating rounds: straight to the engine (the peer: the
same request body, read with the same HTTP stack, every SSE event parsed), then through
`agent-server serve` (recording on) to a gRPC client, in each dialect. Time to first token is
from sending the request to the first text; the decode rate is the tokens after the first over
the time they took. Server CPU per delta is the agent process's CPU time over a round divided
by the deltas it streamed.

The engine is `scripts/vllm-serve.sh` on a free port, or ROLLOUT_BENCH_VLLM_URL when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench._harness import AGENT_SERVER, cpu_seconds, spawn
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 32
# Paired rounds: in each, one answer straight to the engine and one through the agent, back to
# back, in an order that alternates; enough pairs that the median ratio's 95 % interval is
# narrower than the 5 % budget on an idle engine (BENCH_P8_ROUNDS to change).
ROUNDS = int(os.environ.get("BENCH_P8_ROUNDS", "30"))
APIS = ("chat", "responses")


@dataclass
class Stream:
    """One answer: seconds to the first text, tokens (the engine's own count, from the usage it
    reports: both paths count the same tokens however their text was split into messages),
    seconds from first text to last."""

    ttft: float
    tokens: int
    decode: float

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / self.decode if self.tokens > 1 and self.decode else 0.0


@dataclass
class Result:
    direct: dict[str, list[Stream]] = field(default_factory=dict)
    agent: dict[str, list[Stream]] = field(default_factory=dict)
    cpu_us_per_delta: dict[str, list[float]] = field(default_factory=dict)
    engine_start: float | None = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Engine:
    def __init__(self) -> None:
        self.url = os.environ.get("ROLLOUT_BENCH_VLLM_URL", "").rstrip("/")
        self.process: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> str:
        if self.url:
            return self.url
        port = _free_port()
        began = time.monotonic()
        log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [str(REPO / "scripts" / "vllm-serve.sh"), str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while True:
            if self.process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"vLLM exited: {log.read()[-2000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)  # polling the engine's health: nothing to wait on
        self.start_seconds = time.monotonic() - began
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)


def _body(api: str) -> dict[str, Any]:
    common: dict[str, Any] = {"model": MODEL, "stream": True, "temperature": 0}
    if api == "chat":
        return {
            **common,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True},
        }
    return {
        **common,
        "input": [{"type": "message", "role": "user", "content": PROMPT}],
        "max_output_tokens": MAX_TOKENS,
        "store": False,
    }


def _text_of(api: str, data: dict[str, Any]) -> str:
    if api == "chat":
        choices = data.get("choices") or [{}]
        return str((choices[0].get("delta") or {}).get("content") or "")
    if data.get("type") == "response.output_text.delta":
        return str(data.get("delta") or "")
    return ""


async def _direct(client: httpx.AsyncClient, base: str, api: str) -> Stream:
    path = "/chat/completions" if api == "chat" else "/responses"
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", base + path, json=_body(api)) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if _text_of(api, data):
                last = time.perf_counter()
                first = first or last
                tokens += 1
            tokens = _usage_tokens(api, data) or tokens
    return Stream(first - sent, tokens, last - first)


def _usage_tokens(api: str, data: dict[str, Any]) -> int:
    """The output tokens an event's usage reports (0 when it carries none)."""
    usage = data.get("usage") if api == "chat" else (data.get("response") or {}).get("usage")
    if not isinstance(usage, dict):
        return 0
    count = usage.get("completion_tokens" if api == "chat" else "output_tokens")
    return count if isinstance(count, int) else 0


async def _through_agent(stub: agent_pb2_grpc.AgentServiceAsyncStub) -> Stream:
    thread = (
        await stub.StartThread(
            agent_pb2.StartThreadRequest(model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS)
        )
    ).thread
    # Window 0: every delta its own event, as the engine streamed them (times the same arrivals).
    events = stub.StreamEvents(
        agent_pb2.StreamEventsRequest(thread_id=thread.id, flush_window_ms=0)
    )
    stream = aiter(events)
    sent = time.perf_counter()
    await stub.StartTurn(
        agent_pb2.StartTurnRequest(thread_id=thread.id, input=[agent_pb2.UserInput(text=PROMPT)])
    )
    first = last = 0.0
    tokens = usage = 0
    async for response in stream:
        event = response.event
        if event.HasField("agent_message_delta") and event.agent_message_delta.delta:
            last = time.perf_counter()
            first = first or last
            tokens += 1
        elif event.HasField("token_usage") and event.token_usage.output_tokens:
            usage = event.token_usage.output_tokens
        elif event.HasField("turn_completed"):
            break
    events.cancel()
    await stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    return Stream(first - sent, usage or tokens, last - first)


async def _rounds(base: str, servers: dict[str, Any], result: Result) -> None:
    channels = {api: grpc.aio.insecure_channel(servers[api].address) for api in APIS}
    stubs = {api: agent_pb2_grpc.AgentServiceStub(channel) for api, channel in channels.items()}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            # A warm-up of each path: connections, the engine's prefix cache for the prompt.
            for api in APIS:
                await _direct(client, base, api)
                await _through_agent(stubs[api])
            for round_ in range(ROUNDS):
                for api in APIS:
                    # The pair's order alternates, so a drift of the engine's pace (other
                    # clients, its cache) weighs on both sides alike.
                    if round_ % 2:
                        direct = await _direct(client, base, api)
                    pid = servers[api].popen.pid
                    before = cpu_seconds(pid)
                    through = await _through_agent(stubs[api])
                    spent = cpu_seconds(pid) - before
                    if not round_ % 2:
                        direct = await _direct(client, base, api)
                    result.direct.setdefault(api, []).append(direct)
                    result.agent.setdefault(api, []).append(through)
                    result.cpu_us_per_delta.setdefault(api, []).append(
                        spent / max(1, through.tokens) * 1e6
                    )
    finally:
        for channel in channels.values():
            await channel.close(None)


def measure(root: Path) -> Result:
    result = Result()
    engine = _Engine()
    with engine as base:
        result.engine_start = engine.start_seconds
        argv = {
            api: [
                AGENT_SERVER,
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--max-retries",
                "0",
                "--provider-url",
                base,
                "--provider-api",
                api,
                "--model",
                MODEL,
                "--trace-root",
                str(root / f"engine-{api}"),
            ]
            for api in APIS
        }
        with spawn(argv["chat"]) as chat, spawn(argv["responses"]) as responses:
            asyncio.run(_rounds(base, {"chat": chat, "responses": responses}, result))
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics that
    bracket it (binomial, normal approximation; wants at least 6 values)."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return float("nan"), float("nan")
    k = max(0, int((n - 1.96 * n**0.5) / 2))
    return ordered[k], ordered[n - 1 - k]


def paired(agent: list[Stream], direct: list[Stream]) -> tuple[list[float], list[float]]:
    """Each pair's TTFT ratio and decode-rate ratio, agent over engine alone (a pair without a
    decode rate on either side gives no rate ratio)."""
    ttft = [a.ttft / d.ttft for a, d in zip(agent, direct, strict=True) if d.ttft > 0]
    rate = [a.rate / d.rate for a, d in zip(agent, direct, strict=True) if a.rate and d.rate]
    return ttft, rate
