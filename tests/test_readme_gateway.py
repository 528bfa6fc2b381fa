"""The README's "Trace any agent" section runs as written: its shell lines, its agent program."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from rollout.trace.v1 import state_pb2
from tests.ports import free_port
from trace_reducer import replay_bundle

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(kind: str, language: str) -> str:
    text = README.read_text()
    found = re.search(rf"<!-- {kind}: trace-any-agent -->\n```{language}\n(.*?)```", text, re.S)
    assert found, f"no {kind} block 'trace-any-agent' in the README"
    return found.group(1)


async def test_trace_any_agent(tmp_path: Path) -> None:
    (tmp_path / "weather_agent.py").write_text(_block("example", "python"))
    # The README's port, made free for this run.
    script = _block("command", "sh").replace("127.0.0.1:8090", f"127.0.0.1:{free_port()}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("OPENAI_BASE_URL", None)
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-euc",
        script,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    printed = output.decode()
    assert process.returncode == 0, printed
    assert 'The tool lookup_weather returned: "sunny in' in printed, printed
    (bundle,) = (p for p in (tmp_path / "traces").iterdir() if p.is_dir())
    # The site of every session (was `view traces/*/`, which a second run's second session
    # made `unrecognized arguments`): the list and the session's page.
    assert (tmp_path / "site" / "index.html").is_file()
    assert len(list((tmp_path / "site" / "runs").iterdir())) == 1
    trace = replay_bundle(bundle)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    kinds = [item.kind for item in trace.conversation_items.values()]
    assert state_pb2.ITEM_KIND_FUNCTION_CALL in kinds
    assert state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT in kinds
    assert len(trace.inference_calls) == 2
