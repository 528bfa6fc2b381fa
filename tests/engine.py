"""vLLM (CPU build) serving SmolLM2-135M-Instruct for the real-engine tests.

One engine per test session, started by `scripts/vllm-serve.sh` (which first builds what is
missing, once per machine) in the background as soon as the session has collected a test
marked `engine`; those tests run last and wait on its `/health`, so its minutes of start-up
overlap the rest of the suite. `ROLLOUT_TEST_VLLM_URL` points the tests at an engine that is
already running instead (its `/v1` base URL).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from rollout.trace.v1 import common_pb2, state_pb2
from tests.ports import free_port

REPO = Path(__file__).resolve().parent.parent
SERVE_SCRIPT = REPO / "scripts" / "vllm-serve.sh"
MODEL = "smollm2-135m-instruct"
# A fresh machine installs vLLM and converts the model first (minutes), then compiles.
READY_TIMEOUT = 1800.0
_POLL = 1.0


class Engine:
    """The session's vLLM: `start()` returns at once, `url()` waits until it answers."""

    def __init__(self) -> None:
        self.given = os.environ.get("ROLLOUT_TEST_VLLM_URL", "").rstrip("/")
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = Path(tempfile.gettempdir()) / f"rollout-trace-vllm-{os.getpid()}.log"
        self.started_at = 0.0
        # Seconds from the start of the process to the first test that asked for it, and how
        # long that test waited for its first healthy answer.
        self.asked_after: float | None = None
        self.waited: float | None = None
        self.failure = ""

    def start(self) -> None:
        if self.given or self.process is not None:
            return
        self.port = free_port()
        self.started_at = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                # No torch.compile: on two shared cores it is minutes of start-up for a
                # decode rate the tests do not need. At a lower priority, its minute of start-up
                # takes the CPU the rest of the suite leaves.
                [
                    "nice",
                    "-n",
                    "10",
                    str(SERVE_SCRIPT),
                    str(self.port),
                    "--optimization-level",
                    "0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def base_url(self) -> str:
        return self.given or f"http://127.0.0.1:{self.port}/v1"

    def _healthy(self) -> bool:
        root = self.base_url.removesuffix("/v1")
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=5) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def url(self) -> str:
        """The engine's `/v1` base URL once it is healthy; raises RuntimeError when it died or
        never came up."""
        if self.failure:
            raise RuntimeError(self.failure)
        if self.given:
            if not self._healthy():
                raise RuntimeError(f"ROLLOUT_TEST_VLLM_URL={self.given} does not answer /health")
            return self.given
        self.start()
        assert self.process is not None
        deadline = self.started_at + READY_TIMEOUT
        asked_at = time.monotonic()
        if self.asked_after is None:
            self.asked_after = asked_at - self.started_at
        while self.waited is None:
            if self.process.poll() is not None:
                self.failure = (
                    f"vLLM exited with {self.process.returncode} before it was ready:\n"
                    + self.log_tail()
                )
                raise RuntimeError(self.failure)
            if self._healthy():
                self.waited = time.monotonic() - asked_at
                break
            if time.monotonic() > deadline:
                self.failure = f"vLLM not ready after {READY_TIMEOUT:.0f} s:\n" + self.log_tail()
                raise RuntimeError(self.failure)
            # Polling the engine's health endpoint: there is no event to wait on.
            time.sleep(_POLL)
        return self.base_url

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # Its own session: the engine's worker processes go with it.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


ENGINE = Engine()


def check_drift(calls: Sequence[state_pb2.InferenceCall]) -> None:
    """A thread's calls in order: the first has no verdict, each later one is EXACT (its prompt
    extends the ids held so far) or names the first position where it departs from them."""
    assert calls[0].token_drift == common_pb2.TOKEN_DRIFT_UNSPECIFIED
    for before, after in itertools.pairwise(calls):
        held = [*before.prompt_token_ids, *before.output_tokens.ids]
        prompt = list(after.prompt_token_ids)
        assert after.held_token_count == len(held)
        if after.token_drift == common_pb2.TOKEN_DRIFT_EXACT:
            assert prompt[: len(held)] == held
        else:
            at = after.drift_position
            assert prompt[:at] == held[:at]
            assert at == len(prompt) or prompt[at] != held[at]
            expected = (
                common_pb2.TOKEN_DRIFT_REALIGN
                if at >= len(before.prompt_token_ids)
                else common_pb2.TOKEN_DRIFT_FORK
            )
            assert after.token_drift == expected
