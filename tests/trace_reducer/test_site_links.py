"""A site's run pages link their own family of runs, not every run under the root."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.trace_reducer.bundles import fork_of, one_turn_bundle, user_item
from trace_reducer.view._site import write_site

_DATA = re.compile(r'<script type="application/json" id="view-data">(.*?)</script>', re.S)
UNRELATED = 40


def _linked(page: Path) -> set[str]:
    found = _DATA.search(page.read_text(encoding="utf-8"))
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1).replace("<\\/", "</"))
    return set(data["rollout"]["links"]["runs"])


def test_each_page_links_its_family_and_no_other_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for number in range(UNRELATED):
        one_turn_bundle(root, thread_id=f"lone-{number}")
    parent = one_turn_bundle(root, thread_id="parent")
    shared = [user_item("answer once")]
    for name in ("fork-a", "fork-b"):
        fork_of(root, parent, shared, name)
    site = tmp_path / "site"
    write_site(str(root), site)
    assert len(list((site / "runs").iterdir())) == UNRELATED + 3
    links = {page.name: _linked(page) for page in (site / "runs").iterdir()}
    by_thread = {
        thread: page
        for page, linked in links.items()
        for thread in linked
        if page.endswith(f"{thread}.html")
    }
    # Was: every page carried all 43 runs, a site growing with the square of its runs.
    assert links[by_thread["lone-7"]] == {"lone-7"}
    assert links[by_thread["parent"]] == {"parent", "fork-a", "fork-b"}
    assert links[by_thread["fork-a"]] == {"parent", "fork-a", "fork-b"}
    assert max(len(linked) for linked in links.values()) == 3


def test_a_site_says_how_far_its_reading_is(tmp_path: Path) -> None:
    # Was: `view ROOT -o DIR` silent while it read a cold root (3,000 runs: 10 s of its 30)
    # before its first page.
    from tests.trace_reducer.test_list import Told

    root = tmp_path / "root"
    for number in range(3):
        one_turn_bundle(root, thread_id=f"lone-{number}")
    reading = Told()
    write_site(str(root), tmp_path / "site", reading=reading)
    assert reading.said == [("started", 3, 0), *[("advanced", 1, 0)] * 3, ("finished", 0, 0)]
