"""The `trace-reducer` command: one module per command group, `main` the entry point."""

from ._common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from ._main import main

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]
