"""P5's floor: a bare grpc.aio server streaming the same ThreadEvents at the same pace.

`python -m bench.grpc_floor --serve` runs the server and prints `listening on HOST:PORT`; each
StreamEvents call gets `after_index` text deltas, one every 20 ms, each stamped with its
CLOCK_MONOTONIC send time like P5's model stamps its deltas, sent under the agent's flush-window
rule at the request's `flush_window_ms` (0: one message per delta; else a delta coming less than
the window after the last message sent waits for the window's end, and the deltas made
meanwhile go with it). Nothing else runs in it: no provider, no recording, no event buffer.
It runs on the event loop `agent-server serve` runs on by default (uvloop where installed), so
that the loop is not a difference between the two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from bench._harness import Process, cpu_seconds, spawn, stubs
from grpc_common import default_event_loop, install_signal_handlers, run_on_loop
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc

_THREAD_ID = "thread_" + "0" * 32
_TURN_ID = "turn_" + "0" * 32
_ITEM_ID = "msg_" + "0" * 32
STAMP = re.compile(r"@(\d+) ")


def delta_response(index: int, text: str) -> agent_pb2.StreamEventsResponse:
    """The message a floor sends for a run of deltas: the event the agent makes, stamped now."""
    response = agent_pb2.StreamEventsResponse()
    event = response.event
    event.index = index
    event.thread_id = _THREAD_ID
    event.turn_id = _TURN_ID
    event.agent_message_delta.item_id = _ITEM_ID
    event.agent_message_delta.delta = text
    event.time.seconds, event.time.nanos = divmod(time.time_ns(), 1_000_000_000)
    return response


def _streamer(interval: float) -> Any:
    """StreamEvents's handler: `after_index` stamped deltas, `interval` apart."""

    async def stream_events(
        request: agent_pb2.StreamEventsRequest, context: Any
    ) -> AsyncIterator[agent_pb2.StreamEventsResponse]:
        loop = asyncio.get_running_loop()
        window = request.flush_window_ms / 1000
        total = request.after_index
        made = 0
        index = 0
        pending: list[str] = []
        next_word = loop.time() + interval
        hold_until = 0.0
        while made < total or pending:
            wake = next_word if made < total else hold_until
            if pending:
                wake = min(wake, hold_until)
            await asyncio.sleep(max(0.0, wake - loop.time()))
            now = loop.time()
            if made < total and now >= next_word:
                pending.append(f" word@{time.monotonic_ns()} ")
                made += 1
                next_word = now + interval
            if pending and now >= hold_until:
                index += 1
                response = delta_response(index, "".join(pending))
                pending = []
                hold_until = now + window if window else 0.0
                yield response

    return grpc.unary_stream_rpc_method_handler(
        stream_events,
        request_deserializer=agent_pb2.StreamEventsRequest.FromString,
        response_serializer=agent_pb2.StreamEventsResponse.SerializeToString,
    )


async def serve_stream_events(handler: Any) -> None:
    """A bare grpc.aio server answering AgentService's StreamEvents with handler, on
    127.0.0.1:0, until SIGTERM or SIGINT; it prints `listening on HOST:PORT` once it is up."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "rollout.agent.v1.AgentService", {"StreamEvents": handler}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop(None)


@dataclass(frozen=True)
class Floor:
    deltas: int
    messages: int
    p50_ms: float
    p99_ms: float
    server_cpu_seconds: float

    @classmethod
    def of(cls, latencies: list[int], messages: int, server_cpu_seconds: float) -> Floor:
        """The figures of one run: each stamped delta's latency in ns, the messages sent."""
        ordered = sorted(latencies)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))] / 1e6

        return cls(len(ordered), messages, pct(0.50), pct(0.99), server_cpu_seconds)


async def _drive(address: str, streams: int, deltas: int, window: int) -> tuple[list[int], int]:
    latencies: list[int] = []
    messages = 0

    async def one(stub: agent_pb2_grpc.AgentServiceAsyncStub) -> None:
        nonlocal messages
        request = agent_pb2.StreamEventsRequest(after_index=deltas, flush_window_ms=window)
        async for response in stub.StreamEvents(request):
            now = time.monotonic_ns()
            messages += 1
            for stamp in STAMP.findall(response.event.agent_message_delta.delta):
                latencies.append(now - int(stamp))

    async with stubs(address, 8) as clients:
        await asyncio.gather(*(one(clients[i % len(clients)]) for i in range(streams)))
    return latencies, messages


@contextlib.contextmanager
def serve(interval: float = 0.02) -> Iterator[Process]:
    """The bare server in its own process, a delta every `interval` seconds."""
    argv = [sys.executable, "-m", "bench.grpc_floor", "--serve", "--interval", str(interval)]
    with spawn(argv) as server:
        yield server


def drive(server: Process, streams: int, deltas: int, window: int = 0) -> Floor:
    """`deltas` stamped deltas to each of `streams` clients at once, at this flush window."""
    before = cpu_seconds(server.popen.pid)
    latencies, messages = asyncio.run(_drive(server.address, streams, deltas, window))
    return Floor.of(latencies, messages, cpu_seconds(server.popen.pid) - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--interval", type=float, default=0.02)
    handler = _streamer(parser.parse_args().interval)
    run_on_loop(serve_stream_events(handler), default_event_loop())


if __name__ == "__main__":
    main()
