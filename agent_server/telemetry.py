"""What the server tells its operator: a log line per thread and turn milestone, and metrics.

The agent calls the hooks below at those milestones; they never raise and never block. The
metrics live in one registry per process (`REGISTRY`), served by grpc_common.MetricsServer.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agent_server.config import ConfigError, Settings
from grpc_common import redact_url
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer.bundle._version import __version__

if TYPE_CHECKING:
    from trace_reducer.export._live import LiveExport

log = logging.getLogger("agent_server")

# Counters and histograms without their `_created` series: read beside the counts, a creation
# timestamp looks like one more count.
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry()
# The process (CPU, memory, open files, start time), the Python runtime and its collector.
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)
BUILD_INFO = Gauge(
    "rollout_agent_build_info",
    "Always 1: the version running, as labels.",
    ["version", "python"],
    registry=REGISTRY,
)
BUILD_INFO.labels(version=__version__, python=platform.python_version()).set(1)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TURN_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

THREADS_ACTIVE = Gauge(
    "rollout_agent_threads_active", "Threads started and not yet closed.", registry=REGISTRY
)
TURNS_ACTIVE = Gauge("rollout_agent_turns_active", "Turns running now.", registry=REGISTRY)
EVENT_SUBSCRIBERS = Gauge(
    "rollout_agent_event_subscribers",
    "StreamEvents calls attached to a thread's events now.",
    registry=REGISTRY,
)
THREADS = Counter("rollout_agent_threads", "Threads started.", registry=REGISTRY)
TURNS = Counter(
    "rollout_agent_turns",
    "Turns ended, by how they ended (COMPLETED, INTERRUPTED, FAILED).",
    ["status"],
    registry=REGISTRY,
)
TURN_SECONDS = Histogram(
    "rollout_agent_turn_duration_seconds",
    "From StartTurn to turn_completed.",
    buckets=_TURN_BUCKETS,
    registry=REGISTRY,
)
PROVIDER_CALLS = Counter(
    "rollout_agent_provider_calls",
    "Inference calls (one per attempt) by how they ended, and the provider's HTTP status "
    "('none' when it sent none: connection failures, calls cancelled before an answer).",
    ["status", "http_status"],
    registry=REGISTRY,
)
PROVIDER_RETRIES = Counter(
    "rollout_agent_provider_retries", "Failed inference calls that are retried.", registry=REGISTRY
)
FIRST_DELTA_SECONDS = Histogram(
    "rollout_agent_time_to_first_delta_seconds",
    "From StartTurn to the turn's first text delta.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


class _DeltaCount(Collector):
    """rollout_agent_deltas_total, kept as a plain count: a Counter takes a lock per inc(),
    and a delta is counted once per provider read of every stream. Counted and read under the
    GIL: the scrape reads an int the event loop's thread alone changes."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "rollout_agent_deltas",
            "Text deltas published to event streams (rate() gives deltas per second).",
            value=self.count,
        )

    def describe(self) -> Iterator[Metric]:
        # What registering it asks for: its name, which collect() gives.
        return self.collect()


DELTAS = _DeltaCount()
REGISTRY.register(DELTAS)
TOKENS = Counter(
    "rollout_agent_tokens", "Tokens the provider reported, by kind.", ["kind"], registry=REGISTRY
)
RECORDING_FAILURES = Counter(
    "rollout_agent_recording_failures",
    "Recordings that failed after their thread started (the thread kept serving).",
    registry=REGISTRY,
)
RECORDED_BYTES = Counter(
    "rollout_agent_recorded_bytes", "Bytes written to trace bundles.", registry=REGISTRY
)
OTLP_SPANS_EXPORTED = Counter(
    "rollout_agent_otlp_spans_exported",
    "Spans the live OTLP export delivered (serve --otlp-endpoint).",
    registry=REGISTRY,
)
OTLP_SPANS_DROPPED = Counter(
    "rollout_agent_otlp_spans_dropped",
    "Spans the live OTLP export dropped: its queue was full, or the receiver did not take them.",
    ["reason"],
    registry=REGISTRY,
)

# The live OTLP export, when serving with --otlp-endpoint.
_live_export: LiveExport | None = None


