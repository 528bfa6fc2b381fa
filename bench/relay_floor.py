"""The floor of the agent's whole streaming job: read a model's stream, record it, relay it.

`python -m bench.relay_floor --serve --model URL --turns N [--record DIR]` runs a bare grpc.aio
server (on the event loop `agent-server serve` runs on by default) whose StreamEvents call does,
for N turns, only what P3 and P5 ask of the agent for every delta, and nothing else:

* POST a prompt to the model (the same stamped model the agent reads in P3 and P5) with aiohttp
  and read its SSE stream: each read split into events by hand, each event's JSON read by orjson;
* with `--record`: the stream's own file made when the call starts (a directory 0700, a file
  0600), the text deltas of each read written to it with one `write()` (as the agent records a
  read's run of deltas as one record), an `fsync` at each turn's end and at the end;
* the text deltas of each read sent to the client as one ThreadEvent (window 0).

No thread, turn or item state, no other records, no payloads, no event buffer, no StartTurn or
other calls: it is the bare read, write and send, so the agent's CPU a delta beside it is what
everything else costs, and recording's floor is this server with `--record` against without.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson

from bench._harness import Process, cpu_seconds, prompt, spawn, stubs
from bench.grpc_floor import STAMP, Floor, delta_response, serve_stream_events
from grpc_common import default_event_loop, run_on_loop
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc

_DELTA = "response.output_text.delta"
# What a delta record holds beyond its text (seq, time, call, item, kind, CRC: P4's ~20 bytes).
_RECORD_HEAD = b"\x00" * 20


class _Relay:
    """StreamEvents: `turns` turns of the model's stream, each read's deltas sent on at once."""

    def __init__(self, model_url: str, turns: int, record: Path | None) -> None:
        self._model_url = model_url
        self._turns = turns
        self._record = record
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _open_file(self) -> int | None:
        if self._record is None:
            return None
        directory = self._record / uuid.uuid4().hex
        directory.mkdir(mode=0o700)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        return os.open(directory / "trace.binpb", flags, 0o600)

    async def stream_events(self, request: agent_pb2.StreamEventsRequest, context: Any) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector)
        session = self._session
        fd = self._open_file()
        index = 0
        try:
            for turn in range(self._turns):
                body = orjson.dumps(
                    {"input": [{"role": "user", "content": prompt(turn)}], "stream": True}
                )
                async with session.post(f"{self._model_url}/responses", data=body) as response:
                    rest = b""
                    async for chunk in response.content.iter_any():
                        *blocks, rest = (rest + chunk).split(b"\n\n")
                        deltas = []
                        for block in blocks:
                            for line in block.split(b"\n"):
                                if line.startswith(b"data:"):
                                    event = orjson.loads(line[5:])
                                    if event.get("type") == _DELTA:
                                        deltas.append(event["delta"])
                        if not deltas:
                            continue
                        text = "".join(deltas)
                        if fd is not None:
                            os.write(fd, _RECORD_HEAD + text.encode())
                        index += 1
                        await context.write(delta_response(index, text).SerializeToString())
                if fd is not None:
                    os.fsync(fd)
        finally:
            if fd is not None:
                os.close(fd)


async def _serve(model_url: str, turns: int, record: Path | None) -> None:
    relay = _Relay(model_url, turns, record)
    try:
        await serve_stream_events(
            grpc.unary_stream_rpc_method_handler(
                relay.stream_events, request_deserializer=agent_pb2.StreamEventsRequest.FromString
            )
        )
    finally:
        await relay.close()


@contextlib.contextmanager
def serve(model_url: str, turns: int, record: Path | None) -> Iterator[Process]:
    """The relay in its own process, reading `turns` turns a call from the model at model_url,
    recording into a new directory under `record` per call (None: not recording)."""
    argv = [sys.executable, "-m", "bench.relay_floor", "--serve", "--model", model_url]
    argv += ["--turns", str(turns)]
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        argv += ["--record", str(record)]
    with spawn(argv) as server:
        yield server


async def _drive(address: str, streams: int, channels: int) -> tuple[list[int], int]:
    latencies: list[int] = []
    messages = 0

    async def one(stub: agent_pb2_grpc.AgentServiceAsyncStub) -> None:
        nonlocal messages
        async for response in stub.StreamEvents(agent_pb2.StreamEventsRequest()):
            now = time.monotonic_ns()
            messages += 1
            for stamp in STAMP.findall(response.event.agent_message_delta.delta):
                latencies.append(now - int(stamp))

    async with stubs(address, channels) as clients:
        await asyncio.gather(*(one(clients[i % len(clients)]) for i in range(streams)))
    return latencies, messages


def drive(server: Process, streams: int, channels: int = 8) -> Floor:
    """`streams` clients at once, each relayed its turns; the server's CPU and the latencies
    of the model's stamped deltas."""
    before = cpu_seconds(server.popen.pid)
    latencies, messages = asyncio.run(_drive(server.address, streams, channels))
    return Floor.of(latencies, messages, cpu_seconds(server.popen.pid) - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--model", required=True, help="the model's Responses URL")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--record", type=Path, help="record each call under this directory")
    args = parser.parse_args()
    run_on_loop(_serve(args.model, args.turns, args.record), default_event_loop())


if __name__ == "__main__":
    main()
