"""The flags every server takes, declared once: `--auth-token-env`, `--tls-cert`, `--tls-key`
(what AccessControl.load reads) and `--event-loop`; and how both programs parse their command
line. Imports no gRPC: every command builds its parser."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from ._loop import EVENT_LOOPS


def add_access_arguments(
    parser: argparse.ArgumentParser, guarded: str = "every RPC but health checks"
) -> None:
    """Add the access flags to a server command's parser (dests auth_token_env, tls_cert,
    tls_key); `guarded` says what the token is asked of."""
    parser.add_argument(
        "--auth-token-env",
        metavar="NAME",
        help=f"require `authorization: Bearer <token>` on {guarded}; "
        "the token is read from the environment variable NAME (default: no token)",
    )
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="serve TLS with this PEM certificate chain"
    )
    parser.add_argument("--tls-key", metavar="PEM", help="the PEM private key of --tls-cert")


def add_event_loop_argument(parser: argparse.ArgumentParser, env: str | None = None) -> None:
    """Add `--event-loop` (dest event_loop, None when not given); `env` names the environment
    variable the command also reads it from, for the help."""
    also = f"; env {env}" if env else ""
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help=f"the asyncio event loop to serve on (default uvloop where installed, else "
        f"asyncio{also})",
    )


def parse_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """`parser.parse_args(argv)` for a program of commands (`trace-reducer reduce ...`), where
    words the command does not take are refused by the command's own parser, with the flag of
    that command nearest a mistyped one: argparse refuses them with the program's usage, which
    names no flag of the command (`usage: trace-reducer [-h] [--version] COMMAND ...`)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = _command_parser(parser, getattr(args, "command", None)) or parser
        message = f"unrecognized arguments: {' '.join(extras)}"
        flags = [flag for flag in command._option_string_actions if flag.startswith("--")]
        for extra in extras:
            if not extra.startswith("--"):
                continue
            nearest = difflib.get_close_matches(extra.partition("=")[0], flags, n=1)
            if nearest:
                message += f" (did you mean {nearest[0]}?)"
                break
        command.error(message)  # exits 2, as every other usage error
    return args


def _command_parser(
    parser: argparse.ArgumentParser, name: str | None
) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name is not None:
            found: argparse.ArgumentParser | None = action.choices.get(name)
            return found
    return None
