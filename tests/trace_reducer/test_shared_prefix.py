"""RecordBuilder's shared prefix: how much of the previous request a new one repeats."""

from __future__ import annotations

from typing import Any

import pytest

from trace_reducer.bundle._records import _shared_prefix

_HISTORY: list[dict[str, Any]] = [{"n": i} for i in range(6)]


@pytest.mark.parametrize(
    ("current", "shared"),
    [
        ([*_HISTORY, {"n": 9}], 6),  # the same objects, then one more
        (_HISTORY[:3], 3),  # cut back
        ([], 0),
        ([{"n": 0}, *_HISTORY[1:]], 6),  # an equal copy counts as the item
        (_HISTORY[:2] + [dict(item) for item in _HISTORY[2:]] + [{"n": 9}], 6),
        ([*_HISTORY[:2], {"n": 7}, *_HISTORY[3:]], 2),  # the same objects after a change
        ([{"n": 5}, *_HISTORY], 0),
    ],
)
def test_the_prefix_ends_at_the_first_item_that_differs(
    current: list[dict[str, Any]], shared: int
) -> None:
    assert _shared_prefix(_HISTORY, current) == shared
