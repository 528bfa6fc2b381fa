"""What reduce-all tells the user: progress while it runs, a summary when it is done."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from ..bundle._names import counted
from ._batch import BundleResult, Outcome

_SLOWEST = 5
_INTEGRITIES = ("CLEAN", "UNCLOSED", "TRUNCATED", "CORRUPT")
# Outcomes for which the bundle's records were read in this run.
_READ = (Outcome.REDUCED, Outcome.SALVAGED, Outcome.CORRUPT, Outcome.LIVE)


@dataclass
class Tally:
    """Running totals; keeps the few bundles worth naming, not every result.

    salvage: this run salvages, so a CORRUPT bundle salvaged before does not fail it.
    """

    salvage: bool = False
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
    # Bundles whose state.json looked up to date but was not theirs, and why.
    distrusted: list[tuple[str, str]] = field(default_factory=list)
    # Bundles read whose rewards.binpb could not be (all) read: the warning to give of each.
    rewards_warnings: list[tuple[int, str]] = field(default_factory=list)
    # Up-to-date bundles no worker looked at (their integrity known from `list`'s index).
    known: int = 0
    # Up-to-date CORRUPT bundles: an earlier run (or `reduce --salvage`) salvaged them.
    salvaged_before: int = 0

    def add_known(self, integrities: Counter[str]) -> None:
        """Up-to-date bundles counted without a worker, by integrity."""
        count = sum(integrities.values())
        self.known += count
        self.outcomes[Outcome.UP_TO_DATE] += count
        self.integrities.update(integrities)

    def add(self, result: BundleResult) -> None:
        self.done += 1
        self.cpu_seconds += result.cpu_seconds
        self.outcomes[result.outcome] += 1
        if result.distrusted_state:
            self.distrusted.append((result.bundle, result.distrusted_state))
        if result.rewards_warning and result.outcome != Outcome.LIVE:
            self.rewards_warnings.append((result.index, result.rewards_warning))
        if result.outcome == Outcome.LIVE:
            self.live.append(result.bundle)
        elif result.integrity:
            self.integrities[result.integrity] += 1
        if result.outcome == Outcome.FAILED:
            self.failed.append(result)
        elif result.integrity == "CORRUPT":
            self.corrupt.append(result)
            self.salvaged_before += result.outcome == Outcome.UP_TO_DATE
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
        """Whether the batch exits 1: a corrupt bundle left unsalvaged (or salvaged by an
        earlier run, when this one does not salvage), or one not reduced."""
        unsalvaged = self.salvaged_before and not self.salvage
        return bool(self.outcomes[Outcome.CORRUPT] or self.outcomes[Outcome.FAILED] or unsalvaged)


def summary(
    tally: Tally,
    *,
    root: str,
    found: int,
    seconds: float,
    engine: str,
    slots: int,
    tables: str | None,
    table_rows: dict[str, int] | None,
    interrupted: bool,
) -> list[str]:
    """The lines printed at the end of a batch."""
    state = "interrupted after" if interrupted else "in"
    how = f"{engine}, {counted(slots, 'worker')}" if slots else engine
    lines = [f"reduce-all: {counted(found, 'bundle')} under {root} {state} {seconds:.1f} s ({how})"]
    counts = [f"{outcome} {tally.outcomes[outcome]:,}" for outcome in Outcome]
    lines.append("  bundles: " + ", ".join(counts))
    if interrupted:
        lines.append(f"  not finished or not reported: {found - tally.known - tally.done:,}")
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
    # Was: said only in the bundle's state.json, the summary CLEAN and exit 0 (export-rl warned).
    for _, warning in sorted(tally.rewards_warnings):
        lines.append(f"  warning: {warning}")
    for bundle in sorted(tally.live):
        lines.append(f"  live (still being written, not reduced): {bundle}")
    for bundle, why in sorted(tally.distrusted):
        lines.append(f"  reduced again, its state.json {why}: {bundle}")
    if tables is not None:
        if table_rows is None:
            lines.append(f"  tables: not written to {tables}")
        else:
            written = ", ".join(f"{name} {rows:,}" for name, rows in table_rows.items())
            lines.append(f"  tables: {tables} (rows: {written})")
    if tally.outcomes[Outcome.CORRUPT]:
        lines.append("  corrupt bundles were not reduced: --salvage reduces them up to the damage")
    if tally.salvaged_before and not tally.salvage:
        lines.append(
            "  corrupt bundles salvaged before are still corrupt: --salvage accepts the state.json "
            "salvaged up to the damage"
        )
    return lines
