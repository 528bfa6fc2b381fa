"""The agent server's one settings object, built from command-line flags and the environment."""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent_server import _config_file, logs
from grpc_common import (
    AccessControl,
    Keepalive,
    add_access_arguments,
    add_event_loop_argument,
    default_event_loop,
    event_loop_problem,
    header_secret,
    is_loopback,
    redact_url,
    split_listen,
    variable_name,
)

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
DEFAULT_WORKERS = 1
# How the supervisor of `serve --workers N` tells a process it starts that it is worker INDEX
# and where the workers' sockets are ("INDEX:DIR"): no flag, so that none shows in --help.
WORKER_ENV = "_ROLLOUT_WORKER"
# Each worker is a whole server process; past this many a machine runs out of cores first.
MAX_WORKERS = 256
REPLAY_PACES = ("recorded", "fast")
REPLAY_ON_DIVERGENCE = ("fail", "live")
PROVIDER_APIS = ("responses", "chat")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
# The OpenTelemetry variables the live export reads for what a `--otlp-*` setting leaves unset
# (trace_reducer.export: resolve_protocol, the headers, capture_content). Set, one of them wins
# over the config file, as every environment variable does.
OTLP_ENV: dict[str, tuple[str, ...]] = {
    "otlp_protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    "otlp_header": ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"),
    "otlp_include_content": ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",),
}
# What a provider may be asked for beyond the API's core (a named provider's `capabilities`).
CAPABILITIES = ("token-ids", "logprobs")


class ConfigError(ValueError):
    """A flag or environment value that cannot be used."""


