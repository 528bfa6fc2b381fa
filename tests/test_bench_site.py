"""bench.site_bench: a round against this tree's served viewer, on a small root."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.site_bench import THIS_TREE, measure
from bench.view_bench import CHROMIUM
from tests.trace_reducer.bundles import one_turn_bundle


def test_a_round_opens_run_pages_while_a_tab_polls(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for number in range(3):
        one_turn_bundle(root, thread_id=f"thr_{number}")
    result = measure(root, THIS_TREE, tabs=1, seconds=3)
    # A page a second for 3 s (the first at once), and the tab's first poll at once.
    assert 2 <= result.pages <= 3
    assert result.polls >= 1
    assert 0 < result.page_median <= result.page_max
    assert result.poll_median > 0
    assert result.cpu_share > 0


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium (make test-backends)")
def test_a_round_with_the_browser_opens_and_searches_the_list_page(tmp_path: Path) -> None:
    pytest.importorskip("playwright.sync_api", reason="needs the viewer-tests extra")
    root = tmp_path / "root"
    for number in range(3):
        one_turn_bundle(root, thread_id=f"thr_{number}")
    result = measure(root, THIS_TREE, tabs=1, seconds=1, browser=True)
    opened = result.list_page
    assert opened is not None
    # The page and its data: the three runs' bundle paths are in it.
    assert opened.size > sum(len(str(path)) for path in root.iterdir())
    assert opened.ready > 0
    assert opened.heap > 0
    # The served page asks its server once typing pauses (150 ms).
    assert opened.search >= 0.15
