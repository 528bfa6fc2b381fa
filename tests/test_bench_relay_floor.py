"""bench.relay_floor: the bare relay reads, records and sends every delta of the model's turns."""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path

from agent_server.local_model import reply_words
from bench import relay_floor
from bench._harness import prompt, spawn, stubs
from rollout.agent.v1 import agent_pb2

_TURNS = 2
_STREAMS = 3


async def _read(address: str) -> list[list[str]]:
    """Each stream's messages' delta texts."""

    async def one(stub: object) -> list[str]:
        texts = []
        async for response in stub.StreamEvents(agent_pb2.StreamEventsRequest()):  # type: ignore[attr-defined]
            texts.append(response.event.agent_message_delta.delta)
        return texts

    async with stubs(address, 2) as clients:
        return list(await asyncio.gather(*(one(clients[i % 2]) for i in range(_STREAMS))))


def test_every_delta_is_relayed_and_each_message_written_once(tmp_path: Path) -> None:
    model_argv = [sys.executable, "-m", "bench._stamped_model", "--word-delay", "0"]
    words = sum(len(reply_words(prompt(turn))) for turn in range(_TURNS))
    with (
        spawn(model_argv) as model,
        relay_floor.serve(model.address, _TURNS, tmp_path / "on") as recording,
        relay_floor.serve(model.address, _TURNS, None) as bare,
    ):
        streams = asyncio.run(_read(recording.address))
        floor = relay_floor.drive(bare, _STREAMS)
    for texts in streams:
        # Every word the model sent, stamped, in order, across both turns.
        assert "".join(texts).count("@") == words
    assert floor.deltas == _STREAMS * words
    assert 0 < floor.messages <= floor.deltas
    assert floor.server_cpu_seconds > 0
    bundles = sorted((tmp_path / "on").iterdir())
    assert len(bundles) == _STREAMS
    written = sorted((bundle / "trace.binpb").stat().st_size for bundle in bundles)
    # One write a message: its text behind a record's worth of head.
    expected = sorted(sum(20 + len(text.encode()) for text in texts) for texts in streams)
    assert written == expected
    for bundle in bundles:
        assert stat.S_IMODE(bundle.stat().st_mode) == 0o700
        assert stat.S_IMODE((bundle / "trace.binpb").stat().st_mode) == 0o600
    # The relay not recording wrote nothing anywhere under the test's directory.
    assert [path.name for path in tmp_path.iterdir()] == ["on"]
