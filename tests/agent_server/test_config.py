"""Settings from flags and environment; the API key never shows itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent_server import config
from agent_server.config import ConfigError, Secret, Settings


def parse(argv: list[str], env: dict[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(argv), env)


def test_defaults_select_the_local_model_without_recording() -> None:
    settings = parse([], {})
    assert settings.listen == "127.0.0.1:50051"
    assert settings.uses_local_model
    assert not settings.recording
    assert (settings.max_retries, settings.stream_idle_timeout) == (4, 300.0)
    assert settings.event_buffer == 10_000
    assert settings.api_key is None


def test_flags_win_over_the_environment() -> None:
    env = {
        "ROLLOUT_PROVIDER_URL": "http://env.example/v1/",
        "ROLLOUT_MODEL": "env-model",
        "ROLLOUT_TRACE_ROOT": "/env/traces",
        "OPENAI_API_KEY": "sk-env",
    }
    from_env = parse([], env)
    assert from_env.provider_url == "http://env.example/v1"
    assert (from_env.model, from_env.trace_root) == ("env-model", Path("/env/traces"))
    assert from_env.api_key == Secret("sk-env")
    flags = parse(
        ["--provider-url", "https://flag.example", "--model", "m", "--trace-root", "/t"], env
    )
    assert (flags.provider_url, flags.model, flags.trace_root) == (
        "https://flag.example",
        "m",
        Path("/t"),
    )


def test_the_key_comes_from_the_named_variable_and_never_shows() -> None:
    settings = parse(["--api-key-env", "MY_KEY"], {"MY_KEY": "sk-hidden", "OPENAI_API_KEY": "x"})
    assert settings.api_key is not None
    assert settings.api_key.reveal() == "sk-hidden"
    for text in (repr(settings), str(settings), repr(settings.api_key), f"{settings.api_key}"):
        assert "sk-hidden" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-retries", "-1"],
        ["--stream-idle-timeout", "0"],
        ["--event-buffer", "0"],
        ["--listen", "no-port"],
        ["--provider-url", "localhost:80"],
    ],
)
def test_bad_values_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse(argv, {})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://alice:s3cret@[::1/v1", "--provider-url is not a valid URL (Invalid IPv6 URL)"),
        ("http://alice:s3cret@host:99999/v1", "--provider-url is not a valid URL (Port out of"),
        ("http://alice:s3cret@host:x/v1", "--provider-url is not a valid URL (Port could not"),
        ("http:///v1", "--provider-url names no host"),
        ("ftp://alice:s3cret@host/v1", "--provider-url must be an http:// or https:// URL"),
    ],
)
def test_a_provider_url_no_request_could_use_is_refused_at_start(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(["--provider-url", url], {})
    assert str(raised.value).startswith(message), raised.value
    assert "s3cret" not in str(raised.value)


def test_a_named_provider_url_is_checked_the_same_way() -> None:
    with pytest.raises(ConfigError, match=r"^\[providers.x\] url is not a valid URL"):
        config.ProviderSettings(name="x", url="http://alice:s3cret@[::1")


def test_the_start_up_warnings_never_show_the_url_credentials() -> None:
    settings = parse(["--provider-url", "http://alice:s3cret@127.0.0.1:9/v1?key=s3cret-q"], {})
    warnings = settings.warnings()
    assert len(warnings) == 2
    assert "http://127.0.0.1:9/v1?key=..." in warnings[0]
    assert not any("s3cret" in warning for warning in warnings)


@pytest.mark.parametrize("raw", ["sk-abc\n", "  sk-abc\t", "\r\nsk-abc\r\n"])
def test_white_space_around_the_key_is_dropped(raw: str) -> None:
    settings = parse([], {"OPENAI_API_KEY": raw})
    assert settings.api_key == Secret("sk-abc")


@pytest.mark.parametrize(
    ("raw", "where"),
    [("sk-a b", "5 of 6: a space"), ("sk\x00x", "3 of 4: control"), ("skü", "3 of 3: U+00FC")],
)
def test_a_key_no_header_can_carry_is_refused_without_showing_it(raw: str, where: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse([], {"OPENAI_API_KEY": raw})
    assert where in str(raised.value)
    assert raw not in str(raised.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--closed-thread-retention", "-1"],
        ["--max-closed-threads", "-1"],
        ["--provider-max-connections", "0"],
    ],
)
def test_bad_limits_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse(argv, {})


FLOAT_SETTINGS = [
    "--retry-base-delay",
    "--stream-idle-timeout",
    "--local-word-delay",
    "--closed-thread-retention",
    "--tool-output-timeout",
]


@pytest.mark.parametrize("flag", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_every_number_flag_is_finite_and_in_range(flag: str, value: str) -> None:
    # Was: `--stream-idle-timeout nan` started a server whose every turn failed.
    with pytest.raises(ConfigError, match=f"^{flag} must be"):
        parse([f"{flag}={value}"], {})


@pytest.mark.parametrize(
    ("line", "flag"),
    [
        ("tool-output-timeout = nan", "--tool-output-timeout"),
        ("stream-idle-timeout = inf", "--stream-idle-timeout"),
        ("retry-base-delay = -0.5", "--retry-base-delay"),
        ("max-retries = 100000000000000000000", "--max-retries"),
        ("event-buffer = 0", "--event-buffer"),
    ],
)
def test_every_number_in_the_config_file_is_checked(tmp_path: Path, line: str, flag: str) -> None:
    # Was: a NaN tool-output-timeout in TOML made tool rounds time out at random.
    file = tmp_path / "agent.toml"
    file.write_text(line + "\n")
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    with pytest.raises(ConfigError, match=f"^{flag} must be"):
        config.from_args(parser.parse_args(["--config", str(file)]), {})


def test_every_number_setting_has_its_bounds() -> None:
    numbers = {
        name
        for name, value in vars(Settings()).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    assert numbers == set(config.NUMBER_SETTINGS)


def test_the_event_loop_comes_from_the_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    assert config.from_args(parser.parse_args([]), {}).event_loop == "uvloop"
    env = {"ROLLOUT_EVENT_LOOP": "asyncio"}
    assert config.from_args(parser.parse_args([]), env).event_loop == "asyncio"
    flag = parser.parse_args(["--event-loop", "uvloop"])
    assert config.from_args(flag, env).event_loop == "uvloop"
    file = tmp_path / "agent.toml"
    file.write_text('event-loop = "asyncio"\n')
    assert config.from_args(parser.parse_args(["--config", str(file)]), {}).event_loop == "asyncio"
    file.write_text('event-loop = "trio"\n')
    with pytest.raises(ConfigError, match=r"^--event-loop must be one of uvloop, asyncio$"):
        config.from_args(parser.parse_args(["--config", str(file)]), {})


@pytest.mark.parametrize("given", ["sk-S3CRETKEY", "S3CRET KEY", "9S3CRET", "S3CRET\n"])
def test_a_key_given_where_its_variable_name_goes_is_refused_unrepeated(
    given: str, tmp_path: Path
) -> None:
    # Was: the start-up warning "--provider-url is set but sk-S3CRETKEY (--api-key-env) is
    # unset or empty" wrote the key into the log.
    argv = ["--provider-url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key-env", given]
    with pytest.raises(ConfigError) as raised:
        parse(argv, {})
    assert str(raised.value) == "--api-key-env takes the NAME of a variable, not its value"
    # The same in a named provider's table of the config file.
    file = tmp_path / "settings.toml"
    file.write_text(f'[providers.p]\nurl = "http://127.0.0.1:9/v1"\nkey-env = {given!r}\n')
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    with pytest.raises(ConfigError) as raised:
        config.from_args(parser.parse_args(["--config", str(file)]), {})
    assert str(raised.value) == "[providers.p] key-env takes the NAME of a variable, not its value"
    assert "S3CRET" not in str(raised.value)


def test_a_variable_name_is_still_named() -> None:
    argv = ["--provider-url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key-env", "_MY_KEY2"]
    (warning,) = parse(argv, {}).warnings()
    assert "_MY_KEY2 (--api-key-env) is unset or empty" in warning
