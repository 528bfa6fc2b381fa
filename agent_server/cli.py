"""The `agent-server` command: `serve`, run the `demo`, `chat` with a server, record any agent
through the `gateway`, probe a server's `health`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_reducer._exits import AGENT_SERVER as PROG
from trace_reducer._exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    import logging

    from agent_server.config import Settings
    from agent_server.gateway._settings import GatewaySettings


def _log() -> logging.Logger:
    # logging costs a tenth of `--help`'s start-up; only the servers log.
    import logging

    return logging.getLogger("agent_server")


# Each command, its help, and the module and function that add its arguments. Only the
# command being run has its module imported: `--help`, `health` and `chat` never load the server.
_COMMANDS = {
    "serve": ("run the AgentService gRPC server", "agent_server.config", "add_serve_arguments"),
    "demo": (
        "run one recorded thread on the built-in local model and reduce its bundle",
        "agent_server.config",
        "add_demo_arguments",
    ),
    "chat": (
        "talk to a running agent server from the terminal",
        "agent_server._chat",
        "add_arguments",
    ),
    "gateway": (
        "serve an OpenAI-compatible HTTP gateway that records every call it forwards",
        "agent_server.gateway._settings",
        "add_arguments",
    ),
    "health": (
        "exit 0 when a server's health service says SERVING (for probes)",
        "agent_server._health",
        "add_arguments",
    ),
}


class _Version(argparse.Action):
    """`--version`, read from the version's one source file without importing trace_reducer
    (which would load the whole reducer) or the installed metadata (a scan of site-packages)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, nargs=0, help="show the version and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"{PROG} {_package_version()}")  # on stdout, as argparse's own version action does
        parser.exit()


def _package_version() -> str:
    # find_spec locates a top-level package without running its __init__.
    spec = importlib.util.find_spec("trace_reducer")
    locations = spec.submodule_search_locations if spec is not None else None
    if locations:
        path = Path(next(iter(locations)), "bundle", "_version.py")
        source = importlib.util.spec_from_file_location("_rollout_trace_version", path)
        if source is not None and source.loader is not None:
            module = importlib.util.module_from_spec(source)
            source.loader.exec_module(module)
            return str(module.__version__)
    from trace_reducer.bundle._version import __version__

    return __version__


def _parser(command: str | None, *, every: bool = False) -> argparse.ArgumentParser:
    """The program's parser, with the flags of the named command (of every one: `every`,
    which loads every command's modules)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module, function) in _COMMANDS.items():
        subparser = commands.add_parser(name, help=help_text)
        if every or name == command:
            getattr(importlib.import_module(module), function)(subparser)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command named on the command line (the top level has no options taking values)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a Ctrl-C at any point, even while its modules load, exits 130 quietly."""
    # Each command imports what it needs inside _main (a quarter second for the server): a
    # Ctrl-C pressed as it starts lands in those imports, outside the commands' own handlers.
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    from grpc_common import open_standard_fds, parse_command_line

    # Before anything opens a file or socket: started with fd 0, 1 or 2 closed (`<&-`), the
    # next one opened takes its number; gRPC's poller took fd 0 for its epoll and, now and then,
    # aborted the client at exit (`epoll_wait error: Bad file descriptor`, SIGABRT).
    # sys.stdin and sys.stdout stay None, so `chat` still says which stream is closed.
    open_standard_fds()
    argv = sys.argv[1:] if argv is None else list(argv)
    # Every command's flags only to name the command a flag given before it is of (`--listen
    # x serve`; was: only a hint at --help).
    args = parse_command_line(
        _parser(_command(argv)), argv, every_command=lambda: _parser(None, every=True)
    )
    if args.command in ("chat", "health"):
        return _client_command(args)
    if args.command == "gateway":
        return _gateway_command(args)
    from agent_server import config, logs
    from agent_server.config import ConfigError
    from grpc_common import run_on_loop

    run = _serve if args.command == "serve" else _demo_command
    try:
        settings = config.from_args(args)
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    # The demo speaks on stdout; only its server's trouble belongs on stderr.
    level = "warning" if args.command == "demo" else settings.log_level
    # Each of `serve --workers N`'s processes says which it is on every line.
    role = {"worker": settings.worker.index} if settings.worker is not None else None
    logs.configure(level, settings.log_format, process=role)
    if args.command == "serve" and settings.workers > 1 and settings.worker is None:
        from agent_server import workers

        supervisor = workers.supervise(settings, argv)
        try:
            return run_on_loop(supervisor, settings.event_loop)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except Exception as error:  # noqa: BLE001 - the last line of defence, as below
            print(f"{PROG}: {error or type(error).__name__}", file=sys.stderr)
            return EXIT_FAILED
    try:
        code: int = run_on_loop(run(settings), settings.event_loop)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        print(f"{PROG}: {error or type(error).__name__}", file=sys.stderr)
        return EXIT_FAILED
    return code


