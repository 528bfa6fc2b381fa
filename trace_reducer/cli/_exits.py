"""The `trace-reducer` command's name and its exit codes, in a module that imports nothing: the
entry point (trace_reducer.cli.main) needs EXIT_INTERRUPTED before the command has loaded."""

from __future__ import annotations

PROG = "trace-reducer"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Stopped by SIGTERM (128 + 15), as cleanly as by Ctrl-C.
EXIT_TERMINATED = 143

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE", "PROG"]
