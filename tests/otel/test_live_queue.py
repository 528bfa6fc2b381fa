"""LiveExport's queue is bounded: while the exporter is stuck, spans are dropped and counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (make test installs it)")

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from bench.synthetic import Shape, write_conversation
from tests.otel.test_cli import grpc_receiver
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


async def test_a_long_conversation_goes_out_in_requests_the_receiver_takes(tmp_path: Path) -> None:
    """With content every chat span carries the history it was sent: 200 turns queued at once
    make ~25 MB of spans, which went out as one request of up to 512 spans, far over the 4 MiB
    a gRPC receiver takes, and were all dropped (`export failed`). They go out in the requests
    `export-otlp` makes, each under that limit."""
    bundle = write_conversation(
        tmp_path, Shape(turns=200, deltas_per_turn=60, words_per_delta=2), thread_id="long"
    )
    dropped: list[tuple[int, str]] = []
    async with grpc_receiver() as (endpoint, received):
        live = LiveExport.to_otlp(
            endpoint,
            "grpc",
            include_content=True,
            on_drop=lambda count, reason: dropped.append((count, reason)),
        )
        live.bundle_advanced(bundle, ended=True)
        # Sends what is queued, then returns: the receiver answers on this loop meanwhile.
        await asyncio.to_thread(live.shutdown, 60)
    assert dropped == []
    assert len(received.spans()) == 1 + 200 * 2
    sizes = [request.ByteSize() for request in received.requests]
    assert max(sizes) < 4 * 1024 * 1024
