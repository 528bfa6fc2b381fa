"""Bundles as OpenTelemetry GenAI spans, made with the SDK and sent with its OTLP exporters."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode

from rollout.trace.v1 import state_pb2

from ..bundle._errors import ExportConfigError, ExportFailedError
from ..bundle._integrity import integrity_name, require_reducible
from ..bundle._version import __version__
from ..reduce._replay import replay_bundle
from ._genai import TracePlan, plan_trace, read_details, trace_id_of

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_TIMEOUT = 10.0
_DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318"}
_HTTP_TRACES_PATH = "/v1/traces"
# One export request stays under the 4 MiB a gRPC receiver takes by default: content makes a
# chat span as large as the history it was sent.
_BATCH_SPANS = 512
_BATCH_BYTES = 3 * 1024 * 1024
_SPAN_OVERHEAD_BYTES = 128
# An HTTP field name (RFC 9110 token).
_HEADER_KEY = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_DETAIL_CHARS = 400
_HTTP_CAUSE_LOGGER = "opentelemetry.exporter.otlp.proto.http.cause"


@dataclass(frozen=True)
class ExportedBundle:
    """What one bundle became: its trace id (32 hex digits) and how many spans were sent."""

    bundle: str
    trace_id: str
    spans: int
    integrity: str


@dataclass(frozen=True)
class _BundleSpans:
    bundle: str
    trace: state_pb2.RolloutTrace
    spans: list[ReadableSpan]


class _PlannedIds(IdGenerator):
    """Hands the SDK the ids the plan derived from the bundle instead of random ones."""

    def __init__(self, trace_id: int) -> None:
        self._trace_id = trace_id
        self.next_span_id = 0

    def generate_trace_id(self) -> int:
        return self._trace_id

    def generate_span_id(self) -> int:
        return self.next_span_id


class _Collect(SpanProcessor):
    """Keeps every ended span, so the caller sends them and learns whether the send worked."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def plan_spans(plan: TracePlan) -> list[ReadableSpan]:
    """The SDK spans of a plan, with its ids and the times the bundle recorded."""
    ids = _PlannedIds(plan.trace_id)
    collect = _Collect()
    # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME win, so a user can name a backend project.
    resource = Resource(dict(plan.resource)).merge(OTELResourceDetector().detect())
    provider = TracerProvider(
        sampler=ALWAYS_ON, resource=resource, id_generator=ids, shutdown_on_exit=False
    )
    provider.add_span_processor(collect)
    tracer = provider.get_tracer("trace_reducer.export_otlp", __version__)
    made: dict[int, Span] = {}
    ends: list[tuple[Span, int]] = []
    for planned in plan.spans:
        parent = made.get(planned.parent_span_id) if planned.parent_span_id else None
        context = trace_api.set_span_in_context(parent) if parent is not None else Context()
        ids.next_span_id = planned.span_id
        span = tracer.start_span(
            planned.name,
            context=context,
            kind=SpanKind.CLIENT if planned.client else SpanKind.INTERNAL,
            attributes=planned.attributes,
            start_time=planned.start_ns,
        )
        if not isinstance(span, Span):
            raise ExportConfigError(
                "the OpenTelemetry SDK makes no spans here: is OTEL_SDK_DISABLED set?"
            )
        for event in planned.events:
            span.add_event(event.name, event.attributes, timestamp=event.time_ns)
        if planned.error is not None:
            span.set_status(Status(StatusCode.ERROR, planned.error))
        made[planned.span_id] = span
        ends.append((span, planned.end_ns))
    for span, end_ns in ends:
        span.end(end_time=end_ns)
    provider.shutdown()
    return collect.spans


def bundle_spans(
    bundle: str | os.PathLike[str], *, include_content: bool = False, salvage: bool = False
) -> tuple[state_pb2.RolloutTrace, list[ReadableSpan]]:
    """Reduce a bundle and make its spans (none are sent).

    Raises BundleError for a missing path or something that is not a bundle, CorruptBundleError
    for a CORRUPT bundle unless salvaging, ReductionError when its records contradict each other.
    """
    trace = replay_bundle(bundle)
    require_reducible(trace.integrity, salvage=salvage, source=os.fspath(bundle))
    details = read_details(bundle, trace)
    return trace, plan_spans(plan_trace(trace, details, include_content=include_content))


