"""What one large request costs the gateway in memory, and several at once.

`python -m bench.gateway_memory [--messages N] [--bytes B] [--concurrent C] [--tree DIR]...`
starts `agent-server gateway` (recording on) in its own process, before an upstream in another
that answers every call with one short completion whatever it asked, sends C Chat Completions
requests at once, each a body of about B bytes made of N small user messages,
and reports the gateway's resident memory before and its peak (VmHWM) after, with each answer's
status. Each `--tree` runs the gateway from that checkout's packages (PYTHONPATH) in turn, so
two trees are compared in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer
from bench._harness import AGENT_SERVER, spawn
from grpc_common import install_signal_handlers

_ANSWER = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
        }
    ],
}


@dataclass(frozen=True)
class RequestMemory:
    body_bytes: int
    concurrent: int
    statuses: list[int]
    # VmRSS before the requests, VmHWM (the peak) after them, VmRSS after them (what the
    # sessions keep), in KiB.
    before_kib: int
    peak_kib: int
    after_kib: int


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def many_messages_body(messages: int, size: int) -> bytes:
    """A Chat Completions body of `messages` user messages, padded to about `size` bytes."""
    empty = len(json.dumps({"role": "user", "content": ""}, separators=(",", ":"))) + 1
    text = "x" * max(1, size // messages - empty)
    entries = [{"role": "user", "content": text}] * messages
    return json.dumps({"model": "m", "messages": entries}, separators=(",", ":")).encode()


async def _send(url: str, body: bytes, concurrent: int) -> list[int]:
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        answers = await asyncio.gather(
            *(
                http.post("/chat/completions", content=body, headers=headers)
                for _ in range(concurrent)
            )
        )
    return [answer.status_code for answer in answers]


async def _answer(request: HttpRequest, response: HttpResponse) -> None:
    await response.send(200, json.dumps(_ANSWER).encode())


async def _serve_upstream() -> None:
    """The upstream's process: what the gateway's upstream would hold is not the gateway's."""
    server = await LoopbackHttpServer.start(_answer)
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    print(f"listening on {server.url}", flush=True)
    await stop.wait()
    await server.stop()


def measure(
    root: Path, upstream: str, body: bytes, concurrent: int, extra: list[str]
) -> RequestMemory:
    # The console script, not `python -m` (which would put the working directory first).
    argv = [AGENT_SERVER, "gateway", "--listen", "127.0.0.1:0"]
    argv += ["--upstream", upstream, "--trace-root", str(root), "--log-level", "error", *extra]
    with spawn(argv) as gateway:
        pid = gateway.popen.pid
        # One small call first: what every call makes once is made.
        asyncio.run(_send(gateway.address, many_messages_body(1, 64), 1))
        before = _status_kib(pid, "VmRSS")
        statuses = asyncio.run(_send(gateway.address, body, concurrent))
        peak = _status_kib(pid, "VmHWM")
        after = _status_kib(pid, "VmRSS")
    return RequestMemory(len(body), concurrent, statuses, before, peak, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=900_000)
    parser.add_argument("--bytes", type=int, default=31 * 1024 * 1024)
    parser.add_argument("--concurrent", type=int, default=1)
    parser.add_argument("--tree", action="append", type=Path, default=[])
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("gateway_flags", nargs="*", help="more flags for the gateway (after --)")
    args = parser.parse_args()
    if args.serve_upstream:
        asyncio.run(_serve_upstream())
        return
    body = many_messages_body(args.messages, args.bytes)
    # The upstream from this checkout (the trees compared may not have this module).
    with spawn([sys.executable, "-m", "bench.gateway_memory", "--serve-upstream"]) as upstream:
        for tree in args.tree or [None]:
            if tree is not None:
                os.environ["PYTHONPATH"] = str(tree.resolve())
            with tempfile.TemporaryDirectory() as root:
                result = measure(
                    Path(root), upstream.address, body, args.concurrent, args.gateway_flags
                )
            _report(tree, args.messages, args.concurrent, result)


def _report(tree: Path | None, messages: int, concurrent: int, result: RequestMemory) -> None:
    grown = result.peak_kib - result.before_kib
    statuses = {status: result.statuses.count(status) for status in sorted(set(result.statuses))}
    print(
        f"{tree or 'this tree'}: {concurrent} x {messages:,} messages in "
        f"{result.body_bytes / 2**20:.1f} MiB -> statuses {statuses}; "
        f"RSS {result.before_kib / 1024:.0f} MiB before, peak {result.peak_kib / 1024:.0f} MiB "
        f"(+{grown / 1024:.0f} MiB, {grown * 1024 / result.body_bytes / concurrent:.1f} x the "
        f"bodies), {result.after_kib / 1024:.0f} MiB after",
        flush=True,
    )


if __name__ == "__main__":
    main()
