"""The `trace-reducer` command: one module per command group, `main` the entry point."""

from ._main import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]
