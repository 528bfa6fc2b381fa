"""The gRPC surface beside AgentService: health and reflection."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent_server.service import SERVICE_NAME
from tests.agent_server.conftest import Harness


async def test_health_and_reflection(agent: Harness) -> None:
    assert SERVICE_NAME == "rollout.agent.v1.AgentService"
    health = health_pb2_grpc.HealthStub(agent.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(agent.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    names: set[str] = set()
    async for answer in reflection.ServerReflectionInfo(iter([request])):
        names = {service.name for service in answer.list_services_response.service}
    assert SERVICE_NAME in names
