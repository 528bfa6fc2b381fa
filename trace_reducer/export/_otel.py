"""Bundles as OpenTelemetry GenAI spans, made with the SDK and sent with its OTLP exporters."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import requests
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode

from grpc_common import Redactor, redact_url
from rollout.trace.v1 import state_pb2

from ..bundle._errors import ExportConfigError, ExportFailedError
from ..bundle._integrity import integrity_name, require_reducible
from ..bundle._version import __version__
from ..reduce._replay import replay_bundle
from ._genai import (
    CONTENT_ATTRIBUTES,
    Attributes,
    SpanEvent,
    SpanPlan,
    TracePlan,
    capture_content,
    plan_trace,
    read_details,
    trace_id_of,
)

PROTOCOLS = ("grpc", "http/protobuf")
# gRPC, not the spec's http/protobuf: what the export has always used without --protocol.
DEFAULT_PROTOCOL = "grpc"
DEFAULT_TIMEOUT = 10.0
_DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318"}
_HTTP_TRACES_PATH = "/v1/traces"
# The exporter environment of the OpenTelemetry specification, the per-signal variable first.
# Headers, compression and certificates are left to the SDK's exporters, which read them as
# the specification says; the endpoint, protocol and timeout are read here: the SDK picks no
# protocol, and it reads the timeouts as seconds where the specification says milliseconds.
_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_TIMEOUT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_TRACES_HEADERS_ENV = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
_HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"
# One export request stays under the 4 MiB a gRPC receiver takes by default: content makes a
# chat span as large as the history it was sent.
_BATCH_SPANS = 512
_BATCH_BYTES = 3 * 1024 * 1024
_SPAN_OVERHEAD_BYTES = 128
# An HTTP field name (RFC 9110 token).
_HEADER_KEY = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_DETAIL_CHARS = 400
_HTTP_CAUSE_LOGGER = "opentelemetry.exporter.otlp.proto.http.cause"
# The loggers that write what an export said: the exporters', their parsing of the headers
# variables, and the cause of a failed HTTP request logged here.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.util.re",
    _HTTP_CAUSE_LOGGER,
)


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
        planned = _fitted(planned)
        parent = made.get(planned.parent_span_id) if planned.parent_span_id else None
        context = trace_api.set_span_in_context(parent) if parent is not None else Context()
        if planned.remote_parent is not None:
            trace_id, span_id, flags = planned.remote_parent
            remote = trace_api.SpanContext(
                trace_id, span_id, is_remote=True, trace_flags=trace_api.TraceFlags(flags)
            )
            context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(remote))
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


def _fitted(planned: SpanPlan) -> SpanPlan:
    """The span as planned, or without its content when it is larger than one export request
    holds (`rollout.content_omitted_bytes` says how much was left out): a chat span carries
    its whole history, which can be larger than the 4 MiB a receiver takes (a 1 MiB input a
    turn), and a span no receiver takes failed the export of every span after it."""
    attribute_sets = (planned.attributes, *(event.attributes for event in planned.events))
    if _estimated_size(planned.name, attribute_sets) <= _BATCH_BYTES:
        return planned
    omitted = sum(
        len(key) + _size(value) + 4
        for attributes in attribute_sets
        for key, value in attributes.items()
        if key in CONTENT_ATTRIBUTES
    )
    if not omitted:
        return planned
    attributes: Attributes = {
        key: value for key, value in planned.attributes.items() if key not in CONTENT_ATTRIBUTES
    }
    attributes["rollout.content_omitted_bytes"] = omitted
    events = [
        SpanEvent(
            event.name,
            event.time_ns,
            {k: v for k, v in event.attributes.items() if k not in CONTENT_ATTRIBUTES},
        )
        for event in planned.events
    ]
    return replace(planned, attributes=attributes, events=events)


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


def parse_header(text: str, source: str = "--header") -> tuple[str, str]:
    """`KEY=VALUE` as given to --header (or in the variable `source`); the message never
    repeats the value (a secret)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _HEADER_KEY.fullmatch(key):
        # Without `=` the text may be the value alone (a token pasted in): never shown.
        shown = key if sep and _HEADER_KEY.fullmatch(key) else "…"
        raise ExportConfigError(
            f"{source} must be KEY=VALUE with KEY an HTTP field name (got {shown!r}"
            f"{'' if sep else ' without ='})"
        )
    if any(ch in value for ch in "\r\n\0"):
        raise ExportConfigError(f"{source} {key}: the value holds a line break or NUL")
    return key, value.strip()