def parse_header(text: str) -> tuple[str, str]:
    """`KEY=VALUE` as given to --header; the message never repeats the value (a secret)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _HEADER_KEY.fullmatch(key):
        shown = key if _HEADER_KEY.fullmatch(key) else "…"
        raise ExportConfigError(
            f"--header must be KEY=VALUE with KEY an HTTP field name (got {shown!r}"
            f"{'' if sep else ' without ='})"
        )
    if any(ch in value for ch in "\r\n\0"):
        raise ExportConfigError(f"--header {key}: the value holds a line break or NUL")
    return key, value.strip()


def resolve_endpoint(endpoint: str | None, protocol: str) -> str:
    """The URL spans go to: --endpoint, else OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else the
    local default; OTLP/HTTP gets `/v1/traces` when the URL has no path."""
    if protocol not in PROTOCOLS:
        raise ExportConfigError(f"--protocol must be one of {', '.join(PROTOCOLS)}: {protocol!r}")
    given = (
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or _DEFAULT_ENDPOINTS[protocol]
    )
    try:
        parts = urlsplit(given)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as error:
        raise ExportConfigError(f"--endpoint is not a URL: {given!r} ({error})") from error
    if parts.username is not None or parts.password is not None:
        # The exporters would repeat the URL in their messages; credentials go in a header.
        raise ExportConfigError("--endpoint must not hold credentials: send them with --header")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ExportConfigError(f"--endpoint must be an http:// or https:// URL: {given!r}")
    if protocol == "http/protobuf" and parts.path in ("", "/"):
        parts = parts._replace(path=_HTTP_TRACES_PATH)
    return urlunsplit(parts)


def otlp_exporter(
    endpoint: str | None = None,
    protocol: str = "grpc",
    headers: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[SpanExporter, str]:
    """An OTLP span exporter and the URL it sends to; headers are `KEY=VALUE` strings (none:
    OTEL_EXPORTER_OTLP_HEADERS applies)."""
    url = resolve_endpoint(endpoint, protocol)
    if not timeout > 0:
        raise ExportConfigError(f"--timeout must be a positive number of seconds: {timeout}")
    pairs = [parse_header(text) for text in headers]
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        # gRPC metadata keys are lowercase.
        metadata = tuple((key.lower(), value) for key, value in pairs) or None
        exporter: SpanExporter = GrpcExporter(
            endpoint=url,
            insecure=urlsplit(url).scheme == "http",
            headers=metadata,
            timeout=timeout,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        exporter = HttpExporter(
            endpoint=url,
            headers=dict(pairs) or None,
            timeout=timeout,
            session=_CauseKeepingSession(),
        )
    return exporter, url


class _CauseKeepingSession(requests.Session):
    """Logs why a request failed: with a short timeout the HTTP exporter gives up before any
    retry warning says so."""

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        try:
            return super().request(*args, **kwargs)
        except requests.RequestException as error:
            text = str(error)
            # requests nests the cause; `[Errno 111] Connection refused` is what a person needs.
            errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
            logging.getLogger(_HTTP_CAUSE_LOGGER).warning(
                "%s", errno.group(1).strip() if errno else text
            )
            raise


class _LastMessages(logging.Handler):
    """The exporters say why a send failed only in their log; keep what they said."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(" ".join(record.getMessage().split()))


@contextmanager
def _exporter_log() -> Iterator[_LastMessages]:
    logger = logging.getLogger("opentelemetry.exporter")
    handler = _LastMessages()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _cause(message: str) -> str:
    # A retry warning names the cause; what it says about the retry is over by now.
    message = re.sub(r",? retrying in [0-9.]+s", "", message)
    return message.removeprefix("Transient error ")


def _size(value: object) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, tuple | list):
        return sum(_size(one) + 2 for one in value)
    return 9


def _estimated_bytes(span: ReadableSpan) -> int:
    """About what the span costs in an OTLP request."""
    size = _SPAN_OVERHEAD_BYTES + len(span.name)
    for attributes in (span.attributes, *(event.attributes for event in span.events)):
        for key, value in (attributes or {}).items():
            size += len(key) + _size(value) + 4
    return size


def _batches(spans: Sequence[ReadableSpan]) -> Iterator[Sequence[ReadableSpan]]:
    batch: list[ReadableSpan] = []
    size = 0
    for span in spans:
        cost = _estimated_bytes(span)
        if batch and (size + cost > _BATCH_BYTES or len(batch) == _BATCH_SPANS):
            yield batch
            batch, size = [], 0
        batch.append(span)
        size += cost
    if batch:
        yield batch


def _send(exporter: SpanExporter, spans: Sequence[ReadableSpan], where: str) -> None:
    with _exporter_log() as log:
        for batch in _batches(spans):
            result = exporter.export(batch)
            if result is not SpanExportResult.SUCCESS:
                # The first message names the cause (refused, unknown host, HTTP status); later
                # ones only say that retrying gave up.
                detail = _cause(log.messages[0]) if log.messages else "the exporter gave no reason"
                if len(detail) > _DETAIL_CHARS:
                    detail = detail[: _DETAIL_CHARS - 1] + "…"
                raise ExportFailedError(f"could not export spans to {where}: {detail}")


def export_otlp(
    bundles: Sequence[str | os.PathLike[str]],
    *,
    endpoint: str | None = None,
    protocol: str = "grpc",
    headers: Sequence[str] = (),
    include_content: bool = False,
    salvage: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    exporter: SpanExporter | None = None,
) -> list[ExportedBundle]:
    """Send the bundles' spans (OpenTelemetry GenAI conventions) to an OTLP receiver.

    Every bundle is reduced before anything is sent, so bad input sends nothing. `exporter`
    replaces the OTLP exporter (endpoint, protocol, headers and timeout then do not apply).
    A CORRUPT bundle is refused unless `salvage` (then what precedes the damage is sent).
    Raises BundleError (bad bundle; CorruptBundleError), ReductionError (records contradict),
    ExportConfigError (bad endpoint, protocol, header or timeout) and ExportFailedError (the
    receiver did not take the spans).
    """
    made = [
        _BundleSpans(
            os.fspath(bundle),
            *bundle_spans(bundle, include_content=include_content, salvage=salvage),
        )
        for bundle in bundles
    ]
    where = "the exporter"
    owned = exporter is None
    if exporter is None:
        exporter, url = otlp_exporter(endpoint, protocol, headers, timeout)
        where = url
    try:
        results = []
        for one in made:
            _send(exporter, one.spans, where)
            results.append(
                ExportedBundle(
                    one.bundle,
                    trace_api.format_trace_id(trace_id_of(one.trace.trace_id)),
                    len(one.spans),
                    integrity_name(one.trace.integrity.status),
                )
            )
        return results
    finally:
        if owned:
            exporter.shutdown()
