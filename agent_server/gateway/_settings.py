"""The gateway's settings: the agent server's provider, recording and access ones, and its own."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_server import _config_file, config, logs
from agent_server.config import MAX_SECONDS, Bounds, ConfigError, Settings
from grpc_common import add_access_arguments, add_event_loop_argument, split_listen

DEFAULT_LISTEN = "127.0.0.1:8090"
DEFAULT_SESSION_IDLE_TIMEOUT = 600.0
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DEFAULT_REQUEST_READ_TIMEOUT = 60.0
# Request body bytes read, parsed and recorded at once: four bodies of the largest size. Parsed,
# a body takes 6 to 16 times its bytes (bench.gateway_memory), so this bounds that phase's
# memory to about 0.8-2 GiB whatever the clients send.
DEFAULT_REQUEST_BODY_BUDGET = 4 * DEFAULT_MAX_REQUEST_BYTES


GATEWAY_NUMBER_SETTINGS: dict[str, Bounds] = {
    "session_idle_timeout": Bounds(0, exclusive=True, high=MAX_SECONDS, unit="seconds"),
    "max_request_bytes": Bounds(1024, integer=True, high=2**31 - 1),
    "request_read_timeout": Bounds(0, exclusive=True, high=MAX_SECONDS, unit="seconds"),
    "request_body_budget": Bounds(1024, integer=True, high=2**62, unit="bytes"),
}


@dataclass(frozen=True)
class GatewaySettings:
    """What `agent-server gateway` runs with. `agent` is the one settings object of the agent
    server (upstream URL as its provider URL, API key, trace root, timeouts, access control,
    logging); the rest is the gateway's own."""

    agent: Settings
    listen: str = DEFAULT_LISTEN
    # A session no request has touched for this long is closed (its bundle finished).
    session_idle_timeout: float = DEFAULT_SESSION_IDLE_TIMEOUT
    # Ask a Chat Completions upstream for the engine's token ids and record them.
    token_ids: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # How long a client may take to send its request body (then 408), and its request head
    # from the connection's start or its last answer (then the connection is closed): a
    # client that trickles either would otherwise hold its connection for good, or an hour.
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    # The request bodies the gateway reads, parses and records at once, in bytes: a request
    # past it is answered 503 `gateway_busy` with Retry-After, at once (was: no bound, and a
    # few clients' bodies of many small messages took the gateway's memory).
    request_body_budget: int = DEFAULT_REQUEST_BODY_BUDGET

    def __post_init__(self) -> None:
        # The gateway's own numbers, checked as the agent server's are (was: NaN accepted, so
        # no session was ever closed for idleness).
        for name, bounds in GATEWAY_NUMBER_SETTINGS.items():
            bounds.check(name, getattr(self, name))
        if self.request_body_budget < self.max_request_bytes:
            # A body the size limit takes would never fit: refused 503 for ever.
            raise ConfigError(
                f"--request-body-budget must be at least the largest request body "
                f"({self.max_request_bytes} bytes), not {self.request_body_budget}"
            )
        try:
            split_listen(self.listen)
        except ValueError as error:
            raise ConfigError(f"--listen: {error}") from error
        if self.agent.trace_root is None:
            raise ConfigError(
                "--trace-root is required: the gateway exists to record (the flag, "
                "ROLLOUT_TRACE_ROOT or trace-root in the config file)"
            )

    @property
    def trace_root(self) -> Path:
        assert self.agent.trace_root is not None
        return self.agent.trace_root


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `agent-server gateway`."""
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"HTTP address the clients call (default {DEFAULT_LISTEN}; gateway-listen in the "
        "config file)",
    )
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="the OpenAI-compatible base URL requests go to, e.g. http://127.0.0.1:8000/v1 "
        "(env ROLLOUT_PROVIDER_URL, provider-url in the config file; default: the built-in "
        "local model)",
    )
    trace_root = parser.add_argument(
        "--trace-root",
        metavar="DIR",
        help="record every session under this directory; required, as the flag, the "
        "environment variable ROLLOUT_TRACE_ROOT or trace-root in the config file",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="NAME of the environment variable holding the upstream's API key "
        f"(default {config.DEFAULT_API_KEY_ENV})",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the agent server's TOML settings file (env ROLLOUT_CONFIG); flags and "
        "environment variables win over it",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        metavar="SECONDS",
        type=float,
        help="seconds without upstream data before a call fails "
        f"(default {config.DEFAULT_STREAM_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--session-idle-timeout",
        metavar="SECONDS",
        type=float,
        help="seconds without a request before a session's bundle is finished "
        f"(default {DEFAULT_SESSION_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--request-body-budget",
        metavar="BYTES",
        type=int,
        help="request body bytes read, parsed and recorded at once; a request past it is "
        f"answered 503 with Retry-After (default {DEFAULT_REQUEST_BODY_BUDGET}, 128 MiB)",
    )
    parser.add_argument(
        "--provider-max-connections",
        metavar="N",
        type=int,
        help="upstream connections open at once "
        f"(default {config.DEFAULT_PROVIDER_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--token-ids",
        action="store_true",
        default=None,
        help="ask a Chat Completions upstream for the engine's token ids and record them",
    )
    add_access_arguments(parser, guarded="every request")
    parser.add_argument(
        "--local-word-delay",
        metavar="SECONDS",
        type=float,
        help="seconds between words of the built-in local model "
        f"(default {config.DEFAULT_WORD_DELAY})",
    )
    config.add_otlp_arguments(parser, spans=config.OTLP_GATEWAY_SPANS)
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        help="the least severe level logged (default info; env ROLLOUT_LOG_LEVEL)",
    )
    config.add_replay_arguments(parser, live="--upstream", branch=False)
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        help="text or JSON lines on stderr (default text; env ROLLOUT_LOG_FORMAT)",
    )
    add_event_loop_argument(parser, env="ROLLOUT_EVENT_LOOP")
    _usage_shows_required(parser, trace_root)


def _usage_shows_required(parser: argparse.ArgumentParser, action: argparse.Action) -> None:
    """The usage line shows the flag without brackets: it is required, though not to argparse,
    which would refuse its environment variable and config-file key in its stead."""
    action.required = True
    try:
        usage = parser.format_usage()
    finally:
        action.required = False
    parser.usage = usage.removeprefix("usage: ").rstrip("\n").replace("%", "%%")


def from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> GatewaySettings:
    """Build the settings: the agent server's from the flags they share (the upstream is its
    provider URL), then the gateway's own. Raises ConfigError."""
    shared = argparse.Namespace(**vars(args))
    shared.provider_url = args.upstream
    # `--listen` is the gateway's HTTP address, not the agent server's gRPC one.
    shared.listen = None
    try:
        agent = config.from_args(shared, environ)
    except ConfigError as error:
        # The agent server's provider flag is the gateway's --upstream.
        raise ConfigError(str(error).replace("--provider-url", "--upstream")) from error
    env = os.environ if environ is None else environ
    config_path = args.config or env.get("ROLLOUT_CONFIG")
    try:
        file = _config_file.load(Path(str(config_path))) if config_path else {}
    except _config_file.ConfigFileError as error:
        raise ConfigError(str(error)) from error
    if args.listen == "":
        raise ConfigError(f"--listen is empty: give HOST:PORT (default {DEFAULT_LISTEN})")
    # The gateway's own settings from the file, said as the agent server's are.
    origins = {
        name: f"{key.replace('_', '-')} in {config_path}"
        for name, key in (
            ("listen", "gateway_listen"),
            ("session_idle_timeout", "session_idle_timeout"),
            ("request_body_budget", "request_body_budget"),
        )
        if getattr(args, name) is None and file.get(key) is not None
    }
    try:
        return GatewaySettings(
            agent=agent,
            listen=args.listen or file.get("gateway_listen") or DEFAULT_LISTEN,
            session_idle_timeout=_pick(
                args.session_idle_timeout,
                file.get("session_idle_timeout"),
                DEFAULT_SESSION_IDLE_TIMEOUT,
            ),
            token_ids=bool(_pick(args.token_ids, file.get("token_ids"), False)),
            request_body_budget=_pick(
                args.request_body_budget,
                file.get("request_body_budget"),
                DEFAULT_REQUEST_BODY_BUDGET,
            ),
        )
    except ConfigError as error:
        raise ConfigError(config.with_origin(str(error), origins)) from error


def _pick(flag: Any, file: Any, default: Any) -> Any:
    if flag is not None:
        return flag
    return default if file is None else file
