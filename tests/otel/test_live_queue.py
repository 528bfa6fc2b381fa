"""LiveExport's queue is bounded: while the exporter is stuck, spans are dropped and counted."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (make test installs it)")

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tests.trace_reducer.bundles import one_turn_bundle
from trace_reducer.export._live import LiveExport
from trace_reducer.export._otel import bundle_spans


class _Stuck(SpanExporter):
    """An exporter that takes nothing until released, like a collector that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(30)
        self.exported.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_a_stuck_exporter_costs_dropped_spans_never_the_caller(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path)
    total = len(bundle_spans(bundle)[1])
    assert total >= 3
    exporter = _Stuck()
    dropped: list[tuple[int, str]] = []
    some_dropped = threading.Event()

    def on_drop(count: int, reason: str) -> None:
        dropped.append((count, reason))
        some_dropped.set()

    live = LiveExport(exporter, max_queue=1, on_drop=on_drop)
    live.bundle_advanced(bundle, ended=True)  # returns at once, the exporter being stuck
    assert some_dropped.wait(30)
    exporter.release.set()
    live.shutdown(timeout=30)
    assert {reason for _, reason in dropped} == {"queue full"}
    # Every span was either delivered or counted as dropped; at most the queue and the batch
    # in flight were kept.
    assert len(exporter.exported) + sum(count for count, _ in dropped) == total
    assert 1 <= len(exporter.exported) <= 2
