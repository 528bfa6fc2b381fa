"""`agent-server chat`: a terminal conversation with a running agent server."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# Only the defaults here: `chat --help` must not load gRPC; run() loads the client.
from rollout_client import ADDRESS_ENV, DEFAULT_ADDRESS, address_from_env

if TYPE_CHECKING:
    from rollout.agent.v1 import agent_pb2
    from rollout_client import SyncThread

PROG = "agent-server chat"
HELP = "Type a message and press Enter. Ctrl-C interrupts a reply; /quit (or Ctrl-D) ends the chat."
_HINT = "(Ctrl-C interrupts a reply; /quit or Ctrl-D ends the chat)"
QUIT_COMMANDS = frozenset({"/quit", "/exit"})

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=address_from_env(),
        help=f"the server (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--auth-token-env",
        metavar="NAME",
        help="send `authorization: Bearer <token>`, the token read from the variable NAME",
    )
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's CAs"
    )
    parser.add_argument(
        "--tls-ca", type=Path, metavar="PEM", help="connect with TLS, trusting these certificates"
    )
    parser.add_argument("--model", default="", help="model of the thread (the server's default)")
    parser.add_argument("--instructions", default="", help="system instructions of the thread")


def run(args: argparse.Namespace) -> int:
    from grpc_common import header_secret
    from rollout_client import RolloutError, RpcError, SyncAgentClient, UnavailableError

    token = None
    if args.auth_token_env:
        try:
            token = header_secret(
                os.environ.get(args.auth_token_env, ""),
                f"the token in {args.auth_token_env} (--auth-token-env)",
            )
        except ValueError as error:
            return _fail(str(error))
        if not token:
            return _fail(f"--auth-token-env names {args.auth_token_env}, which is unset or empty")
    tls: bool | Path = args.tls_ca if args.tls_ca is not None else bool(args.tls)
    _enable_line_editing()
    # Ctrl-C must reach the main thread, which waits at the prompt in a read that only a signal
    # delivered to it wakes: the threads the client starts (its event loop, gRPC's own, made by
    # its first call) inherit a mask with SIGINT blocked, so the kernel never hands it to them.
    ctrl_c = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        try:
            client = SyncAgentClient(args.address, token=token, tls=tls)
        except RolloutError as error:
            return _fail(str(error))
        try:
            thread = client.start_thread(model=args.model, instructions=args.instructions)
        except UnavailableError as error:
            client.close()
            return _fail(f"cannot reach {args.address}: {error.message}", EXIT_FAILED)
        except RpcError as error:
            client.close()
            return _fail(str(error), EXIT_FAILED)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, ctrl_c)
    with client:
        print(f"connected to {args.address}: thread {thread.id} on model {thread.model}")
        print(HELP)
        try:
            _converse(thread)
            closed = thread.close()
        except RpcError as error:
            return _fail(f"lost the server: {error}", EXIT_FAILED)
    if closed.bundle_path:
        print(f"thread closed; bundle: {closed.bundle_path}")
    else:
        print("thread closed (the server does not record: no bundle)")
    return EXIT_OK


def _converse(thread: SyncThread) -> None:
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print(f"\n{_HINT}")
            continue
        text = line.strip()
        if text in QUIT_COMMANDS:
            return
        if text == "/help":
            print(HELP)
        elif text:
            _reply(thread, text)


def _reply(thread: SyncThread, text: str) -> None:
    """Stream the reply to text; Ctrl-C interrupts it, and its events still run to the end."""
    from rollout.agent.v1 import agent_pb2
    from rollout_client import RpcError, UnavailableError

    turn = thread.run_turn(text)
    try:
        interrupting = _despite_ctrl_c(turn.start)
    except UnavailableError:
        raise
    except RpcError as error:
        print(f"[not sent: {error.message} ({error.reason})]")
        return
    print("assistant> ", end="", flush=True)
    if interrupting:
        _despite_ctrl_c(turn.interrupt)
    events = iter(turn)
    while True:
        try:
            event = next(events)
        except StopIteration:
            break
        except KeyboardInterrupt:
            if not interrupting:
                interrupting = True
                _despite_ctrl_c(turn.interrupt)
            continue
        _show(event)
    result = turn.result
    print()
    if result is None:
        return
    if result.status == agent_pb2.TURN_STATUS_FAILED:
        print(f"[failed: {result.error.code}: {result.error.message}]")
    else:
        print(f"[{turn.status_name.lower()}]")


def _despite_ctrl_c(call: Callable[[], object]) -> bool:
    """Run call() (which may be repeated) to its end; whether Ctrl-C was pressed meanwhile."""
    pressed = False
    while True:
        try:
            call()
            return pressed
        except KeyboardInterrupt:
            pressed = True


def _show(event: agent_pb2.ThreadEvent) -> None:
    kind = event.WhichOneof("kind")
    if kind == "agent_message_delta":
        print(event.agent_message_delta.delta, end="", flush=True)
    elif kind == "error":
        retry = ", retrying" if event.error.will_retry else ""
        print(f"\n[provider error: {event.error.message}{retry}]", flush=True)


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt, where the platform has readline."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - importing it is what enables it for input()


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code
