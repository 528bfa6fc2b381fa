"""Live export: a recording process sends each turn's spans as the turn ends, in the background."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ..bundle._errors import BundleError, ReductionError
from ._genai import capture_content
from ._otel import bundle_spans, otlp_exporter, request_batches

log = logging.getLogger("trace_reducer.export.live")

DEFAULT_MAX_QUEUE = 2048
_BATCH_SPANS = 512
_STOP = None


@dataclass
class _Bundle:
    sent: set[int] = field(default_factory=set)


def _still_open(span: ReadableSpan) -> bool:
    """A span goes out once what it shows has ended: the thread's at the footer (its end is
    known only then), a turn's or a call's when the records end it (a gateway session's turn
    outlasts its calls)."""
    if span.parent is None:
        return True
    attributes = span.attributes or {}
    return attributes.get("rollout.execution.status") == "RUNNING"


class LiveExport:
    """The one hook a recording server calls: `bundle_advanced(path)` after a turn's records are
    durable, `bundle_advanced(path, ended=True)` after its footer. Neither blocks nor raises: a
    worker thread reduces the bundle and queues the spans that ended and were not yet sent (a
    thread's own span waits for the footer), a second sends them in batches. The span queue
    is bounded: while the collector is slow or gone, spans that find it full, and spans an
    export failed to deliver, are dropped, logged and passed to `on_drop(count, reason)`;
    `on_export(count)` sees each delivery.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        include_content: bool | None = None,
        on_drop: Callable[[int, str], None] | None = None,
        on_export: Callable[[int], None] | None = None,
    ) -> None:
        self._exporter = exporter
        # None: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT decides.
        self._include_content = capture_content(include_content)
        self._on_drop = on_drop
        self._on_export = on_export
        # Bundles waiting to be reduced, at most once each (a later turn's request covers an
        # earlier one's): bounded by the number of live threads.
        self._pending: dict[str, bool] = {}
        self._pending_lock = threading.Lock()
        self._wake = threading.Condition(self._pending_lock)
        self._spans: queue.Queue[ReadableSpan | None] = queue.Queue(max_queue)
        self._bundles: dict[str, _Bundle] = {}
        self._closed = False
        self._reducer = threading.Thread(target=self._reduce_loop, name="otlp-reduce", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="otlp-send", daemon=True)
        self._reducer.start()
        self._sender.start()

    @classmethod
    def to_otlp(
        cls,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: tuple[str, ...] = (),
        **options: object,
    ) -> LiveExport:
        """A live export to an OTLP receiver; what is not given comes from the OTel environment
        (as for `trace-reducer export-otlp`). Raises ExportConfigError for bad settings."""
        exporter, _ = otlp_exporter(endpoint, protocol, headers)
        return cls(exporter, **options)  # type: ignore[arg-type]

    def bundle_advanced(self, bundle_path: str | os.PathLike[str], *, ended: bool = False) -> None:
        """Queue the bundle's new spans for export (never blocks the caller)."""
        path = os.fspath(bundle_path)
        with self._wake:
            if self._closed:
                return
            self._pending[path] = self._pending.get(path, False) or ended
            self._wake.notify()

    def _reduce_loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    break
                path = next(iter(self._pending))
                ended = self._pending.pop(path)
            self._queue_new_spans(path, ended)
        self._spans.put(_STOP)

    def _queue_new_spans(self, path: str, ended: bool) -> None:
        try:
            _, spans = bundle_spans(path, include_content=self._include_content, salvage=True)
        except (BundleError, ReductionError, OSError, ValueError) as error:
            log.warning("live export: cannot reduce %s: %s", path, error)
            return
        state = self._bundles.setdefault(path, _Bundle())
        dropped = 0
        for span in spans:
            span_id = span.context.span_id if span.context is not None else 0
            if span_id in state.sent or (not ended and _still_open(span)):
                continue
            state.sent.add(span_id)
            try:
                self._spans.put_nowait(span)
            except queue.Full:
                dropped += 1
        if ended:
            del self._bundles[path]
        if dropped:
            self._dropped(dropped, "queue full")

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            first = self._spans.get()
            if first is _STOP:
                break
            batch = [first]
            while len(batch) < _BATCH_SPANS:
                try:
                    span = self._spans.get_nowait()
                except queue.Empty:
                    break
                if span is _STOP:
                    stop = True
                    break
                batch.append(span)
            # In requests a receiver takes, as export-otlp sends them: with content a chat span
            # is as large as its history, and 512 of them were one request of tens of MB that
            # every receiver refused, each of its spans dropped.
            for request in request_batches(batch):
                self._export(request)

    def _export(self, spans: Sequence[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(spans)
        except Exception as error:  # noqa: BLE001 -- an exporter must not end the thread
            log.warning("live export: exporter failed: %s", error)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._on_export is not None:
                self._on_export(len(spans))
        else:
            self._dropped(len(spans), "export failed")

    def _dropped(self, count: int, reason: str) -> None:
        log.warning("live export: dropped %d spans (%s)", count, reason)
        if self._on_drop is not None:
            self._on_drop(count, reason)

    def shutdown(self, timeout: float | None = None) -> None:
        """Send what is queued (waiting up to `timeout` seconds), then release the exporter."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._reducer.join(timeout)
        self._sender.join(timeout)
        self._exporter.shutdown()