def _env_headers() -> list[tuple[str, str]]:
    """OTEL_EXPORTER_OTLP_[TRACES_]HEADERS (`key=value,…`, values percent-encoded), read here
    rather than by the exporter, whose warning about a malformed entry quotes it whole."""
    found = _from_env((_TRACES_HEADERS_ENV, _HEADERS_ENV))
    if found is None:
        return []
    name, value = found
    pairs = []
    for entry in value.split(","):
        if entry.strip():
            key, text = parse_header(entry, source=name)
            pairs.append((key.lower(), unquote(text).strip()))
    return pairs


class _ExporterLogRedaction(logging.Filter):
    """Takes the endpoints' and headers' secrets out of the exporters' log records (a filter
    on each logger that writes them: a logger's filters see only its own records)."""

    def __init__(self) -> None:
        super().__init__()
        self._redactors: list[Redactor] = []
        self._installed = False

    def add(self, redactor: Redactor) -> None:
        if not redactor:
            return
        self._redactors.append(redactor)
        if not self._installed:
            for name in _EXPORTER_LOGGERS:
                logging.getLogger(name).addFilter(self)
            self._installed = True

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = message
        for redactor in self._redactors:
            safe = redactor.text(safe)
        if safe != message:
            record.msg, record.args = safe, None
        return True


_EXPORTER_LOG_REDACTION = _ExporterLogRedaction()


