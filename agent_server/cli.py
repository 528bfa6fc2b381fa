"""The `agent-server` command: `serve`, run the `demo`, `chat` with a server, probe its `health`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from agent_server import _chat, _demo, _health, config, logs
from agent_server.config import ConfigError, Settings
from agent_server.gateway import _settings as gateway_settings
from agent_server.gateway._settings import GatewaySettings
from agent_server.server import AgentServer
from grpc_common import install_signal_handlers
from trace_reducer import __version__

PROG = "agent-server"
log = logging.getLogger("agent_server")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the AgentService gRPC server")
    config.add_serve_arguments(serve)
    serve.set_defaults(run=_serve)
    demo = commands.add_parser(
        "demo",
        help="run one recorded thread on the built-in local model and reduce its bundle",
    )
    config.add_demo_arguments(demo)
    demo.set_defaults(run=_demo_command)
    gateway = commands.add_parser(
        "gateway",
        help="serve an OpenAI-compatible HTTP gateway that records every call it forwards",
    )
    gateway_settings.add_arguments(gateway)
    chat = commands.add_parser("chat", help="talk to a running agent server from the terminal")
    _chat.add_arguments(chat)
    health = commands.add_parser(
        "health", help="exit 0 when a server's health service says SERVING (for probes)"
    )
    _health.add_arguments(health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "chat":
        return _chat.run(args)
    if args.command == "health":
        return _health.run(args)
    if args.command == "gateway":
        return _gateway_command(args)
    try:
        settings = config.from_args(args)
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    # The demo speaks on stdout; only its server's trouble belongs on stderr.
    logs.configure("warning" if args.command == "demo" else settings.log_level, settings.log_format)
    try:
        code: int = asyncio.run(args.run(settings))
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
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    log.info("listening on %s", server.address)
    print(f"listening on {server.address}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    log.info("stopped")
    return EXIT_OK


def _gateway_command(args: argparse.Namespace) -> int:
    # Imported here: `agent-server --help` and the other commands do without aiohttp's server.
    from agent_server import gateway

    try:
        settings = gateway.from_args(args)
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.agent.log_level, settings.agent.log_format)
    try:
        return asyncio.run(_run_gateway(settings))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        print(f"{PROG}: {error or type(error).__name__}", file=sys.stderr)
        return EXIT_FAILED


async def _run_gateway(settings: GatewaySettings) -> int:
    from agent_server.gateway import Gateway
    from agent_server.server import trace_root_problem

    problem = trace_root_problem(settings.trace_root)
    if problem:
        log.warning("%s; sessions will answer 503 until it is fixed", problem)
    try:
        gateway = await Gateway.start(settings)
    except OSError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    log.info("gateway at %s, upstream %s", gateway.url, gateway.upstream_url)
    print(f"listening on {gateway.url}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await gateway.stop()
    log.info("stopped")
    return EXIT_OK


async def _demo_command(settings: Settings) -> int:
    trace_root = settings.trace_root or Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    settings = replace(settings, provider_url=None, listen="127.0.0.1:0", trace_root=trace_root)
    return await _demo.run(settings)


if __name__ == "__main__":
    sys.exit(main())
