"""What reduce-all tells the user: progress while it runs, a summary when it is done."""

from __future__ import annotations

import heapq
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._batch import BundleResult, Outcome

_SLOWEST = 5
_INTEGRITIES = ("CLEAN", "UNCLOSED", "TRUNCATED", "CORRUPT")
# Outcomes for which the bundle's records were read in this run.
_READ = (Outcome.REDUCED, Outcome.SALVAGED, Outcome.CORRUPT, Outcome.LIVE)


@dataclass
class Tally:
    """Running totals; keeps the few bundles worth naming, not every result."""

    outcomes: Counter[Outcome] = field(default_factory=Counter)
    integrities: Counter[str] = field(default_factory=Counter)
    records: int = 0
    bytes: int = 0
    done: int = 0
    cpu_seconds: float = 0.0
    slowest: list[tuple[float, int, str, int]] = field(default_factory=list)
    corrupt: list[BundleResult] = field(default_factory=list)
    failed: list[BundleResult] = field(default_factory=list)
    live: list[str] = field(default_factory=list)

    def add(self, result: BundleResult) -> None:
        self.done += 1
        self.cpu_seconds += result.cpu_seconds
        self.outcomes[result.outcome] += 1
        if result.outcome == Outcome.LIVE:
            self.live.append(result.bundle)
        elif result.integrity:
            self.integrities[result.integrity] += 1
        if result.outcome == Outcome.FAILED:
            self.failed.append(result)
        elif result.integrity == "CORRUPT":
            self.corrupt.append(result)
        if result.outcome in _READ:
            self.records += result.records
            self.bytes += result.bytes
            entry = (result.seconds, -result.index, result.bundle, result.records)
            if len(self.slowest) < _SLOWEST:
                heapq.heappush(self.slowest, entry)
            else:
                heapq.heappushpop(self.slowest, entry)

    @property
    def failing(self) -> bool:
        """Whether the batch exits 1: a corrupt bundle left unsalvaged, or one not reduced."""
        return bool(self.outcomes[Outcome.CORRUPT] or self.outcomes[Outcome.FAILED])


def summary(
    tally: Tally,
    *,
    root: str,
    found: int,
    skipped: int,
    seconds: float,
    engine: str,
    slots: int,
    tables: str | None,
    table_rows: dict[str, int] | None,
    interrupted: bool,
) -> list[str]:
    """The lines printed at the end of a batch."""
    state = "interrupted after" if interrupted else "in"
    how = f"{engine}, {_plural(slots, 'worker')}" if slots else engine
    lines = [f"reduce-all: {_plural(found, 'bundle')} under {root} {state} {seconds:.1f} s ({how})"]
    counts = [f"{outcome} {tally.outcomes[outcome]:,}" for outcome in Outcome]
    counts[list(Outcome).index(Outcome.UP_TO_DATE)] = (
        f"up to date {tally.outcomes[Outcome.UP_TO_DATE] + skipped:,}"
    )
    lines.append("  bundles: " + ", ".join(counts))
    if interrupted:
        lines.append(f"  not finished or not reported: {found - skipped - tally.done:,}")
    lines.append(
        "  integrity: " + ", ".join(f"{name} {tally.integrities[name]:,}" for name in _INTEGRITIES)
    )
    rate = 1 / seconds if seconds > 0 else 0.0
    lines.append(
        f"  rate: {tally.done * rate:,.0f} bundles/s, {tally.records * rate:,.0f} records/s, "
        f"{tally.bytes * rate / 1e6:,.2f} MB/s ({tally.records:,} records, {tally.bytes:,} bytes)"
    )
    if tally.done:
        lines.append(
            f"  worker CPU: {tally.cpu_seconds / tally.done * 1000:,.2f} ms per bundle "
            f"({tally.cpu_seconds:,.1f} s in all)"
        )
    for seconds_taken, _, bundle, records in sorted(tally.slowest, reverse=True):
        lines.append(f"  slowest: {seconds_taken:.3f} s {bundle} ({records:,} records)")
    for result in sorted(tally.corrupt, key=lambda r: r.index):
        salvaged = {Outcome.SALVAGED: " (salvaged)", Outcome.UP_TO_DATE: " (salvaged before)"}.get(
            result.outcome, ""
        )
        lines.append(
            f"  CORRUPT at byte {result.bad_frame_offset} (seq {result.bad_frame_seq}): "
            f"{result.bundle}: {result.detail}{salvaged}"
        )
    for result in sorted(tally.failed, key=lambda r: r.index):
        lines.append(f"  FAILED: {result.bundle}: {result.detail}")
    for bundle in sorted(tally.live):
        lines.append(f"  live (still being written, not reduced): {bundle}")
    if tables is not None:
        if table_rows is None:
            lines.append(f"  tables: not written to {tables}")
        else:
            written = ", ".join(f"{name} {rows:,}" for name, rows in table_rows.items())
            lines.append(f"  tables: {tables} (rows: {written})")
    if tally.outcomes[Outcome.CORRUPT]:
        lines.append("  corrupt bundles were not reduced: --salvage reduces them up to the damage")
    return lines


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


class PlainProgress:
    """A line every few seconds, for logs and pipes (no terminal to redraw a bar on)."""

    def __init__(self, stream: TextIO, interval: float = 5.0) -> None:
        self._stream = stream
        self._interval = interval
        self._total = 0
        self._done = 0
        self._bad = 0
        self._started = time.monotonic()
        self._last = self._started

    def started(self, total: int) -> None:
        self._total = total
        self._started = self._last = time.monotonic()
        self._line()

    def advanced(self, results: list[BundleResult]) -> None:
        self._done += len(results)
        self._bad += sum(r.outcome in (Outcome.CORRUPT, Outcome.FAILED) for r in results)

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._line()

    def finished(self) -> None:
        self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        rate = self._done / elapsed if elapsed > 0 else 0.0
        share = self._done / self._total if self._total else 1.0
        print(
            f"reduce-all: {self._done:,}/{self._total:,} bundles ({share:.0%}), "
            f"{rate:,.0f} bundles/s, {self._bad:,} corrupt or failed",
            file=self._stream,
            flush=True,
        )


class BarProgress:
    """tqdm's bar on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar: Any = None
        self._bad = 0

    def started(self, total: int) -> None:
        from tqdm import tqdm  # only a terminal needs it

        self._bar = tqdm(
            total=total, unit="bundle", desc="reduce-all", file=self._stream, dynamic_ncols=True
        )

    def advanced(self, results: list[BundleResult]) -> None:
        bad = sum(r.outcome in (Outcome.CORRUPT, Outcome.FAILED) for r in results)
        if bad:
            self._bad += bad
            self._bar.set_postfix_str(f"{self._bad} corrupt or failed", refresh=False)
        self._bar.update(len(results))

    def tick(self) -> None:
        self._bar.refresh()

    def finished(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_for(stream: TextIO = sys.stderr) -> PlainProgress | BarProgress:
    return BarProgress(stream) if stream.isatty() else PlainProgress(stream)