def _client_command(args: argparse.Namespace) -> int:
    """`chat` or `health`; each says what went wrong itself, this is the last line of defence."""
    from agent_server import _chat, _health

    command = _chat if args.command == "chat" else _health
    try:
        code: int = command.run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - no traceback for users
        print(f"{command.PROG}: {error or type(error).__name__}", file=sys.stderr)
        return EXIT_FAILED
    return code


async def _serve(settings: Settings) -> int:
    import asyncio

    from agent_server.config import ConfigError
    from agent_server.server import AgentServer
    from grpc_common import (
        ListenError,
        announce,
        install_signal_handlers,
        running_event_loop,
        tune_collector_for_serving,
    )

    # Before the port opens: a SIGTERM that comes as soon as clients can connect (and start
    # threads) must shut down gracefully, closing their bundles, not kill the process.
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    try:
        server = await AgentServer.start(settings)
    except (ConfigError, ListenError) as error:
        # A ListenError names the address: `cannot listen on HOST:PORT: address already in use`.
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    tune_collector_for_serving()
    if settings.worker is not None:
        from agent_server.workers import watch_supervisor

        watch_supervisor(stop.set)
    _log().info("listening on %s (event loop %s)", server.address, running_event_loop())
    announce(f"listening on {server.address}", _log().warning)
    await stop.wait()
    _log().info("shutting down")
    await server.stop()
    if settings.worker is not None:
        from agent_server.workers import leave_socket_dir

        leave_socket_dir(settings.worker)
    _log().info("stopped")
    return EXIT_OK


def _gateway_command(args: argparse.Namespace) -> int:
    # Imported here: `agent-server --help` and the other commands do without aiohttp's server.
    from agent_server import gateway, logs
    from agent_server.config import ConfigError
    from grpc_common import run_on_loop

    try:
        settings = gateway.from_args(args)
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.agent.log_level, settings.agent.log_format)
    try:
        return run_on_loop(_run_gateway(settings), settings.agent.event_loop)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        print(f"{PROG}: {error or type(error).__name__}", file=sys.stderr)
        return EXIT_FAILED


async def _run_gateway(settings: GatewaySettings) -> int:
    import asyncio

    from agent_server.gateway import Gateway
    from agent_server.server import trace_root_problem
    from grpc_common import (
        ListenError,
        announce,
        install_signal_handlers,
        running_event_loop,
        tune_collector_for_serving,
    )

    problem = trace_root_problem(settings.trace_root)
    if problem:
        _log().warning("%s; sessions will answer 503 until it is fixed", problem)
    from agent_server.config import ConfigError

    # Before the port opens, as serve's: a SIGTERM as soon as it listens closes the sessions.
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    try:
        gateway = await Gateway.start(settings)
    except (ConfigError, ListenError) as error:  # ConfigError: --otlp-endpoint's settings
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    tune_collector_for_serving()
    _log().info(
        "gateway at %s, upstream %s (event loop %s)",
        gateway.url,
        gateway.upstream_url,
        running_event_loop(),
    )
    announce(f"listening on {gateway.url}", _log().warning)
    await stop.wait()
    _log().info("shutting down")
    await gateway.stop()
    _log().info("stopped")
    return EXIT_OK


async def _demo_command(settings: Settings) -> int:
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from agent_server import _demo
    from agent_server.server import trace_root_problem
    from rollout_client import FailedPreconditionError

    # The demo has nothing to show without its bundle: a trace root it cannot record under is
    # bad input, one line (was the server's start-up warning, then the client's
    # `FAILED_PRECONDITION: failed to start rollout recording: … (RECORDING_START_FAILED)`).
    if settings.trace_root is not None:
        problem = trace_root_problem(settings.trace_root)
        if problem is not None:
            print(f"{PROG}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    trace_root = settings.trace_root or Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    settings = replace(settings, provider_url=None, listen="127.0.0.1:0", trace_root=trace_root)
    try:
        return await _demo.run(settings)
    except FailedPreconditionError as error:
        if error.reason != "RECORDING_START_FAILED":
            raise
        # What the checks above cannot see coming (a directory the system refuses to make).
        print(f"{PROG}: {error.message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
