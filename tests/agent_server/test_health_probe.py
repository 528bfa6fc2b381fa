"""`agent-server health` speaks grpc.health.v1 without the protobuf runtime: its reading of the
answer matches the generated messages, and it reports each status a real health service gives."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from agent_server._health import SERVING_STATUS, serving_status

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")
Status = health_pb2.HealthCheckResponse.ServingStatus


def test_the_status_table_is_the_protos() -> None:
    assert tuple(Status.Name(value) for value in sorted(Status.values())) == SERVING_STATUS


@pytest.mark.parametrize("value", sorted(Status.values()))
def test_each_status_reads_as_protobuf_writes_it(value: int) -> None:
    assert serving_status(health_pb2.HealthCheckResponse(status=value).SerializeToString()) == (
        value
    )


def test_unknown_fields_are_skipped_and_damage_is_refused() -> None:
    serving = health_pb2.HealthCheckResponse(status=Status.SERVING).SerializeToString()
    # Fields a newer server might add: a string (2), a fixed64 (3), a fixed32 (4), a varint (5).
    extra = b"\x12\x03abc" + b"\x19" + bytes(8) + b"\x25" + bytes(4) + b"\x28\x96\x01"
    assert serving_status(extra + serving) == Status.SERVING
    for broken in (b"\x08", b"\x12\x05ab", b"\x08\xff"):
        with pytest.raises(ValueError, match="HealthCheckResponse"):
            serving_status(broken)


async def _probe(address: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER, "health", "--address", address, "--timeout", "5",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_probe_reports_what_a_real_health_service_says() -> None:
    service = HealthServicer()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        await service.set("", Status.SERVING)
        assert await _probe(address) == (0, "SERVING\n", "")
        await service.set("", Status.NOT_SERVING)
        assert await _probe(address) == (1, "NOT_SERVING\n", "")
    finally:
        await server.stop(None)
