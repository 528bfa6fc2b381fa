"""The `agent-server` command: `serve` runs the gRPC server, `demo` shows one recorded run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from agent_server import _demo, config
from agent_server.config import ConfigError, Settings
from agent_server.server import AgentServer
from grpc_common import install_signal_handlers

PROG = "agent-server"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _OneLineFormatter(logging.Formatter):
    """Log lines for people: an exception shows as one line, never as a traceback."""

    def formatException(self, ei: object) -> str:  # noqa: N802
        error = ei[1] if isinstance(ei, tuple) else None
        return f"  ({type(error).__name__}: {error})" if error is not None else ""


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # httpx logs every request at INFO; that is noise next to the server's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the AgentService gRPC server")
    config.add_serve_arguments(serve)
    serve.set_defaults(run=_serve)
    demo = commands.add_parser(
        "demo",
        help="run one recorded thread on the built-in local model and reduce its bundle",
    )
    config.add_arguments(demo)
    demo.set_defaults(run=_demo_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging()
    try:
        settings = config.from_args(args)
        code: int = asyncio.run(args.run(settings))
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        print(f"{PROG}: {error or type(error).__name__}", file=sys.stderr)
        return EXIT_FAILED
    return code


async def _serve(settings: Settings) -> int:
    try:
        server = await AgentServer.start(settings)
    except OSError as error:
        # The message names the address already.
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    if server.local_model_url is not None:
        print(
            f"{PROG}: no --provider-url given: using the built-in local model "
            f"at {server.local_model_url}",
            file=sys.stderr,
            flush=True,
        )
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    print(f"listening on {server.address}", flush=True)
    await stop.wait()
    print(f"{PROG}: shutting down", file=sys.stderr, flush=True)
    await server.stop()
    return EXIT_OK


async def _demo_command(settings: Settings) -> int:
    trace_root = settings.trace_root or Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    settings = replace(settings, provider_url=None, listen="127.0.0.1:0", trace_root=trace_root)
    return await _demo.run(settings)


if __name__ == "__main__":
    sys.exit(main())
