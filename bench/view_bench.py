"""The viewer on a long rollout: time to write view.html, its size, and Chromium opening it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trace_reducer import replay_bundle, write_view

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")


@contextlib.contextmanager
def headless_chromium() -> Iterator[Browser]:
    """The machine's Chromium, headless, with a home of its own (Playwright drives it)."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as home, sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
            env={**os.environ, "HOME": home},
        )  # fmt: skip
        try:
            yield browser
        finally:
            browser.close()


@dataclass(frozen=True)
class ViewResult:
    write_seconds: float
    replay_seconds: float
    page_bytes: int
    bundle_bytes: int
    open_seconds: float | None
    next_page_seconds: float | None
    last_body_seconds: float | None


def _best(runs: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def _browser_times(page_path: Path) -> tuple[float, float, float] | None:
    """Seconds until the page has rendered, to show the next page, and to rebuild the last
    call's request body (the largest); None without Playwright and Chromium."""
    try:
        import playwright.sync_api  # noqa: F401 - only whether it is there
    except ImportError:
        return None
    if not CHROMIUM.exists():
        return None
    with headless_chromium() as browser:
        opens = []
        for _ in range(3):
            page = browser.new_page()
            started = time.perf_counter()
            page.goto(page_path.resolve().as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=120_000)
            opens.append(time.perf_counter() - started)
            page.close()
        page = browser.new_page()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]", timeout=120_000)
        started = time.perf_counter()
        page.locator(".pager button.next").first.click()
        page.wait_for_selector("text=page 2 of")
        next_page = time.perf_counter() - started
        page.click("nav#tabs button[data-tab=timeline]")
        page.locator(".pager button", has_text="last").first.click()
        started = time.perf_counter()
        page.locator("details.body-details summary").last.click()
        page.locator("pre.body").wait_for(timeout=120_000)
        body = time.perf_counter() - started
    return min(opens), next_page, body


def measure_view(bundle: Path, out_dir: Path, runs: int = 3) -> ViewResult:
    page_path = out_dir / "view.html"
    write = _best(runs, lambda: write_view(bundle, page_path))
    replay = _best(runs, lambda: replay_bundle(bundle))
    browser = _browser_times(page_path)
    return ViewResult(
        write_seconds=write,
        replay_seconds=replay,
        page_bytes=page_path.stat().st_size,
        bundle_bytes=(bundle / "trace.binpb").stat().st_size,
        open_seconds=browser[0] if browser else None,
        next_page_seconds=browser[1] if browser else None,
        last_body_seconds=browser[2] if browser else None,
    )
