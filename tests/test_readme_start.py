"""The README's first commands as a newcomer types them: the Quickstart's `make demo` and
`make test`, and the `agent-server serve` that "Talking to the server" starts."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.docs import REPO, block

BIN = Path(sys.executable).parent
VENV = Path(sys.prefix)


def _commands(name: str) -> list[list[str]]:
    lines = block(name, "sh").splitlines()
    return [shlex.split(line, comments=True) for line in lines if not line.startswith(" ")]


def _make(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    # The venv this suite runs in, never set up again from here (-o: its stamp counts as made).
    return subprocess.run(
        # --no-print-directory: under `make test` this make is a sub-make, which would say so.
        ["make", "--no-print-directory", f"VENV={VENV}", "-o", f"{VENV}/.installed", *args],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_quickstart(tmp_path: Path) -> None:
    assert _commands("quickstart") == [["make", "demo"], ["make", "test"]]
    demo = _make("demo", tmp=tmp_path)
    assert demo.returncode == 0, demo.stderr
    lines = demo.stdout.splitlines()
    # The summary: the four turns the README names, the tool calls and their statuses.
    turns = [line.split(": ")[-1] for line in lines if line.startswith("turn turn_")]
    assert turns[:3] == ["COMPLETED", "COMPLETED", "CANCELLED"]
    # The last is interrupted mid-stream; on a very busy machine the reply may end first, and
    # the demo says which.
    [label] = [line for line in lines if line.startswith("[turn 4: ")]
    if turns[3] == "CANCELLED":
        assert label == "[turn 4: interrupted mid-stream by the client: INTERRUPTED]"
    else:
        assert label.startswith("[turn 4: the reply ended before the client's interrupt arrived")
    tools = [line.split(": ")[1].split(",")[0] for line in lines if "tool call lookup" in line]
    assert tools == ["COMPLETED", "CANCELLED"]
    assert any(line.startswith("conversation items: ") for line in lines)
    # Then the path of state.json and, last, the path of view.html.
    state, view = lines[-2].split(": ", 1), lines[-1].split(": ", 1)
    assert [state[0], view[0]] == ["state.json", "view.html"]
    assert Path(state[1]).is_file()
    assert Path(view[1]).is_file()
    assert Path(view[1]).parent == Path(state[1]).parent

    # `make test` is what CI runs (.ci/run); what it does is what the comment lists: its script
    # compiles the TypeScript client, then runs `make check ts-e2e` beside `make pytest`.
    ts_stamp = ("-o", "clients/typescript/node_modules/.installed")
    test_plan = _make("-n", "test", *ts_stamp, tmp=tmp_path)
    assert test_plan.returncode == 0, test_plan.stderr
    assert "scripts/test.sh" in test_plan.stdout
    assert test_plan.stdout.index("npm run --silent build") < test_plan.stdout.index(
        "scripts/test.sh"
    )
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "make --no-print-directory check ts-e2e" in script
    assert "make --no-print-directory pytest" in script
    plan = _make("-n", "check", "test-ts", "pytest", *ts_stamp, tmp=tmp_path)
    assert plan.returncode == 0, plan.stderr
    for step in [
        "gen_protos.py --check",  # codegen freshness
        "check-ts-protos",
        "buf lint",
        "buf format",
        "check-breaking",
        "ruff check",
        "mypy",
        "npm test",
        "pytest -q",
        "scripts/test-backends.sh",  # Chromium, protoc, Go, Java where missing
    ]:
        assert step in plan.stdout, f"make test does not run {step}"
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_serve_as_talking_to_the_server_starts_it(tmp_path: Path) -> None:
    [argv] = _commands("serve-offline")
    assert argv == ["agent-server", "serve", "--trace-root", "traces"]
    comment = block("serve-offline", "sh").split("#", 1)[1]
    assert "listening on 127.0.0.1:50051" in comment
    # The README's address is the default; a free port here (ROLLOUT_LISTEN, as the table says).
    server = subprocess.Popen(
        [str(BIN / argv[0]), *argv[1:]],
        cwd=tmp_path,
        env={**os.environ, "ROLLOUT_LISTEN": "127.0.0.1:0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)\n", line)
        assert found, line
        health = subprocess.run(
            [str(BIN / "agent-server"), "health", "--address", found[1]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (health.returncode, health.stdout) == (0, "SERVING\n"), health.stderr
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, stderr  # SIGTERM shuts down gracefully, exit 0
    # The built-in local model answers: no --provider-url, no network.
    assert "no --provider-url given: using the built-in local model" in stderr
