"""The agent server's one settings object, built from command-line flags and the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent_server import _config_file, logs
from grpc_common import AccessControl, add_access_arguments, split_listen

_T = TypeVar("_T")

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_LOCAL_MODEL = "local-echo-1"
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_MAX_RETRIES = 4
DEFAULT_STREAM_IDLE_TIMEOUT = 300.0
DEFAULT_EVENT_BUFFER = 10_000
DEFAULT_WORD_DELAY = 0.02
DEFAULT_RETRY_BASE_DELAY = 0.5
DEFAULT_CLOSED_THREAD_RETENTION = 600.0
DEFAULT_MAX_CLOSED_THREADS = 1000
DEFAULT_PROVIDER_MAX_CONNECTIONS = 1024
DEFAULT_MAX_TOOL_ROUNDS = 64
DEFAULT_TOOL_OUTPUT_TIMEOUT = 600.0
PROVIDER_APIS = ("responses", "chat")
# What a provider may be asked for beyond the API's core (a named provider's `capabilities`).
CAPABILITIES = ("token-ids", "logprobs")


class ConfigError(ValueError):
    """A flag or environment value that cannot be used."""


class Secret:
    """A string that never shows itself in a repr, str or log line."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class ProviderSettings:
    """One named provider of the config file (`[providers.NAME]`)."""

    name: str
    url: str
    api: str = "responses"
    # The model of threads that name this provider and no model; None: the server's --model.
    model: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    api_key: Secret | None = field(default=None, repr=False)
    capabilities: tuple[str, ...] = CAPABILITIES

    def __post_init__(self) -> None:
        where = f"[providers.{self.name}]"
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{where} url must be an http:// or https:// URL")
        if self.api not in PROVIDER_APIS:
            raise ConfigError(f"{where} api must be one of {', '.join(PROVIDER_APIS)}")
        unknown = [c for c in self.capabilities if c not in CAPABILITIES]
        if unknown:
            raise ConfigError(
                f"{where} capabilities: unknown {', '.join(unknown)} "
                f"(known: {', '.join(CAPABILITIES)})"
            )


