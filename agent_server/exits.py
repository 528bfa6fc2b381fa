"""The `agent-server` command's name and its exit codes: one place for every module that ends
the process or names it (the CLI, the `--workers` supervisor, `chat`)."""

from __future__ import annotations

PROG = "agent-server"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "PROG"]
