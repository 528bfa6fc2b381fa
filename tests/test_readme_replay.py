"""The README's replay section runs as written: record, change the tool, replay, diff."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from tests.agent_server.conftest import serve
from tests.test_readme import README, example

TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")


def commands(name: str) -> list[list[str]]:
    """The shell lines of the block after `<!-- commands: name -->` (a line ending in a
    backslash goes on on the next), comments dropped."""
    text = README.read_text()
    match = re.search(rf"<!-- commands: {re.escape(name)} -->\n```sh\n(.*?)```", text, re.S)
    assert match, f"no commands {name!r} in the README"
    lines = match.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines]


def _in(
    directory: Path, argv: list[str], bundles: dict[str, str], branch: str = "<branch>"
) -> list[str]:
    """argv with the README's relative paths under directory, <bundle> (the run's bundle) and
    <branch> filled in."""
    out = []
    for arg in argv:
        if arg.startswith("runs/"):
            run = arg.split("/")[1]
            arg = str(directory / arg).replace("<bundle>", bundles.get(run, "<bundle>"))
            arg = arg.replace("<branch>", branch)
        out.append(arg)
    return out


async def test_record_change_the_tool_replay_and_diff(tmp_path: Path) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(example("replay"), "README.md", "exec"), namespace)
    record, replay, diff = commands("replay")
    assert record[:2] == replay[:2] == ["agent-server", "serve"]
    assert diff[:2] == ["trace-reducer", "diff"]
    bundles: dict[str, str] = {}

    async with serve(*_in(tmp_path, record[2:], bundles)) as original:
        recorded = Path(await namespace["my_agent"](original.address))
    bundles["original"] = recorded.name

    def changed(query: str) -> str:
        return f"{len(query)} characters"  # the one line changed

    async with serve(*_in(tmp_path, replay[2:], bundles)) as replaying:
        replayed = Path(await namespace["my_agent"](replaying.address, tool=changed))
    bundles["replayed"] = replayed.name

    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        *_in(tmp_path, diff[1:], bundles),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 1, stderr.decode()
    report = stdout.decode()
    # Call 1 answered the greeting, call 2 asked for the tool, whose output now differs.
    assert "call 1 is the same" in report
    assert "first difference at call 2" in report
    assert "tool calls" in report
    assert "characters" in report

    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER, "diff", str(recorded), str(recorded), stdout=asyncio.subprocess.PIPE
    )
    same, _ = await process.communicate()
    assert process.returncode == 0
    assert "no difference in 5 calls" in same.decode()