@dataclass(frozen=True)
class Settings:
    """Everything the agent server is configured with; immutable once built."""

    listen: str = DEFAULT_LISTEN
    # None selects the built-in local model.
    provider_url: str | None = None
    # The API the default provider speaks: the Responses API or Chat Completions.
    provider_api: str = "responses"
    # Named providers a thread may choose (StartThreadRequest.provider), from the config file.
    providers: tuple[ProviderSettings, ...] = ()
    model: str = DEFAULT_LOCAL_MODEL
    api_key_env: str = DEFAULT_API_KEY_ENV
    api_key: Secret | None = field(default=None, repr=False)
    # None turns recording off.
    trace_root: Path | None = None
    max_retries: int = DEFAULT_MAX_RETRIES
    retry_base_delay: float = DEFAULT_RETRY_BASE_DELAY
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT
    event_buffer: int = DEFAULT_EVENT_BUFFER
    local_word_delay: float = DEFAULT_WORD_DELAY
    # How long a closed thread stays readable (GetThread, StreamEvents replay, ListThreads),
    # and how many closed threads are kept at most; then it is forgotten (NOT_FOUND).
    closed_thread_retention: float = DEFAULT_CLOSED_THREAD_RETENTION
    max_closed_threads: int = DEFAULT_MAX_CLOSED_THREADS
    provider_max_connections: int = DEFAULT_PROVIDER_MAX_CONNECTIONS
    # A turn fails when the model asks for tools in more rounds than this, or when a round's
    # outputs do not all come within the timeout.
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    tool_output_timeout: float = DEFAULT_TOOL_OUTPUT_TIMEOUT
    # Bearer token and TLS of the gRPC server (off by default); its secrets never show.
    access: AccessControl = field(default_factory=AccessControl)
    # HOST:PORT of the Prometheus endpoint (`/metrics`); None serves no metrics.
    metrics_listen: str | None = None
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("--max-retries must be 0 or more")
        if self.retry_base_delay < 0:
            raise ConfigError("--retry-base-delay must be 0 or more")
        if self.stream_idle_timeout <= 0:
            raise ConfigError("--stream-idle-timeout must be more than 0 seconds")
        if self.event_buffer < 1:
            raise ConfigError("--event-buffer must be at least 1")
        if self.local_word_delay < 0:
            raise ConfigError("--local-word-delay must be 0 or more")
        if self.closed_thread_retention < 0:
            raise ConfigError("--closed-thread-retention must be 0 or more")
        if self.max_closed_threads < 0:
            raise ConfigError("--max-closed-threads must be 0 or more")
        if self.provider_max_connections < 1:
            raise ConfigError("--provider-max-connections must be at least 1")
        if self.max_tool_rounds < 0:
            raise ConfigError("--max-tool-rounds must be 0 or more")
        if self.tool_output_timeout <= 0:
            raise ConfigError("--tool-output-timeout must be more than 0 seconds")
        if not self.model:
            raise ConfigError("--model must not be empty")
        if self.provider_api not in PROVIDER_APIS:
            raise ConfigError(f"--provider-api must be one of {', '.join(PROVIDER_APIS)}")
        if self.provider_url is not None and not self.provider_url.startswith(
            ("http://", "https://")
        ):
            raise ConfigError("--provider-url must be an http:// or https:// URL")
        if self.provider_url is not None and self.api_key is not None:
            netloc = self.provider_url.split("://", 1)[1].split("/", 1)[0]
            if "@" in netloc:
                raise ConfigError(
                    "--provider-url carries credentials (user@host) and an API key is set: "
                    "the request can authenticate one way only"
                )
        try:
            split_listen(self.listen)
        except ValueError as error:
            raise ConfigError(f"--listen: {error}") from error
        if self.metrics_listen is not None:
            try:
                split_listen(self.metrics_listen)
            except ValueError as error:
                raise ConfigError(f"--metrics-listen: {error}") from error
        if self.log_level not in logs.LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(logs.LEVELS)}")
        if self.log_format not in logs.FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(logs.FORMATS)}")

    @property
    def recording(self) -> bool:
        return self.trace_root is not None

    @property
    def uses_local_model(self) -> bool:
        return self.provider_url is None

    def warnings(self) -> list[str]:
        """What is legal but most likely a mistake, said once at start-up."""
        found = []
        if self.provider_url is not None and self.model == DEFAULT_LOCAL_MODEL:
            found.append(
                f"--provider-url is set but --model is not: threads that name no model will "
                f"ask {self.provider_url} for {DEFAULT_LOCAL_MODEL!r}, the built-in model's name"
            )
        if self.provider_url is not None and self.api_key is None:
            found.append(
                f"--provider-url is set but {self.api_key_env} (--api-key-env) is unset or "
                "empty: requests go to the provider without an API key"
            )
        return found


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve`: the shared ones, the server's access control, its operation."""
    add_arguments(parser)
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file of settings named like these flags (env ROLLOUT_CONFIG); "
        "flags and environment variables win over it",
    )
    add_access_arguments(parser)
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (env ROLLOUT_METRICS_LISTEN)",
    )
    parser.add_argument(
        "--log-level", choices=logs.LEVELS, help="default info (env ROLLOUT_LOG_LEVEL)"
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        help="text lines or JSON lines on stderr (default text; env ROLLOUT_LOG_FORMAT)",
    )


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The few flags `demo` uses: it always runs the local model on a port of its own."""
    parser.add_argument(
        "--trace-root", help="where the demo's bundle goes (default: a new temporary directory)"
    )
    parser.add_argument(
        "--local-word-delay",
        type=float,
        help=f"seconds between words of the local model (default {DEFAULT_WORD_DELAY})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags every agent-server command shares (defaults resolved in from_args)."""
    parser.add_argument("--listen", help=f"gRPC address HOST:PORT (default {DEFAULT_LISTEN})")
    parser.add_argument(
        "--provider-url",
        help="Responses API base URL (env ROLLOUT_PROVIDER_URL; default: the built-in local model)",
    )
    parser.add_argument(
        "--provider-api",
        choices=PROVIDER_APIS,
        help="the API the provider speaks: the Responses API (default) or Chat Completions "
        "(env ROLLOUT_PROVIDER_API)",
    )
    parser.add_argument("--model", help="provider model (env ROLLOUT_MODEL)")
    parser.add_argument(
        "--api-key-env",
        help="NAME of the environment variable holding the API key "
        f"(default {DEFAULT_API_KEY_ENV})",
    )
    parser.add_argument(
        "--trace-root", help="record every thread under this directory (env ROLLOUT_TRACE_ROOT)"
    )
    parser.add_argument("--max-retries", type=int, help=f"default {DEFAULT_MAX_RETRIES}")
    parser.add_argument(
        "--retry-base-delay",
        type=float,
        help=f"first retry back-off in seconds (default {DEFAULT_RETRY_BASE_DELAY})",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        help=f"seconds without provider data before an attempt fails "
        f"(default {DEFAULT_STREAM_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--event-buffer", type=int, help=f"events kept per thread (default {DEFAULT_EVENT_BUFFER})"
    )
    parser.add_argument(
        "--local-word-delay",
        type=float,
        help=f"seconds between words of the local model (default {DEFAULT_WORD_DELAY})",
    )
    parser.add_argument(
        "--closed-thread-retention",
        type=float,
        help="seconds a closed thread stays readable before it is forgotten "
        f"(default {DEFAULT_CLOSED_THREAD_RETENTION:g})",
    )
    parser.add_argument(
        "--max-closed-threads",
        type=int,
        help=f"closed threads kept at most (default {DEFAULT_MAX_CLOSED_THREADS})",
    )
    parser.add_argument(
        "--max-tool-rounds",
        type=int,
        help="rounds of tool calls a turn may have before it fails "
        f"(default {DEFAULT_MAX_TOOL_ROUNDS})",
    )
    parser.add_argument(
        "--tool-output-timeout",
        type=float,
        help="seconds a turn waits for its tool outputs before it fails "
        f"(default {DEFAULT_TOOL_OUTPUT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--provider-max-connections",
        type=int,
        help="provider connections open at once; turns beyond wait, then fail the attempt "
        f"(default {DEFAULT_PROVIDER_MAX_CONNECTIONS})",
    )


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings: each from its flag, else its environment variable, else the --config
    file, else the default."""
    env = os.environ if environ is None else environ

    def flag(name: str) -> object:
        return getattr(args, name, None)

    config_path = flag("config") or (env.get("ROLLOUT_CONFIG") if hasattr(args, "config") else None)
    try:
        file = _config_file.load(Path(str(config_path))) if config_path else {}
    except _config_file.ConfigFileError as error:
        raise ConfigError(str(error)) from error

    def pick(name: str, env_name: str | None = None) -> Any:
        value = flag(name)
        if value is not None:
            return value
        if env_name and env.get(env_name):
            return env[env_name]
        return file.get(name)

    provider_url = pick("provider_url", "ROLLOUT_PROVIDER_URL")
    api_key_env = pick("api_key_env") or DEFAULT_API_KEY_ENV
    key = _api_key(env.get(api_key_env, ""), api_key_env)
    trace_root = pick("trace_root", "ROLLOUT_TRACE_ROOT")
    access = AccessControl()
    if hasattr(args, "auth_token_env"):
        try:
            access = AccessControl.load(
                token_env=pick("auth_token_env"),
                tls_cert=pick("tls_cert"),
                tls_key=pick("tls_key"),
                environ=env,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error
    return Settings(
        listen=pick("listen", "ROLLOUT_LISTEN") or DEFAULT_LISTEN,
        provider_url=provider_url.rstrip("/") if provider_url else None,
        provider_api=pick("provider_api", "ROLLOUT_PROVIDER_API") or "responses",
        providers=tuple(_named_providers(file.get("providers") or {}, env)),
        model=pick("model", "ROLLOUT_MODEL") or DEFAULT_LOCAL_MODEL,
        api_key_env=api_key_env,
        api_key=Secret(key) if key else None,
        trace_root=Path(trace_root) if trace_root else None,
        max_retries=_default(pick("max_retries"), DEFAULT_MAX_RETRIES),
        retry_base_delay=_default(pick("retry_base_delay"), DEFAULT_RETRY_BASE_DELAY),
        stream_idle_timeout=_default(pick("stream_idle_timeout"), DEFAULT_STREAM_IDLE_TIMEOUT),
        event_buffer=_default(pick("event_buffer"), DEFAULT_EVENT_BUFFER),
        local_word_delay=_default(pick("local_word_delay"), DEFAULT_WORD_DELAY),
        closed_thread_retention=_default(
            pick("closed_thread_retention"), DEFAULT_CLOSED_THREAD_RETENTION
        ),
        max_closed_threads=_default(pick("max_closed_threads"), DEFAULT_MAX_CLOSED_THREADS),
        provider_max_connections=_default(
            pick("provider_max_connections"), DEFAULT_PROVIDER_MAX_CONNECTIONS
        ),
        max_tool_rounds=_default(pick("max_tool_rounds"), DEFAULT_MAX_TOOL_ROUNDS),
        tool_output_timeout=_default(pick("tool_output_timeout"), DEFAULT_TOOL_OUTPUT_TIMEOUT),
        access=access,
        metrics_listen=pick("metrics_listen", "ROLLOUT_METRICS_LISTEN"),
        log_level=pick("log_level", "ROLLOUT_LOG_LEVEL") or "info",
        log_format=pick("log_format", "ROLLOUT_LOG_FORMAT") or "text",
    )


def _named_providers(
    tables: Mapping[str, Mapping[str, Any]], env: Mapping[str, str]
) -> list[ProviderSettings]:
    providers = []
    for name, table in tables.items():
        key_env = table.get("key-env") or DEFAULT_API_KEY_ENV
        key = _api_key(env.get(key_env, ""), key_env)
        providers.append(
            ProviderSettings(
                name=name,
                url=str(table["url"]).rstrip("/"),
                api=table.get("api", "responses"),
                model=table.get("model"),
                api_key_env=key_env,
                api_key=Secret(key) if key else None,
                capabilities=tuple(table.get("capabilities", CAPABILITIES)),
            )
        )
    return providers


def _api_key(value: str, variable: str) -> str:
    """The key as it can go into an `Authorization` header.

    Surrounding white space (a newline from `$(cat keyfile)`) is dropped; any other character
    an HTTP header cannot carry is refused here, at start-up, because the HTTP library's error
    for it would quote the header, key included.
    """
    key = value.strip()
    for position, char in enumerate(key, start=1):
        if not ("!" <= char <= "~"):
            raise ConfigError(
                f"the API key in {variable} has a character an HTTP header cannot carry "
                f"(character {position} of {len(key)}: {_char_name(char)})"
            )
    return key


def _char_name(char: str) -> str:
    if char == " ":
        return "a space"
    if char.isprintable():
        return f"U+{ord(char):04X}, not ASCII"
    return f"control character U+{ord(char):04X}"


def _default(value: _T | None, default: _T) -> _T:
    return default if value is None else value
