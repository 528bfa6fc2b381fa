"""The flags every server takes, declared once: `--auth-token-env`, `--tls-cert`, `--tls-key`
(what AccessControl.load reads) and `--event-loop`; and how both programs parse their command
line. Imports no gRPC: every command builds its parser."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence

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
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    every_command: Callable[[], argparse.ArgumentParser] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` for a program of commands (`trace-reducer reduce ...`), where
    words the command does not take are refused by the command's own parser, with the flag of
    that command nearest a mistyped one: argparse refuses them with the program's usage, which
    names no flag of the command (`usage: trace-reducer [-h] [--version] COMMAND ...`). A
    mistyped flag before the command (`--verison`) is refused the same way, with the program's
    flag nearest it: argparse said only that COMMAND was missing, or not a command.
    `every_command`: the parser with every command's flags, for a program whose `parser` has
    only the named command's (agent-server loads a command's modules only to run it); called
    only to name the command a flag given before it belongs to."""
    words = sys.argv[1:] if argv is None else list(argv)
    _refuse_unknown_before_command(parser, words, every_command or (lambda: parser))
    args, extras = parser.parse_known_args(words)
    if extras:
        command = _command_parser(parser, getattr(args, "command", None)) or parser
        message = f"unrecognized arguments: {' '.join(extras)}"
        flags = _long_flags(command)
        mistyped = [extra.partition("=")[0] for extra in extras if extra.startswith("--")]
        hints = [_nearest(extra, flags) for extra in mistyped]
        hint = next((found for found in hints if found), None)
        if hint is not None:
            message += f" (did you mean {hint}?)"
        elif mistyped:
            message += f" (`{command.prog} --help` lists its flags)"
        command.error(message)  # exits 2, as every other usage error
    return args


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for flag in parser._option_string_actions if flag.startswith("--")]


def _nearest(flag: str, flags: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(flag, flags, n=1)
    return found[0] if found else None


def _refuse_unknown_before_command(
    parser: argparse.ArgumentParser,
    words: Sequence[str],
    every_command: Callable[[], argparse.ArgumentParser],
) -> None:
    """Refuse (exit 2) a long flag before the command that the program does not take, naming
    the command whose flag it is, else the program's flag nearest it."""
    flags = _long_flags(parser)
    for word in words:
        if word == "--" or not word.startswith("--"):
            return  # the command (or whatever comes first): its own parser reads the rest
        name = word.partition("=")[0]
        # argparse takes an unambiguous prefix of a flag (`--vers`): that is no mistake.
        if any(flag.startswith(name) for flag in flags):
            continue
        commands = _command_parsers(every_command())
        taking = [command for command, sub in commands.items() if name in _long_flags(sub)]
        if taking:
            # A command's flag given before it (`--json list`): closer to --version by its
            # letters than to anything, it is no typo of that.
            parser.error(
                f"unrecognized arguments: {word} ({name} is a flag of {', '.join(taking)}: "
                f"give it after the command, `{parser.prog} {taking[0]} {name}`)"
            )
        hint = _nearest(name, flags)
        if hint is not None:
            parser.error(f"unrecognized arguments: {word} (did you mean {hint}?)")
        parser.error(
            f"unrecognized arguments: {word} (`{parser.prog} COMMAND --help` lists a "
            "command's flags)"
        )


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_parser(
    parser: argparse.ArgumentParser, name: str | None
) -> argparse.ArgumentParser | None:
    return _command_parsers(parser).get(name) if name is not None else None