def install_live_export(live: LiveExport | None) -> None:
    global _live_export
    _live_export = live


def start_live_export(settings: Settings) -> LiveExport | None:
    """The live OTLP export --otlp-endpoint asks for (serve and gateway alike), installed as
    the hook below. Raises ConfigError for an endpoint, protocol or header the exporter
    cannot use, or without the otel extra."""
    if settings.otlp_endpoint is None:
        return None
    try:
        from trace_reducer.bundle._errors import ExportConfigError
        from trace_reducer.export._live import LiveExport
    except ImportError as error:
        from trace_reducer.bundle._errors import MissingExtraError

        raise ConfigError(str(MissingExtraError("--otlp-endpoint", "otel", error.name))) from error
    try:
        live = LiveExport.to_otlp(
            settings.otlp_endpoint,
            settings.otlp_protocol,
            settings.otlp_headers,
            include_content=settings.otlp_include_content,
            on_drop=otlp_spans_dropped,
            on_export=otlp_spans_exported,
        )
    except ExportConfigError as error:
        raise ConfigError(f"--otlp-endpoint: {error}") from error
    install_live_export(live)
    log.info("exporting each turn's spans to %s", redact_url(settings.otlp_endpoint))
    return live


async def stop_live_export(live: LiveExport | None, grace: float) -> None:
    """Uninstall the hook and send what is queued, waiting up to `grace` seconds."""
    if live is None:
        return
    install_live_export(None)
    await asyncio.to_thread(live.shutdown, grace)


def bundle_advanced(bundle_path: str, *, ended: bool = False) -> None:
    """The one live-export hook of whatever records bundles (the agent's recorder, the gateway):
    call it once a turn's records are durable, and with `ended` once the footer is. It never
    blocks or raises; without a live export it does nothing."""
    live = _live_export
    if live is not None and bundle_path:
        live.bundle_advanced(bundle_path, ended=ended)


def otlp_spans_exported(count: int) -> None:
    OTLP_SPANS_EXPORTED.inc(count)


def otlp_spans_dropped(count: int, reason: str) -> None:
    OTLP_SPANS_DROPPED.labels(reason).inc(count)


@dataclass
class _TurnStats:
    thread_id: str
    started: float
    calls: int = 0
    first_delta: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    # Whether any call reported its usage: a turn none did has unknown tokens, not 0 (as `list`,
    # `view` and `diff` say).
    usage_reported: bool = False
    http_status: int = 0


# The running turns, by turn id; each entry goes when its turn_completed is published.
_turns: dict[str, _TurnStats] = {}
# Bytes of each open recording already counted, by thread id.
_recorded: dict[str, int] = {}


def _status_name(status: int) -> str:
    return agent_pb2.TurnStatus.Name(status).removeprefix("TURN_STATUS_")  # type: ignore[arg-type]


def _info(message: str, **fields: Any) -> None:
    log.info(message, extra={"fields": fields})


# Each live thread's bundle trace id, which is also the trace id of its OpenTelemetry spans: a
# log line naming it joins its bundle and its spans.
_trace_ids: dict[str, str] = {}


def _of(thread_id: str) -> dict[str, str]:
    """The fields naming a thread: its id and, when recorded, its bundle's trace id."""
    trace_id = _trace_ids.get(thread_id)
    return {"thread": thread_id, "trace_id": trace_id} if trace_id else {"thread": thread_id}


def thread_started(thread_id: str, *, model: str, bundle_path: str, trace_id: str = "") -> None:
    THREADS.inc()
    THREADS_ACTIVE.inc()
    if trace_id:
        _trace_ids[thread_id] = trace_id
    _info("thread started", **_of(thread_id), model=model, bundle=bundle_path or "off")


def thread_closed(
    thread_id: str, reason: str, *, turns: int, recording: agent_pb2.RecordingStatus.ValueType
) -> None:
    THREADS_ACTIVE.dec()
    _info(
        "thread closed",
        **_of(thread_id),
        reason=reason,
        turns=turns,
        recording=agent_pb2.RecordingStatus.Name(recording).removeprefix("RECORDING_STATUS_"),
    )
    _trace_ids.pop(thread_id, None)


