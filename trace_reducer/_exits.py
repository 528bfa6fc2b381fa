"""Both commands' names and their exit codes, one place for `trace-reducer` and `agent-server`.

Here, not in grpc_common (the package both import too): this module imports nothing, and
importing grpc_common loads asyncio, while trace_reducer.cli.main needs EXIT_INTERRUPTED before
the command has loaded, to answer a Ctrl-C pressed as it starts. agent_server imports
trace_reducer already; trace_reducer never imports agent_server.
"""

from __future__ import annotations

TRACE_REDUCER = "trace-reducer"
AGENT_SERVER = "agent-server"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Stopped by SIGTERM (128 + 15), as cleanly as by Ctrl-C.
EXIT_TERMINATED = 143

__all__ = [
    "AGENT_SERVER",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "TRACE_REDUCER",
]
