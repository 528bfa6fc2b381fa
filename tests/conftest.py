"""Session-wide: the real engine (vLLM) for tests marked `engine`, started once, early."""

from __future__ import annotations

import logging
import signal

import pytest

from tests.engine import ENGINE


def pytest_configure(config: pytest.Config) -> None:
    # The tests' own HTTP client (httpx; the product speaks aiohttp) logs every request at
    # INFO: hostile tests' URLs, lone surrogates and all, are no line for a server's log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # A suite started in the background of a script (`make test &`) inherits SIGINT ignored,
    # and so would every command it starts: the Ctrl-C tests want a terminal's SIGINT. A
    # handler (unlike "ignored") is reset to the default in a program the suite starts.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# After `-m`/`-k` deselected theirs: a run without engine tests starts no engine.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine tests run last, and the engine starts now: it comes up while the rest runs."""
    engine = [item for item in items if item.get_closest_marker("engine")]
    if not engine:
        return
    items[:] = [item for item in items if not item.get_closest_marker("engine")] + engine
    ENGINE.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ENGINE.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ENGINE.asked_after is not None and ENGINE.waited is not None:
        terminalreporter.write_line(
            f"vLLM (SmolLM2-135M, CPU): the engine tests began {ENGINE.asked_after:.0f} s after"
            f" it was started and waited {ENGINE.waited:.0f} s for it"
        )


@pytest.fixture(scope="session")
def vllm_url() -> str:
    """The session engine's `/v1` base URL, once it answers `/health`."""
    try:
        return ENGINE.url()
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