def check_http_url(url: str, flag: str) -> None:
    """Refuse at start-up a URL no request could be sent to. The message never repeats the
    URL: it may carry credentials."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as error:
        raise ConfigError(f"{flag} is not a valid URL ({error})") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{flag} must be an http:// or https:// URL")
    if not parts.hostname:
        raise ConfigError(f"{flag} names no host")


@dataclass(frozen=True)
class Bounds:
    """The values a number setting may take: finite, at least `low` (or above it when
    `exclusive`), at most `high`; an integer setting takes integers only."""

    low: float
    exclusive: bool = False
    high: float = math.inf
    integer: bool = False
    unit: str = ""

    def check(self, name: str, value: object) -> None:
        flag = "--" + name.replace("_", "-")
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{flag} must be {kind}, not {value!r}")
        if self.integer and not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, not {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, not {value!r}")
        unit = f" {self.unit}" if self.unit else ""
        if self.exclusive and value <= self.low:
            raise ConfigError(f"{flag} must be more than {self.low:g}{unit}, not {value!r}")
        if value < self.low:
            raise ConfigError(f"{flag} must be {self.low:g} or more, not {value!r}")
        if value > self.high:
            raise ConfigError(f"{flag} must be at most {self.high:g}{unit}, not {value!r}")


# Longer than any timer asyncio and the HTTP library keep exactly (and than any real wait).
MAX_SECONDS = 365 * 24 * 3600.0
_MAX_COUNT = 2**31 - 1

# gRPC takes its connection timings as milliseconds in a C int.
_MAX_GRPC_SECONDS = (2**31 - 1) // 1000

# Every number setting of Settings and what it may be: checked in one place, at start-up,
# whether it came from a flag, the environment or the --config file.
NUMBER_SETTINGS: dict[str, Bounds] = {
    "max_retries": Bounds(0, integer=True, high=_MAX_COUNT),
    "retry_base_delay": Bounds(0, high=MAX_SECONDS, unit="seconds"),
    "stream_idle_timeout": Bounds(0, exclusive=True, high=MAX_SECONDS, unit="seconds"),
    "event_buffer": Bounds(1, integer=True, high=_MAX_COUNT),
    "local_word_delay": Bounds(0, high=MAX_SECONDS, unit="seconds"),
    "closed_thread_retention": Bounds(0, high=MAX_SECONDS, unit="seconds"),
    "max_closed_threads": Bounds(0, integer=True, high=_MAX_COUNT),
    "provider_max_connections": Bounds(1, integer=True, high=_MAX_COUNT),
    "max_tool_rounds": Bounds(0, integer=True, high=_MAX_COUNT),
    "tool_output_timeout": Bounds(0, exclusive=True, high=MAX_SECONDS, unit="seconds"),
    "replay_branch_at": Bounds(0, integer=True, high=_MAX_COUNT),
    "workers": Bounds(1, integer=True, high=MAX_WORKERS),
}
# The settings that go into an object of their own (Keepalive), and a given --replay-branch-at
# (0 is Settings' "off", never a call: calls count from 1), checked as they are read.
GIVEN_NUMBER_SETTINGS: dict[str, Bounds] = {
    "keepalive_time": Bounds(0, exclusive=True, high=_MAX_GRPC_SECONDS, unit="seconds"),
    "max_connection_age": Bounds(0, exclusive=True, high=_MAX_GRPC_SECONDS, unit="seconds"),
    "replay_branch_at": Bounds(1, integer=True, high=_MAX_COUNT),
}


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
        check_http_url(self.url, f"{where} url")
        if self.api not in PROVIDER_APIS:
            raise ConfigError(f"{where} api must be one of {', '.join(PROVIDER_APIS)}")
        unknown = [c for c in self.capabilities if c not in CAPABILITIES]
        if unknown:
            raise ConfigError(
                f"{where} capabilities: unknown {', '.join(unknown)} "
                f"(known: {', '.join(CAPABILITIES)})"
            )


@dataclass(frozen=True)
class WorkerRole:
    """What makes a `serve` process one of a supervisor's workers (`--workers N`): its index
    and the private directory where every worker's Unix socket is."""

    index: int
    socket_dir: Path

    def socket_path(self, index: int) -> Path:
        return self.socket_dir / f"worker-{index}.sock"


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
    keepalive: Keepalive = field(default_factory=Keepalive)
    # HOST:PORT of the Prometheus endpoint (`/metrics`); None serves no metrics.
    metrics_listen: str | None = None
    # Live OTLP export of each turn's spans (off without an endpoint); protocol, headers and
    # timeout default to the OpenTelemetry exporter environment. Headers may hold secrets.
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otlp_headers: tuple[str, ...] = field(default=(), repr=False)
    # None: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT decides, as for export-otlp.
    otlp_include_content: bool | None = None
    log_level: str = "info"
    log_format: str = "text"
    # The event loop `serve` and `gateway` run on (grpc_common.EVENT_LOOPS); a server started
    # in-process runs on its caller's loop.
    event_loop: str = "asyncio"
    # A bundle, or a directory of bundles, whose recorded provider streams answer every
    # inference request (the replay provider); None: a live provider or the local model.
    replay_from: Path | None = None
    replay_pace: str = "fast"
    # What a request no recorded call matches gets: "fail" (HTTP 409, replay_divergence) or
    # "live" (the --provider-url provider, for that thread from there on).
    replay_on_divergence: str = "fail"
    # Calls of a recorded thread from this one on (1-based) go to the live provider; 0: none.
    replay_branch_at: int = 0
    # `serve --workers N`: N processes behind one address (agent_server.workers); 1 is one
    # process, as before. `worker` is set only in the processes a supervisor starts.
    workers: int = DEFAULT_WORKERS
    worker: WorkerRole | None = None

    def __post_init__(self) -> None:
        if self.trace_root is not None and not self.trace_root.is_absolute():
            # Bundle paths go to clients (Thread.bundle_path, what `chat` prints), which may run
            # in another directory: absolute from the start.
            object.__setattr__(self, "trace_root", self.trace_root.absolute())
        for name, bounds in NUMBER_SETTINGS.items():
            bounds.check(name, getattr(self, name))
        if not self.model:
            raise ConfigError("--model must not be empty")
        if self.provider_api not in PROVIDER_APIS:
            raise ConfigError(f"--provider-api must be one of {', '.join(PROVIDER_APIS)}")
        if self.provider_url is not None:
            check_http_url(self.provider_url, "--provider-url")
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
        if self.otlp_protocol is not None and self.otlp_protocol not in OTLP_PROTOCOLS:
            raise ConfigError(f"--otlp-protocol must be one of {', '.join(OTLP_PROTOCOLS)}")
        if self.log_level not in logs.LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(logs.LEVELS)}")
        if self.log_format not in logs.FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(logs.FORMATS)}")
        loop_problem = event_loop_problem(self.event_loop)
        if loop_problem is not None:
            raise ConfigError(loop_problem)
        if self.replay_pace not in REPLAY_PACES:
            raise ConfigError(f"--replay-pace must be one of {', '.join(REPLAY_PACES)}")
        if self.replay_on_divergence not in REPLAY_ON_DIVERGENCE:
            raise ConfigError(
                f"--replay-on-divergence must be one of {', '.join(REPLAY_ON_DIVERGENCE)}"
            )
        if self.replay_from is None and (
            self.replay_branch_at or self.replay_on_divergence != "fail"
        ):
            raise ConfigError("--replay-branch-at and --replay-on-divergence need --replay-from")
        if (
            self.replay_from is not None
            and self.provider_url is None
            and (self.replay_branch_at or self.replay_on_divergence == "live")
        ):
            raise ConfigError(
                "--replay-branch-at and --replay-on-divergence live send calls to a live "
                "provider: give it with --provider-url"
            )
        if self.replay_branch_at and self.trace_root is None:
            # Unrecorded, a branch would run and leave nothing to diff, export or view.
            raise ConfigError(
                "--replay-branch-at records each branch as a fork of its recorded run, beside "
                "it: give --trace-root, the directory that holds the recorded bundles"
            )
        if self.workers > 1:
            self._check_workers()
        if self.worker is not None and not (
            self.workers > 1 and 0 <= self.worker.index < self.workers
        ):
            raise ConfigError(f"{WORKER_ENV} is set by `serve --workers N` for its own processes")

    def _check_workers(self) -> None:
        """Refuse what N processes cannot share behind one address (yet)."""
        why = None
        if self.replay_from is not None:
            why = (
                "--replay-from: one replay provider answers one process's calls in the "
                "recorded order, and N processes would each replay the whole run"
            )
        elif self.metrics_listen is not None:
            why = (
                "--metrics-listen: one port cannot serve N processes' registries; run "
                "--workers 1 processes side by side to scrape each"
            )
        elif not hasattr(socket, "SO_REUSEPORT"):
            why = "this platform has no SO_REUSEPORT, which lets N processes share one port"
        if why is not None:
            raise ConfigError(f"--workers {self.workers} cannot be combined with {why}")

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
                "--provider-url is set but --model is not: threads that name no model will "
                f"ask {redact_url(self.provider_url)} for {DEFAULT_LOCAL_MODEL!r}, the built-in "
                "model's name"
            )
        if self.provider_url is not None and self.api_key is None:
            found.append(
                f"--provider-url is set but {self.api_key_env} (--api-key-env) is unset or "
                "empty: requests go to the provider without an API key"
            )
        if self.otlp_endpoint is not None and self.trace_root is None:
            found.append(
                "--otlp-endpoint is set but --trace-root is not: the live export sends the spans "
                "of recorded bundles, so nothing will be exported"
            )
        open_to = open_listen_warning("--listen", self.listen, self.access, "runs turns")
        if open_to is not None:
            found.append(open_to)
        return found


