"""The README's code examples run as written, against a real server."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_server import AgentServer, Settings
from tests.docs import block

README = Path(__file__).resolve().parent.parent / "README.md"


def example(name: str) -> str:
    """The Python block that follows `<!-- example: name -->` in the README."""
    return block(name, "python")


async def test_the_tools_example(tmp_path: Path) -> None:
    settings = replace(Settings(), listen="127.0.0.1:0", local_word_delay=0.0)
    server = await AgentServer.start(settings)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(example("tools"), "README.md", "exec"), namespace)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            await namespace["ask"](server.address, "What does weather say about Paris?")
    finally:
        await server.stop()
    assert 'The tool weather returned: "sunny, 21 °C".' in printed.getvalue()


async def test_the_training_example(tmp_path: Path) -> None:
    pq = __import__("pytest").importorskip("pyarrow.parquet", reason="needs the training extra")
    traces = tmp_path / "traces"
    settings = replace(Settings(), listen="127.0.0.1:0", local_word_delay=0.0, trace_root=traces)
    server = await AgentServer.start(settings)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(example("training"), "README.md", "exec"), namespace)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            await namespace["grpo_group"](server.address, str(traces), str(tmp_path / "export"))
    finally:
        await server.stop()
    lines = printed.getvalue().splitlines()
    assert len(lines) == 8
    for line in lines:
        uid, prompt_length, masked, reward = line.split()
        assert uid == "question-1"
        assert int(prompt_length) > 0
        trained, total = masked.split("/")
        assert trained == total
        assert int(total) > 0
        assert float(reward) in (0.0, 1.0)
    rows = pq.read_table(tmp_path / "export" / "verl.parquet").to_pylist()
    assert {row["uid"] for row in rows} == {"question-1"}
    assert len({tuple(row["response_ids"]) for row in rows}) == 8
