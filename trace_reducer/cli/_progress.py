"""Progress of the long commands (reduce-all, export-rl, export-otlp; list and view ROOT -o
while they read bundles afresh), always on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO

INTERVAL_SECONDS = 5.0


class Progress(Protocol):
    """started(total), advanced(count, bad) as bundles are done, tick() now and then, and
    finished() (idempotent) at the end, whatever ended the run."""

    def started(self, total: int) -> None: ...

    def advanced(self, count: int = 1, bad: int = 0) -> None: ...

    def tick(self) -> None: ...

    def finished(self) -> None: ...


class NoProgress:
    """For `--quiet`, and for the exports into a pipe."""

    def started(self, total: int) -> None:
        pass

    def advanced(self, count: int = 1, bad: int = 0) -> None:
        pass

    def tick(self) -> None:
        pass

    def finished(self) -> None:
        pass


class LineProgress:
    """A line at the start, every few seconds and at the end, for reduce-all's logs and pipes
    (no terminal to redraw a bar on)."""

    def __init__(
        self,
        stream: TextIO,
        label: str,
        *,
        interval: float = INTERVAL_SECONDS,
        bad_word: str = "corrupt or failed",
    ) -> None:
        self._stream = stream
        self._label = label
        self._interval = interval
        self._bad_word = bad_word
        self._finished = False
        self._total = 0
        self._done = 0
        self._bad = 0
        self._started = time.monotonic()
        self._last = self._started

    def started(self, total: int) -> None:
        self._total = total
        self._started = self._last = time.monotonic()
        self._line()

    def advanced(self, count: int = 1, bad: int = 0) -> None:
        self._done += count
        self._bad += bad
        self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._line()

    def finished(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        rate = self._done / elapsed if elapsed > 0 else 0.0
        share = self._done / self._total if self._total else 1.0
        print(
            f"{self._label}: {self._done:,}/{self._total:,} bundles ({share:.0%}), "
            f"{rate:,.0f} bundles/s, {self._bad:,} {self._bad_word}",
            file=self._stream,
            flush=True,
        )


class BarProgress:
    """A bar on a terminal: tqdm's where it is installed (the batch extra), else one line
    redrawn in place."""

    def __init__(self, stream: TextIO, label: str, *, bad_word: str = "corrupt or failed") -> None:
        self._stream = stream
        self._label = label
        self._bad_word = bad_word
        self._bar: Any = None
        self._bad = 0
        self._total = 0
        self._done = 0
        self._drawn = 0.0
        self._finished = False

    def started(self, total: int) -> None:
        self._total = total
        try:
            from tqdm import tqdm  # only a terminal needs it
        except ImportError:
            self._draw(force=True)
            return
        self._bar = tqdm(
            total=total, unit="bundle", desc=self._label, file=self._stream, dynamic_ncols=True
        )

    def advanced(self, count: int = 1, bad: int = 0) -> None:
        self._done += count
        self._bad += bad
        if self._bar is None:
            self._draw()
            return
        if bad:
            self._bar.set_postfix_str(f"{self._bad} {self._bad_word}", refresh=False)
        self._bar.update(count)

    def tick(self) -> None:
        if self._bar is not None:
            self._bar.refresh()

    def finished(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._bar is not None:
            self._bar.close()
        elif self._total:
            self._draw(force=True)
            print(file=self._stream, flush=True)

    def _draw(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        share = self._done / self._total if self._total else 1.0
        bad = f", {self._bad:,} {self._bad_word}" if self._bad else ""
        self._stream.write(
            f"\r{self._label}: {self._done:,}/{self._total:,} bundles ({share:.0%}){bad}\x1b[K"
        )
        self._stream.flush()


def progress_for(
    label: str,
    *,
    quiet: bool = False,
    lines_into_pipes: bool = False,
    bad_word: str = "corrupt or failed",
    stream: TextIO | None = None,
) -> Progress:
    """The progress display for a command: a bar on a terminal; into a pipe, lines when
    `lines_into_pipes` (reduce-all's log), else nothing (what a script reads stays what the
    command has to say); nothing with `quiet`."""
    out = sys.stderr if stream is None else stream
    if quiet:
        return NoProgress()
    if out.isatty():
        return BarProgress(out, label, bad_word=bad_word)
    if lines_into_pipes:
        return LineProgress(out, label, bad_word=bad_word)
    return NoProgress()


__all__ = ["BarProgress", "LineProgress", "NoProgress", "Progress", "progress_for"]