def on_event(thread_id: str, event: agent_pb2.ThreadEvent) -> None:
    """Every event the thread publishes (deltas come through on_delta instead)."""
    kind = event.WhichOneof("kind")
    if kind == "turn_started":
        TURNS_ACTIVE.inc()
        _turns[event.turn_id] = _TurnStats(thread_id, time.monotonic())
        _info("turn started", **_of(thread_id), turn=event.turn_id)
    elif kind == "token_usage":
        usage = event.token_usage
        TOKENS.labels("input").inc(usage.input_tokens)
        TOKENS.labels("output").inc(usage.output_tokens)
        stats = _turns.get(event.turn_id)
        if stats is not None:
            stats.input_tokens += usage.input_tokens
            stats.output_tokens += usage.output_tokens
            stats.usage_reported = True
    elif kind == "error":
        _provider_failed(thread_id, event)
    elif kind == "turn_completed":
        _turn_ended(thread_id, event)


def _provider_failed(thread_id: str, event: agent_pb2.ThreadEvent) -> None:
    error = event.error
    stats = _turns.get(event.turn_id)
    if error.will_retry:
        PROVIDER_RETRIES.inc()
    log.warning(
        "provider call failed" + ("; retrying" if error.will_retry else ""),
        extra={
            "fields": {
                **_of(thread_id),
                "turn": event.turn_id,
                "attempt": stats.calls if stats else 0,
                "code": error.code,
                "http_status": stats.http_status if stats else 0,
                "error": error.message,
            }
        },
    )


def _turn_ended(thread_id: str, event: agent_pb2.ThreadEvent) -> None:
    turn = event.turn_completed.turn
    status = _status_name(turn.status)
    TURNS.labels(status).inc()
    stats = _turns.pop(event.turn_id, None)
    fields: dict[str, Any] = {**_of(thread_id), "turn": event.turn_id, "status": status}
    if stats is not None:
        TURNS_ACTIVE.dec()
        duration = time.monotonic() - stats.started
        TURN_SECONDS.observe(duration)
        fields.update(duration_s=round(duration, 3), calls=stats.calls)
        if stats.usage_reported:
            fields.update(input_tokens=stats.input_tokens, output_tokens=stats.output_tokens)
    if turn.error.code:
        fields.update(error_code=turn.error.code, error=turn.error.message)
    _info("turn ended", **fields)


def on_delta(turn_id: str) -> None:
    """A text delta of the turn was published."""
    DELTAS.count += 1
    stats = _turns.get(turn_id)
    if stats is not None and not stats.first_delta:
        stats.first_delta = True
        FIRST_DELTA_SECONDS.observe(time.monotonic() - stats.started)


def call_started(turn_id: str) -> None:
    stats = _turns.get(turn_id)
    if stats is not None:
        stats.calls += 1
        stats.http_status = 0


def call_ended(
    turn_id: str,
    status: common_pb2.ExecutionStatus.ValueType,
    error: common_pb2.TraceError | None,
) -> None:
    http_status = error.http_status if error is not None else 0
    if status == common_pb2.EXECUTION_STATUS_COMPLETED:
        http_status = 200
    stats = _turns.get(turn_id)
    if stats is not None:
        stats.http_status = http_status
    name = common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")
    PROVIDER_CALLS.labels(name, str(http_status) if http_status else "none").inc()


def subscriber_attached() -> None:
    EVENT_SUBSCRIBERS.inc()


def subscriber_detached() -> None:
    EVENT_SUBSCRIBERS.dec()


def recording_failed() -> None:
    """A recording failed after start (the recorder logs which and why)."""
    RECORDING_FAILURES.inc()


def recorded(thread_id: str, total_bytes: int, *, finished: bool = False) -> None:
    """The thread's bundle holds total_bytes so far (finished: and no more will come)."""
    counted = _recorded.pop(thread_id, 0) if finished else _recorded.get(thread_id, 0)
    if total_bytes > counted:
        RECORDED_BYTES.inc(total_bytes - counted)
    if not finished:
        _recorded[thread_id] = max(total_bytes, counted)
