"""One interceptor counts, times and logs every RPC of both servers, by method and code."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from agent_server import AgentServer, Settings
from agent_server.telemetry import REGISTRY
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc
from tests.trace_reducer.bundles import one_turn_bundle
from tests.trace_reducer.test_cli import COMMAND

_GET_THREAD = "/rollout.agent.v1.AgentService/GetThread"
_START_THREAD = "/rollout.agent.v1.AgentService/StartThread"


def _count(method: str, code: str) -> float:
    labels = {"method": method, "code": code}
    return REGISTRY.get_sample_value("rollout_agent_rpcs_total", labels) or 0.0


def _scrape(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode()).splitlines()


def _scrape_until(url: str, shows: Callable[[list[str]], bool], timeout: float = 30) -> list[str]:
    """The scrape once it shows what the RPCs made. A failed RPC's status reaches the client
    before the server's interceptor counts it (`context.abort` sends, then raises), so the
    client's return does not order the count before the scrape."""
    deadline = time.monotonic() + timeout
    while True:
        lines = _scrape(url)
        if shows(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)  # polling the metrics endpoint: the server offers no event to wait on


async def test_the_agent_server_counts_and_times_each_rpc_by_code(tmp_path: Path) -> None:
    before = (_count(_GET_THREAD, "NOT_FOUND"), _count(_START_THREAD, "OK"))
    server = await AgentServer.start(
        Settings(
            listen="127.0.0.1:0",
            trace_root=tmp_path,
            local_word_delay=0,
            metrics_listen="127.0.0.1:0",
        )
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            await stub.StartThread(agent_pb2.StartThreadRequest())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetThread(agent_pb2.GetThreadRequest(thread_id="nope"))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert server.metrics is not None
        lines = await asyncio.to_thread(_scrape_until, server.metrics.url, _times_not_found)
    finally:
        await server.stop()
    assert (_count(_GET_THREAD, "NOT_FOUND"), _count(_START_THREAD, "OK")) == (
        before[0] + 1,
        before[1] + 1,
    )
    assert _times_not_found(lines)


def _times_not_found(lines: list[str]) -> bool:
    return any(
        line.startswith("rollout_agent_rpc_duration_seconds_count{")
        and f'method="{_GET_THREAD}"' in line
        and 'code="NOT_FOUND"' in line
        for line in lines
    )


def test_trace_reducer_serve_serves_rpc_metrics_and_logs_each_request(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    process = subprocess.Popen(
        [
            *COMMAND,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--bundle-root",
            str(tmp_path),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        metrics_line = process.stdout.readline()
        assert metrics_line.startswith("metrics at http://127.0.0.1:"), metrics_line
        address = process.stdout.readline().split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = reducer_pb2_grpc.ReducerServiceStub(channel)
            stub.ReduceBundle(reducer_pb2.ReduceBundleRequest(bundle=bundle.name))
            with pytest.raises(grpc.RpcError) as caught:
                stub.ReduceBundle(reducer_pb2.ReduceBundleRequest(bundle="missing"))
            code = caught.value.code()
        method = "/rollout.reducer.v1.ReducerService/ReduceBundle"
        expected = [
            f'rollout_reducer_rpcs_total{{code="{name}",method="{method}"}} 1.0'
            for name in ("OK", code.name)
        ]
        lines = _scrape_until(metrics_line.split()[-1], lambda got: all(e in got for e in expected))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert process.stderr is not None
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    for line in expected:
        assert line in lines
    assert f"rpc {method} OK " in stderr
    assert f"rpc {method} {code.name} " in stderr
    assert "Traceback" not in stderr
