"""The rollout-trace agent server: threads of LLM turns over gRPC, each run recorded."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# gRPC's C core writes its own diagnostics straight to stderr, beside (and unlike) the server's
# log; it reads this once, when grpc is first imported. GRPC_VERBOSITY=error brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

if TYPE_CHECKING:
    from agent_server.config import Settings
    from agent_server.server import AgentServer

# Loaded when first used: `agent-server --help`, `health` and `chat` need neither.
_LAZY = {"AgentServer": "agent_server.server", "Settings": "agent_server.config"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["AgentServer", "Settings"]
