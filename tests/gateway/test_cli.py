"""`agent-server gateway`: bad settings get one clear line and exit 2, never a traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from agent_server import cli

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--trace-root is required"),
        (["--trace-root", "t", "--listen", "nowhere"], "--listen: expected HOST:PORT"),
        (["--trace-root", "t", "--session-idle-timeout", "0"], "--session-idle-timeout"),
        (["--trace-root", "t", "--upstream", "ftp://x"], "must be an http:// or https:// URL"),
        # The gateway names its own flag for the live provider, not the agent server's.
        (
            ["--trace-root", "t", "--replay-from", "t", "--replay-on-divergence", "live"],
            "give it with --upstream",
        ),
    ],
)
def test_bad_settings_exit_2_with_one_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROLLOUT_TRACE_ROOT", raising=False)
    monkeypatch.delenv("ROLLOUT_PROVIDER_URL", raising=False)
    assert cli.main(["gateway", *argv]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_a_config_file_sets_the_gateway_keys(tmp_path: Path) -> None:
    from agent_server.gateway import _settings

    config = tmp_path / "rollout.toml"
    config.write_text(
        'trace-root = "traces"\ngateway-listen = "127.0.0.1:9999"\nsession-idle-timeout = 5.0\n'
    )
    parser = __import__("argparse").ArgumentParser()
    _settings.add_arguments(parser)
    settings = _settings.from_args(parser.parse_args(["--config", str(config)]), environ={})
    assert settings.listen == "127.0.0.1:9999"
    assert settings.session_idle_timeout == 5.0
    assert settings.trace_root == tmp_path / "traces"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_the_gateway_serves_on_the_event_loop_asked_for(tmp_path: Path, loop: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        *("gateway", "--listen", "127.0.0.1:0", "--trace-root", str(tmp_path / "traces")),
        *("--local-word-delay", "0", "--event-loop", loop),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = (await process.stdout.readline()).decode()
    assert line.startswith("listening on "), line
    url = line.removeprefix("listening on ").strip()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            answer = await http.post("/responses", json={"model": "m", "input": "hi"})
        assert answer.status_code == 200
        assert answer.json()["status"] == "completed"
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await process.communicate()
    assert process.returncode == 0
    assert f"(event loop {loop})" in stderr.decode()
    assert "Traceback" not in stderr.decode()
