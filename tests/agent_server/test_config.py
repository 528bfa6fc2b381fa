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
    with pytest.raises(ConfigError) as raised:
        config.from_args(parser.parse_args(["--config", str(file)]), {})
    assert str(raised.value) == (
        f"--event-loop must be one of uvloop, asyncio (set by event-loop in {file})"
    )


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


# -- every flag from the config file ----------------------------------------------------------

# Flags of `serve` and `gateway` the file names otherwise (docs/operating.md says so), and the
# one it cannot hold.
GATEWAY_FILE_KEYS = {"--listen": "gateway-listen", "--upstream": "provider-url"}
NOT_IN_THE_FILE = {"-h", "--help", "--config"}


def _flags(command: str) -> list[str]:
    from agent_server.gateway import _settings

    parser = argparse.ArgumentParser()
    (config.add_serve_arguments if command == "serve" else _settings.add_arguments)(parser)
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option not in NOT_IN_THE_FILE
    ]


@pytest.mark.parametrize(
    ("command", "flag"),
    [(command, flag) for command in ("serve", "gateway") for flag in _flags(command)],
)
def test_every_flag_of_serve_and_the_gateway_has_its_config_key(command: str, flag: str) -> None:
    # Was: keepalive-time, max-connection-age and the otlp-* flags were "unknown setting",
    # exit 2, though the README says every setting may come from the file.
    from agent_server import _config_file

    key = GATEWAY_FILE_KEYS.get(flag, flag[2:]) if command == "gateway" else flag[2:]
    assert key in _config_file.KEYS


def _serve_file(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Settings:
    file = tmp_path / "agent.toml"
    file.write_text(text)
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    return config.from_args(parser.parse_args(["--config", str(file)]), env or {})


def test_the_connection_and_live_export_settings_come_from_the_file(tmp_path: Path) -> None:
    settings = _serve_file(
        tmp_path,
        "keepalive-time = 30\nmax-connection-age = 3600.5\n"
        'otlp-endpoint = "http://127.0.0.1:4317"\notlp-protocol = "http/protobuf"\n'
        'otlp-header = ["x-team=rl", "x-run=7"]\notlp-include-content = true\n'
        'trace-root = "traces"\n',
    )
    assert (settings.keepalive.time, settings.keepalive.max_connection_age) == (30.0, 3600.5)
    assert settings.otlp_endpoint == "http://127.0.0.1:4317"
    assert settings.otlp_protocol == "http/protobuf"
    assert settings.otlp_headers == ("x-team=rl", "x-run=7")
    assert settings.otlp_include_content is True


def test_a_provider_name_that_is_no_name_is_quoted_with_its_escapes(tmp_path: Path) -> None:
    """Was: `[providers.a<ESC>]0;pwned<BEL>b]: a name is …`, the window retitled."""
    text = '[providers."a\\u001b]0;pwned\\u0007b"]\nurl = "http://127.0.0.1:9/v1"\n'
    with pytest.raises(ConfigError) as raised:
        _serve_file(tmp_path, text)
    assert str(raised.value).endswith(
        "agent.toml: [providers] 'a\\x1b]0;pwned\\x07b': a name is 1 to 64 letters, digits, "
        "'_' or '-'"
    )
    assert "\x1b" not in str(raised.value)


def test_the_gateway_takes_token_ids_from_the_file(tmp_path: Path) -> None:
    from agent_server.gateway import _settings

    file = tmp_path / "gateway.toml"
    file.write_text('trace-root = "traces"\ntoken-ids = true\n')
    parser = argparse.ArgumentParser()
    _settings.add_arguments(parser)
    assert _settings.from_args(parser.parse_args(["--config", str(file)]), {}).token_ids


def test_the_opentelemetry_variables_win_over_the_file(tmp_path: Path) -> None:
    text = 'otlp-protocol = "http/protobuf"\notlp-header = ["k=v"]\notlp-include-content = true\n'
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "k=env",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "false",
    }
    settings = _serve_file(tmp_path, text, env)
    # None: the export reads the variable, as it does with neither flag nor file.
    assert (settings.otlp_protocol, settings.otlp_headers) == (None, ())
    assert settings.otlp_include_content is None


