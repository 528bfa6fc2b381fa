"""`--replay-from` over a hostile root: symlinked and FIFO trace files, torn bundles, payloads
nested past any parser's depth. Nothing outside the root is read, nothing waits, and a bundle
that cannot be replayed is one line naming it, never a traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from agent_server import Settings
from agent_server.config import ConfigError
from agent_server.replay_model import ReplayModel
from rollout.trace.v1 import common_pb2, record_pb2
from tests.trace_reducer.bundles import BundleBuilder, assistant_output, one_turn_bundle, user_item
from trace_reducer import BundleError, bundle_paths, read_recorded

AGENT_SERVER = str(Path(sys.executable).parent / "agent-server")
INPUT_ITEM = record_pb2.PAYLOAD_KIND_INPUT_ITEM
ENVELOPE = record_pb2.PAYLOAD_KIND_REQUEST_ENVELOPE


def _root_with_planted_files(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    root.mkdir()
    good = one_turn_bundle(root)
    outside = one_turn_bundle(tmp_path / "outside", text="outside words")
    linked = root / "linked-trace"
    linked.mkdir()
    (linked / "trace.binpb").symlink_to(outside / "trace.binpb")
    (root / "linked-dir").symlink_to(outside)
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trace.binpb")
    return root, good


def test_replay_from_a_root_reads_only_regular_bundles_inside_it(tmp_path: Path) -> None:
    root, good = _root_with_planted_files(tmp_path)
    # Was: the bundle behind linked-trace/trace.binpb (outside the root) was replayed too.
    assert bundle_paths(root) == [good]
    threads = list(read_recorded(root))
    assert [t.bundle for t in threads] == [good]
    texts = [str(call.request) for t in threads for call in t.calls]
    assert not any("outside words" in text for text in texts)


def _deep_request_bundle(root: Path, depth: int) -> Path:
    """A call whose one input item is nested `depth` deep (the reducer keeps it opaque)."""
    builder = BundleBuilder(root)
    nested = b"[" * depth + b"]" * depth
    item = builder.writer.put_payload(
        b'{"content":' + nested + b',"role":"user","type":"message"}', INPUT_ITEM
    )
    envelope = builder.writer.put_payload(b'{"model":"m"}', ENVELOPE)
    builder.append(
        turn_started=record_pb2.TurnStarted(
            turn=1, thread=builder.thread, turn_id="turn-1", input_payload_ids=[item]
        )
    )
    builder.append(
        inference_started=record_pb2.InferenceStarted(
            call=1,
            turn=1,
            inference_call_id="call-1",
            attempt=1,
            model="m",
            request_envelope_payload_id=envelope,
            input_payload_ids=[item],
        )
    )
    return builder.close()


def test_a_request_nested_past_the_parser_is_one_line(tmp_path: Path) -> None:
    bundle = _deep_request_bundle(tmp_path / "root", 100_000)
    with pytest.raises(BundleError, match="call-1: a payload is nested too deep"):
        list(read_recorded(bundle))
    # Was: RecursionError out of json.loads, and a traceback from `serve --replay-from`.
    done = subprocess.run(
        [AGENT_SERVER, "serve", "--replay-from", str(bundle), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    assert "internal error" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--replay-from" in done.stderr


def _damaged_stream_bundle(root: Path, damage: str) -> Path:
    """One streamed call whose records read but cannot be sent again as provider events."""
    builder = BundleBuilder(root)
    question = user_item("hi")
    turn = builder.turn("turn-1", [question])
    call = builder.records.inference_started_after_prefix(
        turn,
        inference_call_id="call-1",
        attempt=1,
        model=builder.model,
        provider_base_url="http://127.0.0.1:9/v1",
        envelope={"model": builder.model, "store": False, "stream": True},
        prefix_count=0,
        new_items=[question],
    )
    builder.created(call, "resp-1")
    item = builder.added(call, "msg-1")
    delta = record_pb2.OutputTextDelta(call=call, item=item, delta="ab")
    if damage == "unknown delta kind":
        delta.kind = 99  # type: ignore[assignment]
    elif damage == "alternatives missing":
        delta.tokens.CopyFrom(
            common_pb2.DeltaTokens(
                logprobs=[-0.1, -0.2],
                texts=["a", "b"],
                top_counts=[2, 2],
                top_texts=["a"],
                top_logprobs=[-1.0],
            )
        )
    builder.append(output_text_delta=delta)
    if damage == "output item no JSON":
        payload = builder.writer.put_payload(b"{not json", record_pb2.PAYLOAD_KIND_OUTPUT_ITEM)
        builder.append(
            output_item_done=record_pb2.OutputItemDone(
                call=call, item=item, item_payload_id=payload, item_id="msg-1"
            )
        )
    else:
        builder.done(call, item, assistant_output("ab", "msg-1"))
    builder.event(call, "response.completed", {"response": {"id": "resp-1"}})
    builder.call_ended(call, common_pb2.EXECUTION_STATUS_COMPLETED, response_id="resp-1")
    return builder.close()


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("unknown delta kind", "a delta of unknown kind 99"),
        ("alternatives missing", "its tokens count 4 alternatives but hold 1"),
        ("output item no JSON", "is no JSON"),
    ],
)
async def test_a_call_that_cannot_be_sent_again_is_refused_at_start_up(
    tmp_path: Path, damage: str, said: str
) -> None:
    bundle = _damaged_stream_bundle(tmp_path / "root", damage)
    # Was: read fine, then the request for the call raised KeyError / IndexError /
    # JSONDecodeError in the replay provider: a traceback in the log, the turn FAILED with
    # `provider answered HTTP 500: internal error`.
    with pytest.raises(ConfigError) as raised:
        await ReplayModel.from_settings(Settings(replay_from=bundle))
    message = str(raised.value)
    assert message.startswith(f"--replay-from: {bundle}: call call-1: "), message
    assert said in message


def test_serve_over_a_damaged_stream_is_one_line(tmp_path: Path) -> None:
    bundle = _damaged_stream_bundle(tmp_path / "root", "unknown delta kind")
    done = subprocess.run(
        [AGENT_SERVER, "serve", "--replay-from", str(bundle), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        f"agent-server: --replay-from: {bundle}: call call-1: a delta of unknown kind 99"
    ]


@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        # json reads neither: was RecursionError out of the handler.
        (b"[" * 100_000 + b"]" * 100_000, 400, "the request body is nested too deep"),
        # json reads it; describing how it differs recursed past the limit.
        (
            b'{"input":[{"role":"user","x":' + b"[" * 990 + b"]" * 990 + b"}]}",
            400,
            "the request body is nested too deep",
        ),
        # Was TypeError ('int' object is not iterable) while describing the divergence.
        (b'{"input": 5}', 409, "differs from recorded call 1"),
    ],
)
async def test_a_hostile_request_body_gets_an_answer_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes, status: int, said: str
) -> None:
    """The gateway passes its clients' bodies to the replay provider as they came."""
    bundle = one_turn_bundle(tmp_path / "root")
    model = await ReplayModel.from_settings(Settings(replay_from=bundle))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{model.url}/responses", data=body) as answer,
        ):
            assert answer.status == status
            error = (await answer.json())["error"]
        assert said in error["message"]
    finally:
        await model.stop()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
