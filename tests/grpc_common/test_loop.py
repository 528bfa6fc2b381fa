"""run_on_loop and the event loop names: uvloop where installed, asyncio's own on request."""

from __future__ import annotations

import asyncio
import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from grpc_common import (
    EVENT_LOOPS,
    default_event_loop,
    event_loop_problem,
    run_on_loop,
    running_event_loop,
)


async def _which() -> tuple[str, str]:
    return type(asyncio.get_running_loop()).__module__, running_event_loop()


def test_each_name_runs_its_loop() -> None:
    uv_module, uv_name = run_on_loop(_which(), "uvloop")
    assert uv_module.startswith("uvloop")
    assert uv_name == "uvloop"
    plain_module, plain_name = run_on_loop(_which(), "asyncio")
    assert plain_module.startswith("asyncio")
    assert plain_name == "asyncio"


def test_the_default_is_uvloop_where_it_is_installed() -> None:
    # uvloop is a dependency on every platform but Windows, and make test installs it.
    assert default_event_loop() == "uvloop"
    assert all(event_loop_problem(name) is None for name in EVENT_LOOPS)


def test_without_uvloop_the_default_is_asyncio_and_asking_for_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A platform uvloop has no build for (Windows).
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "uvloop" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert default_event_loop() == "asyncio"
    assert event_loop_problem("uvloop") == (
        "--event-loop uvloop: uvloop is not installed (pip install uvloop), or use asyncio"
    )
    assert event_loop_problem("asyncio") is None


def test_an_unknown_name_is_refused() -> None:
    assert event_loop_problem("trio") == "--event-loop must be one of uvloop, asyncio"


def test_what_is_left_running_is_cancelled_as_asyncio_run_does() -> None:
    cancelled: list[bool] = []

    async def lingering() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> int:
        asyncio.get_running_loop().create_task(lingering())
        await asyncio.sleep(0)
        return 7

    assert run_on_loop(main(), "uvloop") == 7
    assert cancelled == [True]