def open_listen_warning(flag: str, listen: str, access: AccessControl, does: str) -> str | None:
    """What serve and the gateway say at start-up when they listen beyond loopback without a
    token: legal (a container's 0.0.0.0, a private network), but whoever reaches the port is
    served, on the provider's key."""
    if access.token is not None or is_loopback(split_listen(listen)[0]):
        return None
    return (
        f"{flag} {listen} is not loopback and no --auth-token-env is set: anyone who can reach it "
        f"{does} on the provider's key and reads what is recorded; require a token with "
        "--auth-token-env NAME"
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve`: the shared ones, the server's access control, its operation."""
    add_arguments(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of settings named like these flags (env ROLLOUT_CONFIG); "
        "flags and environment variables win over it",
    )
    add_access_arguments(parser)
    parser.add_argument(
        "--keepalive-time",
        type=float,
        metavar="SECONDS",
        help="ping a connection silent this long, so idle streams survive load balancers and "
        "NAT (default 60)",
    )
    parser.add_argument(
        "--max-connection-age",
        type=float,
        metavar="SECONDS",
        help="ask clients to reconnect after this long (GOAWAY; rollout_client resumes its "
        "streams), spreading them over a load balancer's servers (default: never)",
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (env ROLLOUT_METRICS_LISTEN)",
    )
    add_otlp_arguments(parser)
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        help="the least severe level logged (default info; env ROLLOUT_LOG_LEVEL)",
    )
    add_replay_arguments(parser)
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        help="text lines or JSON lines on stderr (default text; env ROLLOUT_LOG_FORMAT)",
    )
    add_event_loop_argument(parser, env="ROLLOUT_EVENT_LOOP")
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="serve from N processes behind the one --listen address, each thread owned by "
        "one of them and every call for it sent there (env ROLLOUT_WORKERS; default 1)",
    )


def add_replay_arguments(
    parser: argparse.ArgumentParser, *, live: str = "--provider-url", branch: bool = True
) -> None:
    """The replay flags (`serve`, and `gateway` without --replay-branch-at); `live` names the
    flag of the provider a divergence goes to."""
    replay = parser.add_argument_group("replay a recorded run")
    replay.add_argument(
        "--replay-from",
        metavar="BUNDLE_OR_ROOT",
        help="answer every inference request from the provider streams recorded in this "
        "bundle (or the bundles of this directory) instead of a model",
    )
    replay.add_argument(
        "--replay-pace",
        choices=REPLAY_PACES,
        help=(
            "send recorded events at their recorded times, or at once (default fast: a call "
            "the client interrupted keeps its recorded gaps)"
        ),
    )
    replay.add_argument(
        "--replay-on-divergence",
        choices=REPLAY_ON_DIVERGENCE,
        help="a request that differs from the recorded one fails with HTTP 409 "
        f"replay_divergence (fail, the default), or goes to {live} from there on (live)",
    )
    if branch:
        replay.add_argument(
            "--replay-branch-at",
            type=int,
            metavar="CALL",
            help=f"replay calls 1..CALL-1 of each recorded thread, send CALL onward to {live}",
        )


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The few flags `demo` uses: it always runs the local model on a port of its own."""
    parser.add_argument(
        "--trace-root",
        metavar="DIR",
        help="where the demo's bundle goes (default: a new temporary directory)",
    )
    parser.add_argument(
        "--local-word-delay",
        metavar="SECONDS",
        type=float,
        help=f"seconds between words of the local model (default {DEFAULT_WORD_DELAY})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags every agent-server command shares (defaults resolved in from_args)."""
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="gRPC address; port 0 picks a free one "
        f"(env ROLLOUT_LISTEN; default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--provider-url",
        metavar="URL",
        help="the provider's base URL: POST URL/responses, or URL/chat/completions with "
        "--provider-api chat (env ROLLOUT_PROVIDER_URL; default: the built-in local model)",
    )
    parser.add_argument(
        "--provider-api",
        choices=PROVIDER_APIS,
        help="the API the provider speaks: the Responses API (default) or Chat Completions "
        "(env ROLLOUT_PROVIDER_API)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help=f"model for threads that name none (env ROLLOUT_MODEL; default {DEFAULT_LOCAL_MODEL})",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="NAME of the environment variable holding the API key "
        f"(default {DEFAULT_API_KEY_ENV})",
    )
    parser.add_argument(
        "--trace-root",
        metavar="DIR",
        help="record every thread under this directory (env ROLLOUT_TRACE_ROOT)",
    )
    parser.add_argument(
        "--max-retries",
        metavar="N",
        type=int,
        help="retries of 429 / 5xx / connection failures before any output "
        f"(default {DEFAULT_MAX_RETRIES})",
    )
    parser.add_argument(
        "--retry-base-delay",
        metavar="SECONDS",
        type=float,
        help=f"first retry back-off in seconds (default {DEFAULT_RETRY_BASE_DELAY})",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        metavar="SECONDS",
        type=float,
        help=f"seconds without provider data before an attempt fails "
        f"(default {DEFAULT_STREAM_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--event-buffer",
        metavar="N",
        type=int,
        help=f"events kept per thread (default {DEFAULT_EVENT_BUFFER})",
    )
    parser.add_argument(
        "--local-word-delay",
        metavar="SECONDS",
        type=float,
        help=f"seconds between words of the local model (default {DEFAULT_WORD_DELAY})",
    )
    parser.add_argument(
        "--closed-thread-retention",
        metavar="SECONDS",
        type=float,
        help="seconds a closed thread stays readable before it is forgotten "
        f"(default {DEFAULT_CLOSED_THREAD_RETENTION:g})",
    )
    parser.add_argument(
        "--max-closed-threads",
        metavar="N",
        type=int,
        help=f"closed threads kept at most (default {DEFAULT_MAX_CLOSED_THREADS})",
    )
    parser.add_argument(
        "--max-tool-rounds",
        metavar="N",
        type=int,
        help="rounds of tool calls a turn may have before it fails "
        f"(default {DEFAULT_MAX_TOOL_ROUNDS})",
    )
    parser.add_argument(
        "--tool-output-timeout",
        metavar="SECONDS",
        type=float,
        help="seconds a turn waits for its tool outputs before it fails "
        f"(default {DEFAULT_TOOL_OUTPUT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--provider-max-connections",
        metavar="N",
        type=int,
        help="provider connections open at once; turns beyond wait, then fail the attempt "
        f"(default {DEFAULT_PROVIDER_MAX_CONNECTIONS})",
    )


# What --otlp-endpoint sends, and when: `serve`'s turns, and the gateway's calls (each as it
# ends; the gateway always records, so it needs no word on --trace-root).
OTLP_SERVE_SPANS = (
    "send each turn's OpenTelemetry spans to this OTLP receiver as the turn ends, in the "
    "background (the spans of `trace-reducer export-otlp` of the recorded bundles: needs "
    "--trace-root, and the otel extra)"
)
OTLP_GATEWAY_SPANS = (
    "send each call's OpenTelemetry span to this OTLP receiver as the call ends (its turn's "
    "and session's as they end), in the background (the spans of `trace-reducer export-otlp` "
    "of the recorded bundles: needs the otel extra)"
)


def add_otlp_arguments(parser: argparse.ArgumentParser, *, spans: str = OTLP_SERVE_SPANS) -> None:
    """The live OTLP export's flags, declared once for `serve` and `gateway`."""
    parser.add_argument("--otlp-endpoint", metavar="URL", help=spans)
    parser.add_argument(
        "--otlp-protocol",
        choices=OTLP_PROTOCOLS,
        help="default OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else grpc",
    )
    parser.add_argument(
        "--otlp-header",
        action="append",
        metavar="KEY=VALUE",
        help="a header on every export (repeatable; default OTEL_EXPORTER_OTLP_[TRACES_]HEADERS)",
    )
    parser.add_argument(
        "--otlp-include-content",
        action="store_true",
        default=None,
        help="add messages, instructions and tool arguments to the spans (default "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, else off)",
    )


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings: each from its flag, else its environment variable, else the --config
    file, else the default. A ConfigError about a value the environment or the file gave says
    so: `--log-level must be one of … (set by ROLLOUT_LOG_LEVEL)`."""
    env = os.environ if environ is None else environ
    origins: dict[str, str] = {}
    try:
        return _from_args(args, env, origins)
    except ConfigError as error:
        raise ConfigError(with_origin(str(error), origins)) from error


def with_origin(message: str, origins: Mapping[str, str]) -> str:
    """message, and where the value it is about came from when that was not its flag: a
    variable set long ago, or a line of a file, is not what the user typed (`agent-server
    demo`, which has no --log-level, said only `--log-level must be one of …`)."""
    flags = list(dict.fromkeys(re.findall(r"--([a-z][a-z-]*)", message)))
    said = [
        (flag, origins[flag.replace("-", "_")])
        for flag in flags
        if flag.replace("-", "_") in origins
    ]
    if not said:
        return message
    if len(flags) == 1:
        return f"{message} (set by {said[0][1]})"
    # Several flags: which of them the user did not type (`--workers 2 cannot be combined with
    # --metrics-listen`, the image's ROLLOUT_METRICS_LISTEN).
    return f"{message} ({'; '.join(f'--{flag} set by {origin}' for flag, origin in said)})"


def _from_args(
    args: argparse.Namespace, env: Mapping[str, str], origins: dict[str, str]
) -> Settings:
    def flag(name: str) -> object:
        return getattr(args, name, None)

    if flag("config") == "":
        # `--config "$FILE"` with FILE unset: a slip, not the current directory (as a path).
        raise ConfigError("--config is empty: give a TOML file, or leave it out")
    config_path = flag("config") or (env.get("ROLLOUT_CONFIG") if hasattr(args, "config") else None)
    try:
        file = _config_file.load(Path(str(config_path))) if config_path else {}
    except _config_file.ConfigFileError as error:
        raise ConfigError(str(error)) from error

    def from_file(name: str) -> Any:
        # Only a setting the command has a flag for: one file serves `serve` and `gateway`
        # alike, and the gateway has no --replay-branch-at, say.
        return file.get(name) if hasattr(args, name) else None

    def pick(name: str, env_name: str | None = None) -> Any:
        value = flag(name)
        if value is None and env_name and env.get(env_name):
            origins[name] = env_name
            return env[env_name]
        if value is None:
            value = from_file(name)
            if value is not None:
                origins[name] = f"{name.replace('_', '-')} in {config_path}"
        bounds = GIVEN_NUMBER_SETTINGS.get(name)
        if bounds is not None and value is not None:
            bounds.check(name, value)
        return value

    def pick_otlp(name: str) -> Any:
        # Its OpenTelemetry variable is read by the export itself: None leaves it to that.
        value = flag(name)
        if value is not None or any(env.get(v, "").strip() for v in OTLP_ENV[name]):
            return value
        return from_file(name)

    serving = hasattr(args, "workers")
    provider_url = pick("provider_url", "ROLLOUT_PROVIDER_URL")
    api_key_env = _variable_name(pick("api_key_env") or DEFAULT_API_KEY_ENV, "--api-key-env")
    key = _api_key(env.get(api_key_env, ""), api_key_env)
    trace_root = pick("trace_root", "ROLLOUT_TRACE_ROOT")
    # Given, but empty (`--trace-root "$DIR"` with DIR unset): not "record nothing", which is
    # leaving the flag out, nor the current directory; refused, as an empty --listen is.
    if trace_root == "":
        raise ConfigError("--trace-root is empty: give a directory, or leave it out to not record")
    if pick("listen", "ROLLOUT_LISTEN") == "":
        raise ConfigError(f"--listen is empty: give HOST:PORT (default {DEFAULT_LISTEN})")
    replay_from = pick("replay_from")
    # `--replay-from "$RUN"` with RUN unset: not the current directory, nor a live run.
    if replay_from == "":
        raise ConfigError(
            "--replay-from is empty: give a bundle or a directory of bundles, "
            "or leave it out to answer from the provider"
        )
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
    # Checked as they are picked (GIVEN_NUMBER_SETTINGS), each error naming its flag.
    keepalive = Keepalive(
        time=_default(pick("keepalive_time"), Keepalive.time),
        max_connection_age=pick("max_connection_age"),
    )
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
        keepalive=keepalive,
        metrics_listen=pick("metrics_listen", "ROLLOUT_METRICS_LISTEN"),
        otlp_endpoint=pick("otlp_endpoint"),
        otlp_protocol=pick_otlp("otlp_protocol"),
        otlp_headers=tuple(pick_otlp("otlp_header") or ()),
        otlp_include_content=pick_otlp("otlp_include_content"),
        log_level=pick("log_level", "ROLLOUT_LOG_LEVEL") or "info",
        log_format=pick("log_format", "ROLLOUT_LOG_FORMAT") or "text",
        event_loop=pick("event_loop", "ROLLOUT_EVENT_LOOP") or default_event_loop(),
        replay_from=Path(replay_from) if replay_from else None,
        replay_pace=pick("replay_pace") or "fast",
        replay_on_divergence=pick("replay_on_divergence") or "fail",
        replay_branch_at=_default(pick("replay_branch_at"), 0),
        # `serve`'s alone: the demo and the gateway are one process whatever the environment.
        workers=_workers(pick("workers", "ROLLOUT_WORKERS")) if serving else DEFAULT_WORKERS,
        worker=_worker_role(env.get(WORKER_ENV)) if serving else None,
    )


def _workers(value: Any) -> Any:
    # The environment gives text; the flag and the file give an int (Bounds checks it).
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ConfigError(f"--workers must be an integer, not {value!r}") from None
    return DEFAULT_WORKERS if value is None else value


def _worker_role(value: str | None) -> WorkerRole | None:
    if not value:
        return None
    index, _, socket_dir = value.partition(":")
    if not index.isdigit() or not socket_dir:
        raise ConfigError(f"{WORKER_ENV} is set by `serve --workers N` for its own processes")
    return WorkerRole(int(index), Path(socket_dir))


def _named_providers(
    tables: Mapping[str, Mapping[str, Any]], env: Mapping[str, str]
) -> list[ProviderSettings]:
    providers = []
    for name, table in tables.items():
        key_env = _variable_name(
            table.get("key-env") or DEFAULT_API_KEY_ENV, f"[providers.{name}] key-env"
        )
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
    try:
        return header_secret(value, f"the API key in {variable}")
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _variable_name(value: str, flag: str) -> str:
    try:
        return variable_name(value, flag)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _default(value: _T | None, default: _T) -> _T:
    return default if value is None else value
