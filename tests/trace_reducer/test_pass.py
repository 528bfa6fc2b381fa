"""The one read-and-reduce pass: the cycle collector is off while it reads, as it was after."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trace_reducer.bundles import one_turn_bundle
from trace_reducer import read_bundle
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
