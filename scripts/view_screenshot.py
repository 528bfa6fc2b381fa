"""Remake docs/view.png: the page of a fresh `agent-server demo` bundle, shot in Chromium."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "view.png"
# The same launch as the browser tests (tests/trace_reducer/test_view_browser.py).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def main() -> int:
    agent_server = Path(sys.executable).parent / "agent-server"
    with tempfile.TemporaryDirectory(prefix="view-shot-") as scratch:
        demo = subprocess.run(
            [str(agent_server), "demo", "--trace-root", scratch],
            capture_output=True,
            text=True,
            check=True,
        )
        page_path = Path(demo.stdout.strip().splitlines()[-1].removeprefix("view.html: "))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=CHROMIUM_ARGS,
                env={**os.environ, "HOME": scratch},
            )
            page = browser.new_page(viewport={"width": 1000, "height": 960})
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-ready=true]")
            page.screenshot(path=str(TARGET))
            browser.close()
    print(TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
