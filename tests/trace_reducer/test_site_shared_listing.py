"""The served viewer lists its root once for every request that asks while a listing runs, and
answers a slow listing again for twice as long as it took, and while the next one runs; a quick
one never."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tests.trace_reducer.bundles import one_turn_bundle
from tests.trace_reducer.site import served_site
from trace_reducer.view import _site
from trace_reducer.view._site import _Listed, _SharedListing


class _Root:
    """A listing made by hand: each one counted, taking `took` seconds of a clock the test
    moves, optionally held until released or failing."""

    def __init__(self, took: float) -> None:
        self.now = 100.0
        self.took = took
        self.listings = 0
        self.error: Exception | None = None
        self.release: threading.Event | None = None
        self.entered = threading.Event()
        # Each listing's runs (a new list each time) and its tag (each its own, unless set).
        self.made: list[_Listed] = []
        self.tag: str | None = None

    def clock(self) -> float:
        return self.now

    def list_now(self) -> tuple[_Listed, bytes, str]:
        self.entered.set()
        if self.release is not None:
            self.release.wait()
        self.listings += 1
        self.now += self.took
        if self.error is not None:
            raise self.error
        listed: _Listed = []
        self.made.append(listed)
        return listed, f"listing {self.listings}".encode(), self.tag or f'"{self.listings}"'


def _shared(root: _Root, slow: float = 0.25) -> _SharedListing:
    return _SharedListing(root.list_now, slow=slow, clock=root.clock)


async def test_requests_asking_together_share_one_listing() -> None:
    root = _Root(took=0.001)
    shared = _shared(root)
    answers = await asyncio.gather(*(shared.get() for _ in range(5)))
    assert root.listings == 1
    assert {answer.body for answer in answers} == {b"listing 1"}


async def test_a_quick_listing_is_never_answered_again() -> None:
    root = _Root(took=0.2)
    shared = _shared(root)
    assert (await shared.get()).body == b"listing 1"
    assert (await shared.get()).body == b"listing 2"
    assert root.listings == 2


async def test_a_slow_listing_is_answered_again_for_twice_what_it_took() -> None:
    root = _Root(took=3.0)
    shared = _shared(root)
    first = await shared.get()
    assert (first.took, first.ended) == (3.0, 103.0)
    root.now = 108.9
    assert await shared.get() is first
    assert shared._running is None
    root.now = 109.0
    # Then the next listing starts, and until it ends every request is answered the last one.
    root.release = threading.Event()
    assert await shared.get() is first
    assert await shared.get() is first
    running = shared._running
    assert running is not None
    root.release.set()
    again = await running
    assert again.body == b"listing 2"
    assert await shared.get() is again
    assert root.listings == 2


async def test_a_failed_listing_after_a_slow_one_is_told_to_the_next_request() -> None:
    root = _Root(took=3.0)
    shared = _shared(root)
    first = await shared.get()
    root.now += 2 * first.took
    root.error = OSError("the root went away")
    assert await shared.get() is first
    running = shared._running
    assert running is not None
    with pytest.raises(OSError, match="the root went away"):
        await running
    # The slow listing is not answered again: the next request lists, and hears the failure.
    with pytest.raises(OSError, match="the root went away"):
        await shared.get()
    root.error = None
    assert (await shared.get()).body == b"listing 4"
    assert root.listings == 4


async def test_an_unchanged_listing_keeps_the_runs_listed_before() -> None:
    # What the served list worked out about its runs (their fields, their lower-cased text, its
    # answers) stays while the root is as it was.
    root = _Root(took=0.001)
    root.tag = '"same"'
    shared = _shared(root)
    first = await shared.get()
    second = await shared.get()
    assert root.listings == 2
    assert second.listed is first.listed is root.made[0]
    assert second.listed is not root.made[1]
    assert second.ended > first.ended
    root.tag = '"changed"'
    third = await shared.get()
    assert third.listed is root.made[2]
    assert third.body == b"listing 3"


async def test_a_failed_listing_reaches_every_waiter_and_the_next_request_lists_again() -> None:
    root = _Root(took=3.0)
    root.error = OSError("the root went away")
    shared = _shared(root)
    answers = await asyncio.gather(*(shared.get() for _ in range(3)), return_exceptions=True)
    assert [str(answer) for answer in answers] == ["the root went away"] * 3
    root.error = None
    assert (await shared.get()).body == b"listing 2"


async def test_a_waiter_that_goes_does_not_stop_the_listing_for_the_others() -> None:
    root = _Root(took=0.001)
    root.release = threading.Event()
    shared = _shared(root)
    leaving = asyncio.ensure_future(shared.get())
    staying = asyncio.ensure_future(shared.get())
    # The listing began after both had asked (each asks in its first step, the listing's task
    # was made by the first and runs after), and is held in its thread.
    await asyncio.to_thread(root.entered.wait)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    root.release.set()
    assert (await staying).body == b"listing 1"
    assert root.listings == 1


async def test_the_servers_list_and_run_pages_take_the_shared_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's own listing, counted: a root of two runs lists in milliseconds, so each
    # request lists it afresh, and a new run shows at the next poll.
    calls: list[int] = []
    real = _site._listed_runs

    def counted(*args: object, **kwargs: object) -> _Listed:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_site, "_listed_runs", counted)
    root = tmp_path / "traces"
    one_turn_bundle(root, thread_id="thr_first")
    async with served_site(root) as http:
        first = (await http.get("/api/runs")).json()["runs"]
        assert [run["thread_id"] for run in first] == ["thr_first"]
        page = await http.get(first[0]["href"])
        assert page.status_code == 200
        assert len(calls) == 2
        one_turn_bundle(root, thread_id="thr_second")
        runs = (await http.get("/api/runs")).json()["runs"]
        assert sorted(run["thread_id"] for run in runs) == ["thr_first", "thr_second"]
        assert len(calls) == 3
