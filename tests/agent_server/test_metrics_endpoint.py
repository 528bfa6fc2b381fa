"""The metrics endpoint's own series: build info, process and runtime, no `_created` series."""

from __future__ import annotations

import platform
import urllib.request

from agent_server.telemetry import REGISTRY
from grpc_common import MetricsServer
from trace_reducer import __version__


def test_build_info_process_and_runtime_without_created_series() -> None:
    server = MetricsServer.start("127.0.0.1:0", REGISTRY)
    try:
        with urllib.request.urlopen(server.url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    lines = text.splitlines()
    build = (
        f'rollout_agent_build_info{{python="{platform.python_version()}",'
        f'version="{__version__}"}} 1.0'
    )
    assert build in lines
    names = {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    assert "python_gc_objects_collected_total" in names
    assert "python_info" in names
    assert "rollout_agent_threads_total" in names
    assert not [name for name in names if name.endswith("_created")]
