"""The rollout-trace agent server: threads of LLM turns over gRPC, each run recorded."""

import os

# gRPC's C core writes its own diagnostics straight to stderr, beside (and unlike) the server's
# log; it reads this once, when grpc is first imported. GRPC_VERBOSITY=error brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from agent_server.config import Settings
from agent_server.server import AgentServer

__all__ = ["AgentServer", "Settings"]