def test_the_opentelemetry_variables_are_the_ones_the_export_reads() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the live export needs the otel extra")
    from trace_reducer.export import _genai, _otel

    assert config.OTLP_ENV == {
        "otlp_protocol": _otel._PROTOCOL_ENV,
        "otlp_header": (_otel._TRACES_HEADERS_ENV, _otel._HEADERS_ENV),
        "otlp_include_content": (_genai.CAPTURE_CONTENT_ENV,),
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('otlp-header = "authorization=S3CRET"', "otlp-header must be a list of strings, not str"),
        ('otlp-header = ["a", 7]', "otlp-header must be a list of strings, not a list holding int"),
        ('otlp-include-content = "S3CRET"', "otlp-include-content must be true or false, not str"),
        ("token-ids = 1", "token-ids must be true or false, not int"),
        ("keepalive-time = true", "keepalive-time must be a number, not a boolean"),
        ('otlp-endpoint = ["http://u:S3CRET@h"]', "otlp-endpoint must be a string, not a list"),
    ],
)
def test_a_new_key_of_the_wrong_type_is_named_not_repeated(
    tmp_path: Path, line: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        _serve_file(tmp_path, line + "\n")
    assert str(raised.value).endswith(message)
    assert "S3CRET" not in str(raised.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("keepalive-time = inf", "--keepalive-time must be"),
        ("keepalive-time = 0", "--keepalive-time must be more than 0 seconds"),
        ("max-connection-age = nan", "--max-connection-age must be a finite number"),
        ("max-connection-age = 1e300", "--max-connection-age must be at most"),
        ('otlp-protocol = "grpcs"', "--otlp-protocol must be one of grpc, http/protobuf"),
    ],
)
def test_the_new_keys_values_are_checked(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        _serve_file(tmp_path, line + "\n")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e300"])
def test_the_keepalive_flags_are_finite_and_in_range(value: str) -> None:
    # Was: `--keepalive-time inf` exited 1 with "cannot convert float infinity to integer".
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    for flag in ("--keepalive-time", "--max-connection-age"):
        with pytest.raises(ConfigError, match=f"^{flag} must be"):
            config.from_args(parser.parse_args([f"{flag}={value}"]), {})


# -- --replay-branch-at -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1"])
def test_replay_branch_at_counts_calls_from_1(tmp_path: Path, value: str) -> None:
    # Was: 0 accepted without a word, and meaning "no branch"; -1 the same.
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    argv = ["--replay-from", str(tmp_path), "--provider-url", "http://127.0.0.1:9/v1"]
    argv += ["--trace-root", str(tmp_path)]
    with pytest.raises(ConfigError, match=rf"^--replay-branch-at must be 1 or more, not {value}$"):
        config.from_args(parser.parse_args([*argv, "--replay-branch-at", value]), {})
    with pytest.raises(ConfigError, match=r"^--replay-branch-at must be 1 or more"):
        _serve_file(tmp_path, f"replay-branch-at = {value}\n")
    branched = config.from_args(parser.parse_args([*argv, "--replay-branch-at", "1"]), {})
    assert branched.replay_branch_at == 1


def test_replay_branch_at_without_a_trace_root_is_refused(tmp_path: Path) -> None:
    # Was: the server started, and every branch ran unrecorded: no fork of the recorded run
    # to diff, export or view, though the README says the server refuses to start.
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    argv = ["--replay-from", str(tmp_path), "--provider-url", "http://127.0.0.1:9/v1"]
    refused = r"^--replay-branch-at records each branch .* give --trace-root"
    with pytest.raises(ConfigError, match=refused):
        config.from_args(parser.parse_args([*argv, "--replay-branch-at", "3"]), {})
    with pytest.raises(ConfigError, match=r"^--replay-branch-at records each branch"):
        _serve_file(
            tmp_path,
            f"replay-from = {str(tmp_path)!r}\nprovider-url = 'http://127.0.0.1:9/v1'\n"
            "replay-branch-at = 3\n",
        )
    # A plain replay records nothing unless asked, as before.
    assert config.from_args(parser.parse_args(argv), {}).trace_root is None


# -- start-up warnings ------------------------------------------------------------------------


def test_a_live_export_without_recording_is_warned_about() -> None:
    # Was: silence, and no span ever sent (the live export reduces the recorded bundles).
    endpoint = ["--otlp-endpoint", "http://127.0.0.1:4317"]
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    (warning,) = config.from_args(parser.parse_args(endpoint), {}).warnings()
    assert warning == (
        "--otlp-endpoint is set but --trace-root is not: the live export sends the spans of "
        "recorded bundles, so nothing will be exported"
    )
    recording = parser.parse_args([*endpoint, "--trace-root", "/tmp/t"])
    assert config.from_args(recording, {}).warnings() == []


def test_a_command_takes_from_the_file_only_the_settings_it_has_flags_for(tmp_path: Path) -> None:
    # One file for `serve` and `gateway`: the gateway has no --replay-branch-at (a branch is a
    # fork, and sessions have none), so the key is `serve`'s alone.
    from agent_server.gateway import _settings

    file = tmp_path / "both.toml"
    file.write_text(
        f'trace-root = "traces"\nreplay-from = {str(tmp_path)!r}\nreplay-branch-at = 3\n'
        'provider-url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
    )
    gateway = argparse.ArgumentParser()
    _settings.add_arguments(gateway)
    agent = _settings.from_args(gateway.parse_args(["--config", str(file)]), {}).agent
    assert agent.replay_branch_at == 0
    assert agent.provider_url == "http://127.0.0.1:9/v1"  # the gateway's --upstream
    serve = argparse.ArgumentParser()
    config.add_serve_arguments(serve)
    assert config.from_args(serve.parse_args(["--config", str(file)]), {}).replay_branch_at == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ROLLOUT_LOG_LEVEL": "loud"},
            "--log-level must be one of debug, info, warning, error (set by ROLLOUT_LOG_LEVEL)",
        ),
        (
            {"ROLLOUT_LISTEN": "bad"},
            "--listen: expected HOST:PORT, got 'bad' (set by ROLLOUT_LISTEN)",
        ),
        (
            {"ROLLOUT_WORKERS": "x"},
            "--workers must be an integer, not 'x' (set by ROLLOUT_WORKERS)",
        ),
        (
            {"ROLLOUT_PROVIDER_URL": "ftp://h"},
            "--provider-url must be an http:// or https:// URL (set by ROLLOUT_PROVIDER_URL)",
        ),
    ],
)
def test_a_bad_value_from_the_environment_names_its_variable(
    env: dict[str, str], message: str
) -> None:
    # Was: `--log-level must be one of …` alone, for a variable set long ago (and from
    # `agent-server demo`, which has no --log-level at all).
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    with pytest.raises(ConfigError) as raised:
        config.from_args(parser.parse_args([]), env)
    assert str(raised.value) == message


