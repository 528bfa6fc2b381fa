"""P1's realistic shapes: bundles the agent server itself writes, ordinary replies and tool rounds.

One `agent-server serve` (the built-in local model, every word its own delta) records two
threads at once: one of ordinary replies, one where every turn calls a function tool that the
client answers before the model replies quoting it. Both are driven through the Python client,
as a user would.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from bench._harness import agent_server_argv, spawn
from rollout_client import AgentClient, Thread, function_tool

# The local model sleeps this long before each word, so that every word is its own provider
# read and its own delta record (at 0 the words arrive together and are recorded merged).
WORD_DELAY = 0.0002

_LOOKUP = function_tool(
    "lookup",
    "Look a phrase up in the notes.",
    {"type": "object", "properties": {"phrase": {"type": "string"}}},
)


@dataclass(frozen=True)
class AgentBundles:
    replies: Path
    tools: Path


def _lookup(arguments: object) -> str:
    return "notes on " + json.dumps(arguments)[:60]


async def _conversation(thread: Thread, turns: int, *, tools: bool) -> str:
    for number in range(turns):
        if tools:
            text = f"Question {number}: please lookup what the notes say about the last answer."
            turn = thread.run_turn(text, tools={"lookup": _lookup})
        else:
            text = f"Question {number}: what did the model see when it answered the last one?"
            turn = thread.run_turn(text)
        done = await turn.wait()
        if done.error.message:
            raise RuntimeError(f"a shape's turn failed: {done.error.message}")
    await thread.close()
    return thread.bundle_path


async def _record(address: str, reply_turns: int, tool_turns: int) -> AgentBundles:
    async with AgentClient(address) as client:
        replies = await client.start_thread()
        tools = await client.start_thread(tools=[_LOOKUP])
        paths = await asyncio.gather(
            _conversation(replies, reply_turns, tools=False),
            _conversation(tools, tool_turns, tools=True),
        )
    return AgentBundles(Path(paths[0]), Path(paths[1]))


def record_agent_bundles(root: Path, reply_turns: int, tool_turns: int) -> AgentBundles:
    """Record both shapes through one agent server under root; return their bundles."""
    argv = agent_server_argv(trace_root=root / "shapes", word_delay=WORD_DELAY)
    with spawn(argv) as server:
        return asyncio.run(_record(server.address, reply_turns, tool_turns))
