"""`agent-server chat`: a terminal conversation with a running agent server."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

# Only the defaults here: `chat --help` must not load gRPC; run() loads the client.
from agent_server._health import address_problem, unreachable
from grpc_common import discard_stdout
from rollout_client import ADDRESS_ENV, DEFAULT_ADDRESS, address_from_env
from trace_reducer._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from rollout.agent.v1 import agent_pb2
    from rollout_client import SyncThread, SyncTurn

PROG = "agent-server chat"
HELP = "Type a message and press Enter. Ctrl-C interrupts a reply; /quit (or Ctrl-D) ends the chat."
_HINT = "(Ctrl-C interrupts a reply; /quit or Ctrl-D ends the chat)"
QUIT_COMMANDS = frozenset({"/quit", "/exit"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=address_from_env(),
        help=f"the server (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--auth-token-env",
        metavar="NAME",
        help="send `authorization: Bearer <token>`, the token read from the variable NAME "
        "(default: $ROLLOUT_TOKEN, when set)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's CAs"
    )
    parser.add_argument(
        "--tls-ca", type=Path, metavar="PEM", help="connect with TLS, trusting these certificates"
    )
    parser.add_argument(
        "--model", metavar="NAME", help="model of the thread (default: the server's)"
    )
    parser.add_argument(
        "--instructions", default="", metavar="TEXT", help="system instructions of the thread"
    )


def run(args: argparse.Namespace) -> int:
    from grpc_common import header_secret, variable_name

    problem = address_problem(args.address)
    if problem is not None:
        return _fail(problem)
    if args.model == "":
        # Not the default said another way: an empty name is a mistake (an unset variable).
        return _fail("--model is empty: give a model name, or leave it out for the server's")
    token = None
    if args.auth_token_env:
        try:
            name = variable_name(args.auth_token_env, "--auth-token-env")
            token = header_secret(
                os.environ.get(name, ""), f"the token in {name} (--auth-token-env)"
            )
        except ValueError as error:
            return _fail(str(error))
        if not token:
            return _fail(f"--auth-token-env names {name}, which is unset or empty")
    tls: bool | Path = args.tls_ca if args.tls_ca is not None else bool(args.tls)
    # A stream started closed (`<&-`, `>&-`) is None here: there is no conversation to have, and
    # nothing is opened on the server for it.
    if sys.stdin is None:
        return _fail("standard input is closed: there is nothing to read the messages from")
    if sys.stdout is None:
        return _fail("standard output is closed: there is nowhere to show the replies")
    _enable_line_editing()
    ctrl_c = _CtrlC()
    previous = {number: signal.signal(number, ctrl_c) for number in _HANDLED}
    try:
        return _chat(args, token, tls, ctrl_c)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _chat(args: argparse.Namespace, token: str | None, tls: bool | Path, ctrl_c: _CtrlC) -> int:
    from rollout_client import (
        TOKEN_ENV,
        RolloutError,
        RpcError,
        SyncAgentClient,
        UnauthenticatedError,
        UnavailableError,
    )
    from trace_reducer.bundle._shown import one_line

    # Ctrl-C must reach the main thread, which waits at the prompt in a read that only a signal
    # delivered to it wakes: the threads the client starts (its event loop, gRPC's own, made by
    # its first call) inherit a mask with SIGINT blocked, so the kernel never hands it to them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_HANDLED))
    try:
        try:
            client = SyncAgentClient(args.address, token=token, tls=tls)
        except RolloutError as error:
            return _fail(str(error))
        try:
            thread = client.start_thread(model=args.model or "", instructions=args.instructions)
        except UnavailableError as error:
            client.close()
            return _fail(unreachable(args.address, error.message), EXIT_FAILED)
        except UnauthenticatedError as error:
            client.close()
            return _fail(
                f"{error}; give the token the server was started with: --auth-token-env NAME "
                f"(the variable holding it) or ${TOKEN_ENV}",
                EXIT_FAILED,
            )
        except RpcError as error:
            client.close()
            return _fail(str(error), EXIT_FAILED)
    finally:
        # A Ctrl-C pressed meanwhile arrives now, with no prompt and no turn: it is ignored.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with client:
        try:
            try:
                print(
                    f"connected to {args.address}: thread {one_line(thread.id)} "
                    f"on model {one_line(thread.model)}"
                )
                print(HELP)
                _converse(thread, ctrl_c)
            finally:
                # However the conversation ended (/quit, end of input, a reader gone, a full
                # disk), the thread is closed: its bundle gets its footer now, not when the
                # server next shuts down, and the server stops holding it.
                closed = thread.close()
            if closed.bundle_path:
                print(f"thread closed; bundle: {one_line(closed.bundle_path)}")
            else:
                print("thread closed (the server does not record: no bundle)")
            # Flushed here, where a failure is still caught, not at the interpreter's exit.
            sys.stdout.flush()
        except RpcError as error:
            return _fail(f"lost the server: {error}", EXIT_FAILED)
        except BrokenPipeError:
            # The reader went away (`| head -1`): the Unix way is to stop without a word.
            discard_stdout()
            return EXIT_FAILED
        except OSError as error:
            discard_stdout()
            return _fail(
                f"cannot go on: {error.strerror or error}; thread {thread.id} closed", EXIT_FAILED
            )
    return 128 + ctrl_c.ended_by if ctrl_c.ended_by else EXIT_OK


# Ctrl-C, and the signals that end a terminal's programs (its window closed: SIGHUP; `kill`:
# SIGTERM), which end the chat the same way /quit does, the thread closed on the way out.
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _HungUpError(Exception):
    """SIGTERM or SIGHUP at the prompt: the chat ends as at /quit."""


class _CtrlC:
    """The chat's signal handler: at the prompt Ctrl-C raises, during a reply it interrupts;
    SIGTERM and SIGHUP do the same and then end the chat (`ended`).

    During a reply the handler never raises: a KeyboardInterrupt could land anywhere (inside a
    print, between two calls) and escape as a traceback. It asks the server to interrupt the
    turn instead, without waiting, and the reply's events run to their end as usual.
    """

    def __init__(self) -> None:
        self.at_prompt = False
        self.ended = False
        # The signal that ended the chat; it exits as a process that signal ended does.
        self.ended_by = 0
        self._turn: SyncTurn | None = None
        self._started = False
        self._pressed = False
        self._asked: concurrent.futures.Future[agent_pb2.Turn] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGINT:
            self.ended = True
            self.ended_by = signum
        if self.at_prompt:
            # Disarmed before raising: a second Ctrl-C meanwhile cannot raise outside the try.
            self.at_prompt = False
            raise _HungUpError if self.ended else KeyboardInterrupt
        self._pressed = True
        if self._turn is not None and self._started:
            self._ask()

    def replying(self, turn: SyncTurn) -> None:
        self._turn, self._started, self._pressed, self._asked = turn, False, False, None

    def started(self) -> None:
        self._started = True
        if self._pressed:
            self._ask()

    def done(self) -> None:
        self._turn = None
        if self._asked is not None:
            # The interrupt may have come too late (the turn had ended): nothing to report.
            with contextlib.suppress(Exception):
                self._asked.result()

    def _ask(self) -> None:
        if self._asked is None and self._turn is not None:
            self._asked = self._turn.interrupt_nowait()


def _converse(thread: SyncThread, ctrl_c: _CtrlC) -> None:
    while not ctrl_c.ended:
        try:
            ctrl_c.at_prompt = True
            line = input("you> ")
            ctrl_c.at_prompt = False
        except (EOFError, _HungUpError):
            ctrl_c.at_prompt = False
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
            _reply(thread, text, ctrl_c)


def _reply(thread: SyncThread, text: str, ctrl_c: _CtrlC) -> None:
    """Stream the reply to text; Ctrl-C interrupts it, and its events still run to the end."""
    from rollout.agent.v1 import agent_pb2
    from rollout_client import RpcError, UnavailableError
    from trace_reducer.bundle._shown import one_line

    turn = thread.run_turn(text)
    ctrl_c.replying(turn)
    try:
        try:
            turn.start()
        except UnavailableError:
            raise
        except RpcError as error:
            print(f"[not sent: {one_line(error.message)} ({one_line(error.reason)})]")
            return
        ctrl_c.started()
        print("assistant> ", end="", flush=True)
        for event in turn:
            _show(event)
    finally:
        ctrl_c.done()
    result = turn.result
    print()
    if result is None:
        return
    if result.status == agent_pb2.TURN_STATUS_FAILED:
        print(f"[failed: {one_line(result.error.code)}: {one_line(result.error.message)}]")
    else:
        print(f"[{turn.status_name.lower()}]")


def _show(event: agent_pb2.ThreadEvent) -> None:
    # What the model and its provider say is anyone's text: its control characters are shown
    # as escapes (`\x1b`), never written for the terminal to act on (set its title, write the
    # clipboard, clear the screen); a reply's own newlines and tabs stay.
    from trace_reducer.bundle._shown import one_line, shown_lines

    kind = event.WhichOneof("kind")
    if kind == "agent_message_delta":
        print(shown_lines(event.agent_message_delta.delta), end="", flush=True)
    elif kind == "error":
        retry = ", retrying" if event.error.will_retry else ""
        print(f"\n[provider error: {one_line(event.error.message)}{retry}]", flush=True)


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt, where the platform has readline."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - importing it is what enables it for input()


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    # The message may quote the server's words. (Imported here: `chat --help` loads no
    # protobuf.)
    from trace_reducer.bundle._shown import one_line

    print(f"{PROG}: {one_line(message)}", file=sys.stderr)
    return code