def test_of_two_flags_in_a_message_the_one_from_the_environment_is_named() -> None:
    # The container image sets ROLLOUT_METRICS_LISTEN: `serve --workers 2` there said only
    # "--workers 2 cannot be combined with --metrics-listen: …".
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    with pytest.raises(ConfigError) as raised:
        config.from_args(
            parser.parse_args(["--workers", "2"]), {"ROLLOUT_METRICS_LISTEN": "0.0.0.0:9464"}
        )
    message = str(raised.value)
    assert message.startswith("--workers 2 cannot be combined with --metrics-listen: ")
    assert message.endswith(" (--metrics-listen set by ROLLOUT_METRICS_LISTEN)")


def test_a_bad_value_from_the_file_names_its_key_and_the_flag_names_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as raised:
        _serve_file(tmp_path, "max-retries = -1\n", {"ROLLOUT_LOG_LEVEL": "info"})
    file = tmp_path / "agent.toml"
    assert (
        str(raised.value)
        == f"--max-retries must be 0 or more, not -1 (set by max-retries in {file})"
    )
    # What the user typed is not said back to them as from elsewhere.
    with pytest.raises(ConfigError) as raised:
        parse(["--max-retries", "-1"], {"ROLLOUT_LOG_LEVEL": "info"})
    assert str(raised.value) == "--max-retries must be 0 or more, not -1"


def test_the_gateway_s_own_keys_name_the_file_too(tmp_path: Path) -> None:
    from agent_server.gateway import _settings

    file = tmp_path / "gateway.toml"
    file.write_text('trace-root = "traces"\ngateway-listen = "bad"\n')
    parser = argparse.ArgumentParser()
    _settings.add_arguments(parser)
    with pytest.raises(ConfigError) as raised:
        _settings.from_args(parser.parse_args(["--config", str(file)]), {})
    assert (
        str(raised.value)
        == f"--listen: expected HOST:PORT, got 'bad' (set by gateway-listen in {file})"
    )
    with pytest.raises(ConfigError) as raised:
        _settings.from_args(parser.parse_args(["--trace-root", "t"]), {"ROLLOUT_PROVIDER_URL": "x"})
    assert str(raised.value) == (
        "--upstream must be an http:// or https:// URL (set by ROLLOUT_PROVIDER_URL)"
    )


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "[::]:50051", "10.0.0.7:50051"])
def test_listening_beyond_loopback_without_a_token_is_warned_of(listen: str) -> None:
    # Was said nowhere: `serve --listen 0.0.0.0:50051` served anyone who reached the port,
    # on the provider's key, without a word.
    def serve(argv: list[str], env: dict[str, str]) -> Settings:
        parser = argparse.ArgumentParser()
        config.add_serve_arguments(parser)
        return config.from_args(parser.parse_args(argv), env)

    (warning,) = serve(["--listen", listen], {}).warnings()
    assert warning == (
        f"--listen {listen} is not loopback and no --auth-token-env is set: anyone who can "
        "reach it runs turns on the provider's key and reads what is recorded; require a "
        "token with --auth-token-env NAME"
    )
    guarded = serve(["--listen", listen, "--auth-token-env", "T"], {"T": "t0ken"})
    assert guarded.warnings() == []
    for loopback in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051"):
        assert serve(["--listen", loopback], {}).warnings() == []
