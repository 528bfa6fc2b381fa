"""Random hostile provider streams: every turn ends, and clients and the trace always agree.

Each iteration is a thread whose one turn is answered by a stream built from random pieces:
well-formed events, lone-surrogate escapes, deep JSON, oversized fields, SSE field variants,
broken JSON, unknown types, early ends and resets. `make fuzz` runs many more iterations
(FUZZ_PROVIDER_ITERATIONS).
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest

from agent_server import provider
from agent_server.provider import parse_event
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import state_pb2
from tests.agent_server.conftest import Harness, StartAgent
from tests.agent_server.scripted_provider import RESET, ScriptedProvider, Step
from trace_reducer import replay_bundle

ITERATIONS = int(os.environ.get("FUZZ_PROVIDER_ITERATIONS", "40"))
CLIENT_MESSAGE_LIMIT = 4 * 1024 * 1024


def _data(event: dict[str, object] | str) -> str:
    text = event if isinstance(event, str) else json.dumps(event)
    return "".join(f"data: {line}\n" for line in text.split("\n")) + "\n"


class _Stream:
    """One random response: a list of SSE text chunks, perhaps cut short or reset."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids = [f"msg-{n}" for n in range(rng.randint(1, 3))]
        if rng.random() < 0.2:
            self.ids = ["dup"] * len(self.ids)  # a provider that reuses one id

    def text(self) -> str:
        rng = self.rng
        choice = rng.random()
        if choice < 0.15:
            return "a\\udc00b"  # an escaped lone surrogate, as it stands in the JSON text
        if choice < 0.2:
            return "x" * rng.choice([300_000, 1_100_000])
        if choice < 0.25:
            return "\U0001f600 é \\u0000 \\n"
        return rng.choice(["hello", " world", "", "0123456789" * 20])

    def field(self) -> str:
        rng = self.rng
        return rng.choice(["", "x" * 2000, "r" * 300_000, "id\\ud800", "ok"])

    def event(self) -> str:
        rng = self.rng
        item_id = rng.choice([*self.ids, ""])
        index = rng.randint(0, len(self.ids))
        # Mostly the events a response is made of; now and then something broken or hostile.
        kind = rng.choices(range(14), weights=[2, 3, 3, 5, 5, 5, 4, 1, 1, 1, 1, 1, 1, 1])[0]
        item = (
            f'{{"type":"message","id":"{item_id}","role":"assistant",'
            f'"content":[{{"type":"output_text","text":"{self.text()}"}}]}}'
        )
        if kind == 0:
            return _data(f'{{"type":"response.created","response":{{"id":"{self.field()}"}}}}')
        if kind in (1, 2):
            return _data(
                f'{{"type":"response.output_item.added","output_index":{index},"item":{item}}}'
            )
        if kind in (3, 4, 5):
            return _data(
                f'{{"type":"response.output_text.delta","item_id":"{item_id}",'
                f'"output_index":{index},"delta":"{self.text()}"}}'
            )
        if kind == 6:
            return _data(
                f'{{"type":"response.output_item.done","output_index":{index},"item":{item}}}'
            )
        if kind == 7:
            return _data(
                f'{{"type":"response.refusal.delta","item_id":"{item_id}","delta":"{self.text()}"}}'
            )
        if kind == 8:
            depth = rng.choice([10, 70, 3000])
            return _data('{"type":"response.deep","v":' + "[" * depth + "]" * depth + "}")
        if kind == 9:
            return rng.choice(["retry: 5\n\n", "id: 9\n\n", ": ping\n\n", "event: ping\n\n"])
        if kind == 10:
            return _data(rng.choice(["{broken", "[1,2]", '"just a string"', "null"]))
        if kind == 11:
            return _data({"type": f"response.unknown_{rng.randrange(5)}", "x": self.field()})
        if kind == 12:
            return _data({"type": "error", "code": self.field(), "message": self.field()})
        return _data(
            f'{{"type":"response.output_text.delta","delta":"{self.text()}","item_id":"nobody"}}'
        )

    def steps(self) -> list[Step]:
        rng = self.rng
        chunks = [self.event() for _ in range(rng.randint(1, 12))]
        ending = rng.random()
        if ending < 0.5:
            chunks.append(_data({"type": "response.completed", "response": {"id": "r"}}))
        elif ending < 0.65:
            chunks.append(_data({"type": "response.failed", "response": {"error": {"code": "x"}}}))
        steps: list[Step] = []
        # Several events per write, or one each, or split mid-event.
        while chunks:
            take = rng.randint(1, 4)
            joined = "".join(chunks[:take])
            del chunks[:take]
            if rng.random() < 0.2 and len(joined) > 4:
                cut = rng.randrange(1, len(joined))
                steps.extend([joined[:cut], joined[cut:]])
            else:
                steps.append(joined)
        if 0.65 <= ending < 0.75:
            steps.append(RESET)
        return steps