def _from_env(names: Sequence[str]) -> tuple[str, str] | None:
    """(variable, value) of the first of the variables that is set and not empty."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def resolve_protocol(protocol: str | None) -> str:
    """--protocol, else OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
    else grpc."""
    source = "--protocol"
    if protocol is None:
        found = _from_env(_PROTOCOL_ENV)
        source, protocol = found if found else (source, DEFAULT_PROTOCOL)
    if protocol not in PROTOCOLS:
        raise ExportConfigError(f"{source} must be one of {', '.join(PROTOCOLS)}: {protocol!r}")
    return protocol


def resolve_timeout(timeout: float | None) -> float:
    """Seconds per send: --timeout, else OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT (milliseconds, as
    the specification has it), else 10."""
    source = "--timeout"
    if timeout is None:
        found = _from_env(_TIMEOUT_ENV)
        if found is None:
            return DEFAULT_TIMEOUT
        source, text = found
        try:
            timeout = float(text) / 1000
        except ValueError:
            raise ExportConfigError(
                f"{source} must be a number of milliseconds: {text!r}"
            ) from None
    if not 0 < timeout <= _MAX_TIMEOUT:
        raise ExportConfigError(
            f"{source} must be a positive number of seconds up to {_MAX_TIMEOUT:g}: {timeout:g}"
        )
    return timeout


# A day: past it a send never ends in practice, and the exporters' deadlines overflow.
_MAX_TIMEOUT = 86_400.0


def resolve_endpoint(endpoint: str | None, protocol: str) -> str:
    """The URL spans go to, as the OpenTelemetry specification builds it.

    --endpoint (OTLP/HTTP adds `/v1/traces` when it has no path); else
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is; else OTEL_EXPORTER_OTLP_ENDPOINT as the base
    URL, to which OTLP/HTTP appends `v1/traces` (Langfuse's `…/api/public/otel` becomes
    `…/api/public/otel/v1/traces`); else the local default.
    """
    protocol = resolve_protocol(protocol)
    source = "--endpoint"
    base = False
    given = endpoint
    if not given:
        found = _from_env((_TRACES_ENDPOINT_ENV,))
        if found is None and (found := _from_env((_ENDPOINT_ENV,))) is not None:
            base = True
        source, given = found if found else ("--endpoint", _DEFAULT_ENDPOINTS[protocol])
    try:
        parts = urlsplit(given)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as error:
        # Not repeated: an endpoint that does not parse may still carry credentials.
        raise ExportConfigError(f"{source} is not a URL ({error})") from error
    # `user:pw@host:4317` has no scheme, and urlsplit reads `user` as one: look for user info
    # in what stands before the path however the URL is spelled.
    authority = given.split("://", 1)[-1].split("/", 1)[0]
    if parts.username is not None or parts.password is not None or "@" in authority:
        # The exporters would repeat the URL in their messages; credentials go in a header.
        raise ExportConfigError(
            f"{source} must not hold credentials: send them with --header or "
            "OTEL_EXPORTER_OTLP_HEADERS"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ExportConfigError(
            f"{source} must be an http:// or https:// URL: {redact_url(given)!r}"
        )
    if protocol == "http/protobuf":
        if base:
            parts = parts._replace(path=parts.path.rstrip("/") + _HTTP_TRACES_PATH)
        elif source == "--endpoint" and parts.path in ("", "/"):
            parts = parts._replace(path=_HTTP_TRACES_PATH)
    return urlunsplit(parts)


def otlp_exporter(
    endpoint: str | None = None,
    protocol: str | None = None,
    headers: Sequence[str] = (),
    timeout: float | None = None,
) -> tuple[SpanExporter, str]:
    """An OTLP span exporter and the URL it sends to. What is not given comes from the
    OpenTelemetry environment: the protocol, endpoint and timeout (see resolve_*), and, with
    no headers given (`KEY=VALUE` strings), OTEL_EXPORTER_OTLP_[TRACES_]HEADERS."""
    protocol = resolve_protocol(protocol)
    url = resolve_endpoint(endpoint, protocol)
    timeout = resolve_timeout(timeout)
    pairs = [parse_header(text) for text in headers] or _env_headers()
    # The exporters log the URL and what a receiver answers: never its query values or the
    # headers' values (a receiver may echo an API key).
    _EXPORTER_LOG_REDACTION.add(Redactor([value for _, value in pairs], url=url))
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


# What the two exporters log when a send fails, around the cause: gRPC's status code and
# details (a retry warning's, or the final error's), the HTTP exporter's status and reason.
_GRPC_SAID = re.compile(r"StatusCode\.(?P<code>\w+)\b.*?[Ee]rror details: (?P<details>.*)$", re.S)
_HTTP_SAID = re.compile(
    r"^Failed to export spans? batch code: (?P<code>\d+), reason: (?P<reason>.*)$"
)
# gRPC's words for a connection it could not make (or a host it could not find): the
# system's reason comes last, `…: Connection refused`, `…: Domain name not found]`.
_GRPC_NO_CONNECTION = (
    "failed to connect to all addresses",
    "Failed to connect to remote host",
    "errors resolving",
)


def _cause(message: str) -> str:
    """The cause of a failed send in the same words for either protocol, without the address
    the line already names: `connection refused`, `UNAUTHENTICATED: bad token`, `HTTP 401
    Unauthorized`. Was gRPC's `StatusCode.UNAVAILABLE encountered while exporting traces to
    HOST:PORT. Error details: failed to connect to all addresses; last error: UNKNOWN: …:
    Connection refused` where OTLP/HTTP said `Connection refused`."""
    grpc_said = _GRPC_SAID.search(message)
    if grpc_said is not None:
        code, details = grpc_said["code"], grpc_said["details"].strip()
        if any(words in details for words in _GRPC_NO_CONNECTION):
            return _lower_first(details.rsplit(":", 1)[-1].strip(" ]"))
        return f"{code}: {details}" if details else code
    http_said = _HTTP_SAID.match(message)
    if http_said is not None:
        return f"HTTP {http_said['code']} {http_said['reason']}".rstrip()
    # A retry warning names the cause; what it says about the retry is over by now.
    message = re.sub(r",? retrying in [0-9.]+s", "", message)
    return _lower_first(message.removeprefix("Transient error "))


def _lower_first(text: str) -> str:
    # `connection refused`, as the servers' `cannot listen on …: address already in use`.
    return text[:1].lower() + text[1:]


def _size(value: object) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, tuple | list):
        return sum(_size(one) + 2 for one in value)
    return 9


def _estimated_bytes(span: ReadableSpan) -> int:
    """About what the span costs in an OTLP request."""
    return _estimated_size(
        span.name, (span.attributes, *(event.attributes for event in span.events))
    )


def _estimated_size(name: str, attribute_sets: Iterable[Mapping[str, object] | None]) -> int:
    """About what a span of this name and these attributes (its own, its events') costs."""
    size = _SPAN_OVERHEAD_BYTES + len(name)
    for attributes in attribute_sets:
        for key, value in (attributes or {}).items():
            size += len(key) + _size(value) + 4
    return size


def request_batches(spans: Sequence[ReadableSpan]) -> Iterator[Sequence[ReadableSpan]]:
    """The spans in order, in batches of at most 512 spans and about 3 MiB: each one export
    request a receiver takes (a gRPC one takes 4 MiB by default). export-otlp and the live
    export both send these."""
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
        for batch in request_batches(spans):
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
    protocol: str | None = None,
    headers: Sequence[str] = (),
    include_content: bool | None = None,
    salvage: bool = False,
    timeout: float | None = None,
    exporter: SpanExporter | None = None,
    progress: Callable[[ExportedBundle], None] | None = None,
    started: Callable[[int], None] | None = None,
    reduced: Callable[[int], None] | None = None,
) -> list[ExportedBundle]:
    """Send the bundles' spans (OpenTelemetry GenAI conventions) to an OTLP receiver.

    Every bundle is reduced before anything is sent, so bad input sends nothing. `exporter`
    replaces the OTLP exporter (endpoint, protocol, headers and timeout then do not apply).
    A CORRUPT bundle is refused unless `salvage` (then what precedes the damage is sent).
    Raises BundleError (bad bundle; CorruptBundleError), ReductionError (records contradict),
    ExportConfigError (bad endpoint, protocol, header or timeout) and ExportFailedError (the
    receiver did not take the spans). `include_content` None leaves content to
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT. `progress` is called with each
    bundle as soon as its spans were accepted; `started(total)` before the first bundle is
    reduced and `reduced(1)` as each one is.
    """
    include_content = capture_content(include_content)
    if started is not None:
        started(len(bundles))
    made = []
    for bundle in bundles:
        made.append(
            _BundleSpans(
                os.fspath(bundle),
                *bundle_spans(bundle, include_content=include_content, salvage=salvage),
            )
        )
        if reduced is not None:
            reduced(1)
    where = "the exporter"
    owned = exporter is None
    if exporter is None:
        exporter, url = otlp_exporter(endpoint, protocol, headers, timeout)
        where = redact_url(url)
        if not endpoint and _from_env((_TRACES_ENDPOINT_ENV, _ENDPOINT_ENV)) is None:
            # Nothing named a receiver: one that is not there is the default's, which the user
            # may not know was tried.
            where += (
                " (the default: give the receiver's with --endpoint or OTEL_EXPORTER_OTLP_ENDPOINT)"
            )
    try:
        results = []
        for one in made:
            _send(exporter, one.spans, where)
            done = ExportedBundle(
                one.bundle,
                trace_api.format_trace_id(trace_id_of(one.trace.trace_id)),
                len(one.spans),
                integrity_name(one.trace.integrity.status),
            )
            results.append(done)
            if progress is not None:
                progress(done)
        return results
    finally:
        if owned:
            exporter.shutdown()
