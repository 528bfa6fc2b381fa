"""The README's code examples run as written, against a real server."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_server import AgentServer, Settings

README = Path(__file__).resolve().parent.parent / "README.md"


def example(name: str) -> str:
    """The code block that follows `<!-- example: name -->` in the README."""
    text = README.read_text()
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"no example {name!r} in the README"
    return match.group(1)


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
