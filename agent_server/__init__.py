"""The rollout-trace agent server: threads of LLM turns over gRPC, each run recorded."""

from agent_server.config import Settings
from agent_server.server import AgentServer

__all__ = ["AgentServer", "Settings"]
