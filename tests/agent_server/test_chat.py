"""`agent-server chat` in a pseudo-terminal, against `agent-server serve` on its local model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent_server.local_model import reply_words
from rollout.trace.v1 import common_pb2
from tests.agent_server.conftest import serve
from tests.agent_server.scripted_provider import ScriptedProvider, answer
from tests.commands import exec_argv
from tests.live_server import AGENT_SERVER, live_server, server_env
from trace_reducer import replay_bundle

PROMPT = "you> "


class Terminal:
    """A program on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._master, slave = pty.openpty()
        # A session of its own whose terminal is the pty, so Ctrl-C typed into it is a SIGINT
        # to the chat, as in a real terminal.
        self.process = subprocess.Popen(
            exec_argv(argv, terminal=True), stdin=slave, stdout=slave, stderr=slave, env=env
        )
        os.close(slave)
        self.output = ""
        self._seen = 0

    def type(self, text: str) -> None:
        os.write(self._master, text.encode())

    def expect(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        """Wait for pattern in what was printed since the last match; return the match."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = compiled.search(self.output, self._seen)
            if found:
                self._seen = found.end()
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"never printed {pattern!r}; got:\n{self.output}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self._master], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self._master, 65536)
        except OSError:  # EIO: the program has exited and closed the terminal
            return False
        self.output += data.decode(errors="replace").replace("\r\n", "\n")
        return bool(data)

    def wait(self, timeout: float = 30) -> int:
        while self._read(0.1):
            pass
        code = self.process.wait(timeout)
        while self._read(0):
            pass
        os.close(self._master)
        return code


def test_chat_streams_interrupts_with_ctrl_c_and_quits(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    # Slow words: there is time to press Ctrl-C before the second reply ends.
    with live_server("--trace-root", str(traces), "--local-word-delay", "0.05") as server:
        chat = Terminal(
            [AGENT_SERVER, "chat", "--address", server.address], server_env(TERM="dumb")
        )
        try:
            chat.expect(r"connected to .*: thread (thread_\w+) on model local-echo-1")
            chat.expect(PROMPT)
            chat.type("hello there\r")
            chat.expect(re.escape("".join(reply_words("hello there"))))
            chat.expect(r"\[completed\]")
            chat.expect(PROMPT)

            chat.type("now stop me\r")
            chat.expect('You said: "now stop me"')
            # Pressed again and again: each press lands wherever the chat is (inside a print,
            # between two reads), and none may escape as a traceback or end the program.
            for _ in range(3):
                chat.type("\x03")
            chat.expect(r"\[interrupted\]")
            chat.expect(PROMPT)
            assert chat.process.poll() is None, "Ctrl-C ended the program"

            # At the prompt, Ctrl-C only says how to leave. CPython's readline misses a signal
            # that lands between writing the prompt and waiting for a key (it is seen with the
            # next key or signal), and this test presses the moment the prompt shows: it presses
            # again until the hint shows, so a Ctrl-C that never works still fails it.
            for _ in range(5):
                chat.type("\x03")
                with contextlib.suppress(AssertionError):
                    chat.expect(r"/quit or Ctrl-D ends the chat", timeout=3)
                    break
            else:
                raise AssertionError(f"Ctrl-C at the prompt printed no hint:\n{chat.output}")
            chat.type("/quit\r")
            bundle = Path(chat.expect(r"thread closed; bundle: (\S+)").group(1))
            assert chat.wait() == 0
        finally:
            if chat.process.poll() is None:
                chat.process.kill()
    assert "Traceback" not in chat.output
    assert bundle.parent == traces
    rollout = replay_bundle(bundle)
    assert rollout.recording_complete
    statuses = [
        rollout.turns[t].execution.status for t in rollout.threads[bundle_thread(bundle)].turn_ids
    ]
    assert statuses == [
        common_pb2.EXECUTION_STATUS_COMPLETED,
        common_pb2.EXECUTION_STATUS_CANCELLED,
    ]


async def test_what_the_model_says_never_drives_the_terminal(
    provider: ScriptedProvider, tmp_path: Path
) -> None:
    """A reply and a provider's error holding escape sequences (the window title, a screen
    clear) are printed with their control characters as escapes; the reply's newline stays
    (was: written as they came, for the terminal to act on)."""
    provider.queue(answer("owned\x1b]0;pwned\x07 now\x1b[2J\nsecond line"))
    provider.queue_error(400, {"error": {"message": "bad\x1b]0;err\x07", "code": "x\x9b31m"}})
    async with serve("--provider-url", provider.url, "--trace-root", str(tmp_path)) as served:
        chat = Terminal(
            [AGENT_SERVER, "chat", "--address", served.address], server_env(TERM="dumb")
        )
        try:
            await asyncio.to_thread(chat.expect, PROMPT)
            chat.type("hello\r")
            await asyncio.to_thread(chat.expect, r"\[completed\]")
            chat.type("again\r")
            await asyncio.to_thread(chat.expect, r"\[failed: .*\]")
            chat.type("/quit\r")
            await asyncio.to_thread(chat.expect, r"thread closed")
            assert await asyncio.to_thread(chat.wait) == 0
        finally:
            if chat.process.poll() is None:
                chat.process.kill()
    assert "owned\\x1b]0;pwned\\x07 now\\x1b[2J\nsecond line" in chat.output
    assert "bad\\x1b]0;err\\x07" in chat.output
    assert "x\\x9b31m" in chat.output
    for sequence in ("\x1b]0;", "\x1b[2J", "\x07", "\x9b"):
        assert sequence not in chat.output


def bundle_thread(bundle: Path) -> str:
    return bundle.name.split("-", 1)[1]


def test_chat_says_so_when_no_server_listens() -> None:
    with live_server() as server:
        address = server.address
    # The server has stopped: nothing listens there any more.
    result = subprocess.run(
        [AGENT_SERVER, "chat", "--address", address],
        env=server_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"agent-server chat: no agent server answers at {address}")
    assert "Traceback" not in result.stderr


def test_chat_reads_its_token_from_the_named_variable() -> None:
    with live_server("--auth-token-env", "AGENT_TOKEN", AGENT_TOKEN="chat-token") as server:
        anonymous = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address],
            env=server_env(),
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert anonymous.returncode == 1
        # Was the status alone: what the server wants, not how this command gives it.
        assert anonymous.stderr.splitlines() == [
            "agent-server chat: UNAUTHENTICATED: this server requires `authorization: Bearer "
            "<token>` (MISSING_TOKEN); give the token the server was started with: "
            "--auth-token-env NAME (the variable holding it) or $ROLLOUT_TOKEN"
        ]
        wrong = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address],
            env=server_env(ROLLOUT_TOKEN="not-it"),
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 1
        assert "(INVALID_TOKEN); give the token the server was started with" in wrong.stderr
        # As the hint says, $ROLLOUT_TOKEN is read when no --auth-token-env is given.
        from_env = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address],
            env=server_env(ROLLOUT_TOKEN="chat-token"),
            input="hi\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert from_env.returncode == 0, from_env.stderr
        assert "[completed]" in from_env.stdout
        # Piped input works too: the session ends at end of input.
        allowed = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address, "--auth-token-env", "MY_TOKEN"],
            env=server_env(MY_TOKEN="chat-token"),
            input="hi\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert allowed.returncode == 0, allowed.stderr
        assert "[completed]" in allowed.stdout
        assert "thread closed (the server does not record: no bundle)" in allowed.stdout
        unset = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address, "--auth-token-env", "NOPE"],
            env=server_env(),
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert unset.returncode == 2
        assert "NOPE, which is unset or empty" in unset.stderr


def test_chat_refuses_a_closed_stdin_or_stdout_before_opening_a_thread(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    with live_server("--trace-root", str(traces)) as server:
        no_stdin = subprocess.run(
            # The chat starts with no standard input at all (`<&-`).
            exec_argv([AGENT_SERVER, "chat", "--address", server.address], closed=[0]),
            env=server_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        no_stdout = subprocess.run(
            # Closed once its stdout is set up: `>&-`.
            exec_argv([AGENT_SERVER, "chat", "--address", server.address], closed=[1]),
            env=server_env(),
            input="hello\n",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert no_stdin.returncode == 2, no_stdin.stderr  # was 1, an AttributeError traceback
    assert no_stdin.stderr == (
        "agent-server chat: standard input is closed: there is nothing to read the messages from\n"
    )
    assert no_stdout.returncode == 2, no_stdout.stderr
    assert no_stdout.stderr == (
        "agent-server chat: standard output is closed: there is nowhere to show the replies\n"
    )
    # Neither opened a thread.
    assert not traces.exists() or not any(traces.iterdir())


def _only_bundle(traces: Path) -> Path:
    (bundle,) = traces.iterdir()
    return bundle


def test_a_reader_gone_ends_the_chat_quietly_and_closes_its_thread(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    with live_server("--trace-root", str(traces)) as server:
        chat = subprocess.Popen(
            [AGENT_SERVER, "chat", "--address", server.address],
            env=server_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert chat.stdin is not None
        assert chat.stdout is not None
        assert chat.stderr is not None
        # `| head -1`: one line read, then the reader goes away; the reply meets a broken pipe.
        assert chat.stdout.readline().startswith("connected to ")
        chat.stdout.close()
        chat.stdin.write("hello there\n/quit\n")
        chat.stdin.close()
        code = chat.wait(timeout=60)
        stderr = chat.stderr.read()
        chat.stderr.close()
        # Checked while the server still runs: a thread left open would get its footer only
        # when the server shuts down.
        complete = replay_bundle(_only_bundle(traces)).recording_complete
    assert code == 1
    assert stderr == ""  # was a BrokenPipeError traceback
    assert complete  # was: the thread stayed ACTIVE on the server


def test_a_failing_stdout_is_one_line_and_the_thread_is_closed(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    with live_server("--trace-root", str(traces)) as server, open("/dev/full", "w") as full:
        result = subprocess.run(
            [AGENT_SERVER, "chat", "--address", server.address],
            env=server_env(),
            input="hello there\n/quit\n",
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
        bundle = _only_bundle(traces)
        complete = replay_bundle(bundle).recording_complete
    assert result.returncode == 1
    assert result.stderr == (
        "agent-server chat: cannot go on: No space left on device; "
        f"thread {bundle_thread(bundle)} closed\n"
    )  # was an OSError traceback
    assert complete  # was: the thread stayed ACTIVE on the server


@pytest.mark.parametrize("hangup", [signal.SIGHUP, signal.SIGTERM])
def test_a_hangup_ends_the_chat_and_closes_its_thread(tmp_path: Path, hangup: int) -> None:
    # Was: the terminal closed (SIGHUP) or `kill` (SIGTERM) ended the chat on the spot, its
    # thread left open on the server and its bundle unfinished until the server stopped.
    traces = tmp_path / "traces"
    with live_server("--trace-root", str(traces), "--local-word-delay", "0.05") as server:
        chat = Terminal(
            [AGENT_SERVER, "chat", "--address", server.address], server_env(TERM="dumb")
        )
        try:
            chat.expect(PROMPT)
            chat.type("stop me midway please\r")
            chat.expect('You said: "stop me midway please"')
            # During a reply: the turn is interrupted, then the chat ends as at /quit.
            chat.process.send_signal(hangup)
            bundle = Path(chat.expect(r"thread closed; bundle: (\S+)").group(1))
            assert chat.wait() == 128 + hangup
        finally:
            if chat.process.poll() is None:
                chat.process.kill()
    assert "Traceback" not in chat.output
    rollout = replay_bundle(bundle)
    assert rollout.recording_complete
    (turn_id,) = rollout.threads[bundle_thread(bundle)].turn_ids
    assert rollout.turns[turn_id].execution.status == common_pb2.EXECUTION_STATUS_CANCELLED