def _check(rollout: state_pb2.RolloutTrace, events: list[agent_pb2.ThreadEvent], seed: int) -> None:
    assert rollout.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN, seed
    assert all(event.ByteSize() < CLIENT_MESSAGE_LIMIT for event in events), seed
    produced = {
        item.responses_item_id: item
        for item in rollout.conversation_items.values()
        if any(ref.HasField("inference") for ref in item.produced_by)
    }
    for event in events:
        if not event.HasField("item_completed"):
            continue
        seen = event.item_completed.item
        assert seen.id in produced, seed
        if seen.text_in_deltas:
            continue
        parts = produced[seen.id].content
        text = "".join(p.text for p in parts if p.type != "refusal")
        refusal = "".join(p.text for p in parts if p.type == "refusal")
        assert (seen.text, seen.refusal) == (text, refusal), seed


@pytest.mark.timeout(600)
async def test_random_hostile_streams(
    provider: ScriptedProvider, start_agent: StartAgent, caplog: pytest.LogCaptureFixture
) -> None:
    agent: Harness = await start_agent(max_retries=0, stream_idle_timeout=5.0)
    base = random.Random(os.environ.get("FUZZ_SEED", "provider")).randrange(2**32)
    with caplog.at_level(logging.WARNING):
        for iteration in range(ITERATIONS):
            seed = base + iteration
            provider.queue(*_Stream(random.Random(seed)).steps())
            thread = await agent.start_thread()
            log = agent.events(thread.id)
            turn = await agent.start_turn(thread.id, "go")
            final = await log.turn_completed(turn.id)
            assert final.status != agent_pb2.TURN_STATUS_IN_PROGRESS, seed
            assert final.error.code != "internal", (seed, final.error.message)
            await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            events = await log.until_end()
            _check(replay_bundle(Path(thread.bundle_path)), events, seed)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    assert "recording of thread" not in caplog.text


def _json_value(rng: random.Random, depth: int = 0) -> str:
    """A random JSON text, often one that json and orjson could read apart."""
    scalars = [
        "0", "-0", "-0.0", "1.5e3", "1E400", "-1e400", "NaN", "Infinity", "18446744073709551615",
        "18446744073709551616", "-9223372036854775808", "-9223372036854775809",
        "123456789012345678901234567890", "0.1", "true", "null", '"\\ud800"', '"\\udc00x"',
        '"\\ud83d\\ude00"', '"\\u0000"', '"é€😀"', '"\\"\\\\/"', '"a\\nb"', "01", '"\x01"',
    ]  # fmt: skip
    roll = rng.random()
    if depth > 3 or roll < 0.5:
        return rng.choice(scalars)
    if roll < 0.75:
        return "[" + ",".join(_json_value(rng, depth + 1) for _ in range(rng.randrange(3))) + "]"
    keys = ['"type"', '"delta"', '"a"', '"a"', '"\\ud800"', '"é"']
    members = (f"{rng.choice(keys)}:{_json_value(rng, depth + 1)}" for _ in range(rng.randrange(4)))
    return "{" + ",".join(members) + "}"


def test_an_event_reads_as_json_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_event reads with orjson where it can: every event must come out as json's."""
    rng = random.Random(25)
    texts = [_json_value(rng) for _ in range(3_000)]
    texts += ['{"a":' + "[" * 2_000 + "]" * 2_000 + "}", '{"delta":"\ud800"}', "\ufeff{}", "{} x"]
    events = [parse_event("message", raw) for raw in texts]
    # The reference: json alone (neither orjson nor the C way of _sse_split.c).
    monkeypatch.setattr(provider, "_loads", json.loads)
    monkeypatch.setattr(provider, "_sse_split", None)
    for raw, event in zip(texts, events, strict=True):
        expected = parse_event("message", raw)
        # repr tells 1 from 1.0, True from 1 and -0.0 from 0.0.
        assert (event.type, repr(event.data)) == (expected.type, repr(expected.data)), raw
