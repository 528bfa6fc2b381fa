"""The one read-and-reduce pass: the cycle collector is off while it reads, as it was after,
and has nothing left to collect once the reduction is gone."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trace_reducer.bundles import one_turn_bundle
from tests.trace_reducer.collector import left_in_cycles
from tests.trace_reducer.conftest import GOLDEN
from trace_reducer import TRACE_FILE_NAME, read_bundle, replay_bundle
from trace_reducer.reduce._pass import reduce_reader


@pytest.fixture
def collector_restored() -> Iterator[None]:
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.usefixtures("collector_restored")
@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_during_the_pass_and_as_it_was_after(
    tmp_path: Path, enabled: bool
) -> None:
    if enabled:
        gc.enable()
    else:
        gc.disable()
    during: list[bool] = []
    with read_bundle(one_turn_bundle(tmp_path)) as reader:
        reduced = reduce_reader(
            reader, forks=None, on_batch=lambda _: during.append(gc.isenabled())
        )
    assert reduced.trace.recording_complete
    assert during
    assert not any(during)
    assert gc.isenabled() is enabled


@pytest.mark.usefixtures("collector_restored")
def test_the_collector_is_on_again_after_a_pass_that_fails(tmp_path: Path) -> None:
    gc.enable()

    def fail(_: object) -> None:
        raise RuntimeError("a consumer's failure")

    with read_bundle(one_turn_bundle(tmp_path)) as reader, pytest.raises(RuntimeError):
        reduce_reader(reader, forks=None, on_batch=fail)
    assert gc.isenabled()


@pytest.mark.parametrize("compact", [False, True])
def test_a_reduction_leaves_nothing_for_the_cycle_collector(compact: bool) -> None:
    # The reducer's working set (every item, turn and call it kept) must go with it: left in
    # cycles, it waits for a collection that costs a replay's worth of time to trace it.
    bundles = sorted(path.parent for path in GOLDEN.rglob(TRACE_FILE_NAME))
    # Once each first: a message class's first use makes its own lasting cycles.
    traces = [replay_bundle(bundle) for bundle in bundles]
    assert any(trace.tool_calls for trace in traces)
    assert any(not trace.recording_complete for trace in traces)

    def replay_each() -> None:
        for bundle in bundles:
            replay_bundle(bundle, compact=compact)

    assert left_in_cycles(replay_each) == []
