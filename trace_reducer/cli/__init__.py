"""The `trace-reducer` command: one module per command group, `main` the entry point."""

from __future__ import annotations

from collections.abc import Sequence

from .._exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; never lets a traceback out, not even a Ctrl-C's while it loads."""
    # The command loads here, not when this package is imported: the console script imports
    # it before calling main, where nothing could catch a Ctrl-C pressed as the command starts.
    try:
        from ._main import main as run

        return run(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]
