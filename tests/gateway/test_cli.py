"""`agent-server gateway`: bad settings get one clear line and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_server import cli


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
