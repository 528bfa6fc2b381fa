"""Following a bundle while it is written: the follower, WatchBundle, `trace-reducer watch`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.agent.v1 import agent_pb2
from rollout.reducer.v1 import reducer_pb2
from rollout.trace.v1 import common_pb2, record_pb2, state_pb2
from tests.agent_server.scripted_provider import (
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from trace_reducer import WatchUpdate, follow_bundle, replay_bundle
from trace_reducer.bundle._framing import decode_varint
from trace_reducer.view._live import LiveTranscript
from trace_reducer.view._watch import MIN_UPDATE_INTERVAL, _could_start_header

from .bundles import (
    COMPLETED,
    BundleBuilder,
    as_input,
    assistant_output,
    one_turn_bundle,
    user_item,
)
from .live import (
    DEADLINE_SECONDS,
    Updates,
    eventually,
    open_descriptors,
    reducer_service,
    scripted_agent,
)
from .test_service import refused

RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
CLEAN = state_pb2.INTEGRITY_STATUS_CLEAN
UNCLOSED = state_pb2.INTEGRITY_STATUS_UNCLOSED
TRUNCATED = state_pb2.INTEGRITY_STATUS_TRUNCATED
CORRUPT = state_pb2.INTEGRITY_STATUS_CORRUPT
WATCH = [sys.executable, "-m", "trace_reducer.cli", "watch"]


def frame_ends(data: bytes) -> list[int]:
    """The byte offset where each frame of a trace.binpb ends."""
    ends = []
    pos = 0
    while pos < len(data):
        decoded = decode_varint(data, pos)
        assert decoded is not None
        size, start = decoded
        pos = start + size
        ends.append(pos)
    return ends


class Follow:
    """follow_bundle consumed in the background; updates awaited by predicate."""

    def __init__(self, path: Path, **options: float) -> None:
        self.updates: list[WatchUpdate] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._pump(path, options))

    async def _pump(self, path: Path, options: dict[str, Any]) -> None:
        try:
            async with contextlib.aclosing(follow_bundle(path, **options)) as updates:
                async for update in updates:
                    self.updates.append(update)
                    self._changed.set()
        finally:
            self._changed.set()

    async def wait_for(self, count: int) -> WatchUpdate:
        async with asyncio.timeout(DEADLINE_SECONDS):
            while len(self.updates) < count:
                if self.task.done():
                    self.task.result()
                    raise AssertionError(f"ended after {len(self.updates)} updates")
                self._changed.clear()
                await self._changed.wait()
        return self.updates[count - 1]

    async def end(self) -> list[WatchUpdate]:
        async with asyncio.timeout(DEADLINE_SECONDS):
            await self.task
        return self.updates


# -- the follower -----------------------------------------------------------------------------


async def test_a_torn_tail_is_awaited_and_the_footer_ends_it(tmp_path: Path) -> None:
    source = one_turn_bundle(tmp_path / "src") / "trace.binpb"
    data = source.read_bytes()
    ends = frame_ends(data)
    growing = tmp_path / "growing.binpb"
    # Half of the fourth frame: a writer caught in the middle of a record.
    cut = ends[2] + (ends[3] - ends[2]) // 2
    growing.write_bytes(data[:cut])
    follow = Follow(growing)
    first = await follow.wait_for(1)
    assert first.records_read == 3
    assert first.trace.integrity.status == UNCLOSED
    assert not first.final
    assert not first.trace.recording_complete
    # The rest arrives in two writes, the second one inside the footer.
    with growing.open("ab") as out:
        out.write(data[cut : ends[-2] + 1])
        out.flush()
        await follow.wait_for(2)
        out.write(data[ends[-2] + 1 :])
    updates = await follow.end()
    assert all(update.trace.integrity.status != TRUNCATED for update in updates)
    assert [update.final for update in updates] == [False] * (len(updates) - 1) + [True]
    final = updates[-1]
    assert final.trace == replay_bundle(source)
    assert final.trace.integrity.status == CLEAN
    assert final.records_read == len(ends)
    counts = [update.records_read for update in updates]
    assert counts == sorted(counts)


async def test_updates_are_coalesced(tmp_path: Path) -> None:
    bundle = BundleBuilder(tmp_path)
    question = user_item("count slowly")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    item = bundle.added(call, "msg-1")
    # Polled far more often than updates may go out: only coalescing keeps their number down.
    follow = Follow(bundle.writer.file_path, poll_interval=0.001)
    await follow.wait_for(1)
    started = time.monotonic()
    words = [f"w{index} " for index in range(400)]
    for word in words:
        bundle.delta(call, word)
        # A writer faster than any reader wants to be told about: a record every 2 ms.
        await asyncio.sleep(0.002)
    elapsed = time.monotonic() - started
    bundle.done(call, item, assistant_output("".join(words), "msg-1"))
    bundle.call_ended(call, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    bundle.thread_ended()
    bundle.close()
    updates = await follow.end()
    # One update per MIN_UPDATE_INTERVAL while records kept coming, plus the first and last.
    assert len(updates) <= elapsed / MIN_UPDATE_INTERVAL + 3, (len(updates), elapsed)
    assert len(updates) < len(words) / 4
    assert updates[-1].trace == replay_bundle(bundle.bundle_dir)


async def test_corruption_ends_the_follow_with_the_records_before_it(tmp_path: Path) -> None:
    source = one_turn_bundle(tmp_path / "src") / "trace.binpb"
    data = bytearray(source.read_bytes())
    ends = frame_ends(bytes(data))
    data[ends[5] - 2] ^= 0x01  # inside the CRC of the sixth frame
    broken = tmp_path / "broken.binpb"
    broken.write_bytes(bytes(data))
    updates = await Follow(broken).end()
    final = updates[-1]
    assert final.final
    assert final.trace.integrity.status == CORRUPT
    assert final.records_read == 5
    assert final.trace == replay_bundle(broken)


async def test_bytes_that_cannot_start_a_bundle_end_at_once(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.binpb"
    garbage.write_bytes(b"hello, this is a text file\n")
    updates = await Follow(garbage).end()
    assert len(updates) == 1
    assert updates[0].final
    assert updates[0].records_read == 0


def test_a_header_cut_short_may_still_be_written(tmp_path: Path) -> None:
    data = (one_turn_bundle(tmp_path) / "trace.binpb").read_bytes()
    header = data[: frame_ends(data)[0]]
    for cut in range(len(header)):
        assert _could_start_header(header[:cut]), cut
    assert not _could_start_header(b"\x07not a frame")
    assert not _could_start_header(b"{\n")


async def test_cancelling_closes_the_file(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path, close=False)
    trace_file = bundle / "trace.binpb"
    follow = Follow(trace_file)
    await follow.wait_for(1)
    assert open_descriptors(trace_file) == 1
    follow.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await follow.task
    await eventually(lambda: open_descriptors(trace_file) == 0, "the follower closed its file")


# -- WatchBundle ------------------------------------------------------------------------------


def _live_reply(first: str, rest: str, gate: asyncio.Event) -> list[str | asyncio.Event]:
    item = message(first + rest, "msg-live")
    return [
        sse(created("resp-live"), item_added(item), text_delta(first, "msg-live")),
        gate,
        sse(
            text_delta(rest, "msg-live"),
            item_done(item),
            completed("resp-live", {"input_tokens": 4, "output_tokens": 6, "total_tokens": 10}),
        ),
    ]


def _partials(trace: state_pb2.RolloutTrace) -> list[str]:
    return [
        output.partial_text
        for call in trace.inference_calls.values()
        for output in call.discarded_outputs
    ]


async def test_watch_bundle_streams_a_turn_before_it_ends(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    async with scripted_agent(root) as (agent, provider), reducer_service(root) as stub:
        gate = asyncio.Event()
        first, rest = "Seen while the turn runs", ", and the rest after it."
        provider.queue(*_live_reply(first, rest, gate))
        thread = await agent.start_thread()
        bundle = Path(thread.bundle_path)
        events = agent.events(thread.id)
        updates = Updates(
            stub.WatchBundle(reducer_pb2.WatchBundleRequest(bundle=bundle.relative_to(root).name))
        )
        try:
            turn = await agent.start_turn(thread.id, "say something")
            live = await updates.wait_for(lambda r: first in _partials(r.trace))
            # The delta is in the watcher's hands while the provider is still held mid-reply.
            assert live.trace.turns[turn.id].execution.status == RUNNING
            assert live.trace.integrity.status == UNCLOSED
            assert not live.trace.recording_complete
            gate.set()
            await events.turn_completed(turn.id)
            await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            responses = await updates.until_end()
        finally:
            await updates.close()
        assert updates.error is None
        final = responses[-1]
        assert final.trace == replay_bundle(bundle)
        assert final.trace.recording_complete
        assert final.records_read == final.trace.integrity.records_read
        texts = [
            "".join(part.text for part in item.content)
            for item in final.trace.conversation_items.values()
        ]
        assert first + rest in texts
        assert all(r.trace.integrity.status in (UNCLOSED, CLEAN) for r in responses)


async def test_watch_bundle_ends_when_the_client_goes_away(tmp_path: Path) -> None:
    root = tmp_path / "root"
    bundle = one_turn_bundle(root, close=False)
    async with reducer_service(root) as stub:
        updates = Updates(stub.WatchBundle(reducer_pb2.WatchBundleRequest(bundle=bundle.name)))
        await updates.wait_for(lambda r: r.records_read > 0)
        trace_file = bundle / "trace.binpb"
        assert open_descriptors(trace_file) == 1
        await updates.close()
        await eventually(lambda: open_descriptors(trace_file) == 0, "the service closed the file")


def _bad_bundles(root: Path) -> dict[str, Path]:
    garbage_dir = root / "garbage-dir"
    garbage_dir.mkdir(parents=True)
    (garbage_dir / "notes.txt").write_text("hello")
    garbage_file = root / "garbage-file" / "trace.binpb"
    garbage_file.parent.mkdir()
    garbage_file.write_bytes(b"\x07not a protobuf frame at all" * 10)
    source = one_turn_bundle(root / "src")
    data = bytearray((source / "trace.binpb").read_bytes())
    data[frame_ends(bytes(data))[5] - 2] ^= 0x01
    corrupt = root / "corrupt" / "trace.binpb"
    corrupt.parent.mkdir()
    corrupt.write_bytes(bytes(data))
    contradicting = BundleBuilder(root / "contradicting")
    contradicting.append(turn_started=record_pb2.TurnStarted(turn=1, thread=5, turn_id="x"))
    # A symlink to a good bundle inside the root: never followed, by either RPC.
    (root / "alias").symlink_to(source)
    return {
        "garbage-dir": garbage_dir,
        "garbage-file": garbage_file.parent,
        "corrupt": corrupt.parent,
        "contradicting": contradicting.close(),
        "alias": root / "alias",
    }


@pytest.mark.parametrize(
    ("bundle", "code", "reason"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("a\0b", grpc.StatusCode.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        ("../outside", grpc.StatusCode.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT"),
        ("/etc", grpc.StatusCode.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT"),
        ("missing", grpc.StatusCode.NOT_FOUND, "BUNDLE_NOT_FOUND"),
        ("garbage-dir", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        ("garbage-file", grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        ("corrupt", grpc.StatusCode.DATA_LOSS, "BUNDLE_CORRUPT"),
        ("contradicting", grpc.StatusCode.FAILED_PRECONDITION, "RECORDS_CONTRADICT"),
        ("alias", grpc.StatusCode.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT"),
    ],
)
async def test_watch_bundle_codes_match_reduce_bundle(
    tmp_path: Path, bundle: str, code: grpc.StatusCode, reason: str
) -> None:
    root = tmp_path / "root"
    (tmp_path / "outside").mkdir()
    bundles = _bad_bundles(root)
    if bundle in bundles:
        bundle = str(bundles[bundle].relative_to(root))
    async with reducer_service(root) as stub:
        reduce_code, reduce_info, _ = await refused(
            stub.ReduceBundle(reducer_pb2.ReduceBundleRequest(bundle=bundle))
        )

        async def watch_all() -> list[reducer_pb2.WatchBundleResponse]:
            return [
                r async for r in stub.WatchBundle(reducer_pb2.WatchBundleRequest(bundle=bundle))
            ]

        watch_code, watch_info, _ = await refused(watch_all())
    assert (watch_code, watch_info.reason) == (code, reason)
    assert (reduce_code, reduce_info.reason) == (code, reason)
    if reason == "BUNDLE_CORRUPT":
        assert watch_info.metadata["bad_frame_seq"] == "6"


# -- trace-reducer watch ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def watching(bundle: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        *WATCH,
        str(bundle),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def read_until(process: asyncio.subprocess.Process, needle: str, seen: list[str]) -> str:
    """Read the process's stdout into seen until it holds needle; return all of it."""
    assert process.stdout is not None
    async with asyncio.timeout(DEADLINE_SECONDS):
        while needle not in "".join(seen):
            chunk = await process.stdout.read(4096)
            if not chunk:
                raise AssertionError(f"stdout ended without {needle!r}: {''.join(seen)!r}")
            seen.append(chunk.decode())
    return "".join(seen)


async def test_watch_prints_the_transcript_live_and_exits_at_the_end(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    async with scripted_agent(root) as (agent, provider):
        gate = asyncio.Event()
        first, rest = "Printed while the turn runs", ", then finished."
        provider.queue(*_live_reply(first, rest, gate))
        thread = await agent.start_thread(instructions="Be brief.")
        events = agent.events(thread.id)
        async with watching(Path(thread.bundle_path)) as process:
            seen: list[str] = []
            await read_until(process, f"thread {thread.id}", seen)
            turn = await agent.start_turn(thread.id, "tell me")
            text = await read_until(process, first, seen)
            assert "user: tell me" in text
            assert f"[turn {turn.id}" not in text  # it has not ended: the provider is held
            gate.set()
            await events.turn_completed(turn.id)
            await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
            async with asyncio.timeout(DEADLINE_SECONDS):
                stdout, stderr = await process.communicate()
    out = "".join(seen) + stdout.decode()
    assert process.returncode == 0, stderr.decode()
    lines = out.splitlines()
    # The streamed line was finished in place, not printed twice.
    assert f"assistant: {first}{rest}" in lines
    assert out.count(first) == 1
    assert f"[turn {turn.id} · COMPLETED" in out
    assert " · COMPLETED · 4 in / 6 out tokens" in out
    assert lines[-1].startswith("recording complete: ")
    assert stderr.decode() == ""


async def test_watch_ctrl_c_says_so(tmp_path: Path) -> None:
    bundle = one_turn_bundle(tmp_path, close=False)
    async with watching(bundle) as process:
        await read_until(process, "[turn turn-1 · COMPLETED", [])
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(DEADLINE_SECONDS):
            _, stderr = await process.communicate()
    assert process.returncode == 130
    message = stderr.decode()
    assert "Traceback" not in message
    assert len(message.strip().splitlines()) == 1, message
    assert message.startswith(f"trace-reducer: stopped watching {bundle} (interrupted)")


async def test_watch_bad_input(tmp_path: Path) -> None:
    bundles = _bad_bundles(tmp_path)
    for name, path, code in [
        ("missing", tmp_path / "missing", 2),
        ("garbage-dir", bundles["garbage-dir"], 2),
        ("garbage-file", bundles["garbage-file"], 2),
        ("corrupt", bundles["corrupt"], 1),
        ("contradicting", bundles["contradicting"], 1),
    ]:
        async with watching(path) as process, asyncio.timeout(DEADLINE_SECONDS):
            _, stderr = await process.communicate()
        message = stderr.decode()
        assert process.returncode == code, (name, message)
        assert "Traceback" not in message
        assert len(message.strip().splitlines()) == 1, (name, message)


def test_live_transcript_of_a_growing_bundle(tmp_path: Path) -> None:
    """Fed the state after every record, the printer shows each thing once, in order."""
    bundle = BundleBuilder(tmp_path)
    question = user_item("what is streamed?")
    turn = bundle.turn("turn-1", [question])
    call = bundle.call(turn, "call-1", [question])
    words = ["Each ", "word ", "once."]
    item = bundle.added(call, "msg-1")
    for word in words:
        bundle.delta(call, word)
    answer = assistant_output("".join(words), "msg-1")
    bundle.done(call, item, answer)
    bundle.call_ended(call, COMPLETED)
    bundle.turn_ended(turn, COMPLETED)
    turn2 = bundle.turn("turn-2", [user_item("and now?")])
    call2 = bundle.call(
        turn2, "call-2", [as_input(answer, "msg-1"), user_item("and now?")], prefix=1
    )
    bundle.added(call2, "msg-2")
    bundle.delta(call2, "never finished")
    bundle.interrupt(turn2)
    bundle.call_ended(call2, common_pb2.EXECUTION_STATUS_CANCELLED)
    bundle.turn_ended(turn2, common_pb2.EXECUTION_STATUS_CANCELLED)
    bundle.thread_ended()
    data = (bundle.close() / "trace.binpb").read_bytes()
    partial = tmp_path / "partial.binpb"
    out = io.StringIO()
    printer = LiveTranscript(out)
    for end in frame_ends(data):
        partial.write_bytes(data[:end])
        trace = replay_bundle(partial)
        printer.show(WatchUpdate(trace, trace.integrity.records_read, final=False))
    lines = out.getvalue().splitlines()
    assert lines.count("user: what is streamed?") == 1
    assert lines.count("assistant: Each word once.") == 1
    streamed = lines.index("assistant: never finished")
    interrupt = lines.index("[interrupt requested by ipv4:127.0.0.1:5555]")
    assert streamed < interrupt < lines.index("[output discarded: never completed]")
    assert lines.count("[output discarded: never completed]") == 1
    assert lines.count("[thread thread-1 · COMPLETED]") == 1
    assert lines.index("assistant: Each word once.") < lines.index("user: and now?")
    turn_lines = [line for line in lines if line.startswith("[turn ")]
    assert len(turn_lines) == 2
    assert turn_lines[0].startswith("[turn turn-1 · COMPLETED · ")
    assert turn_lines[1].startswith("[turn turn-2 · CANCELLED · ")


def test_watch_ends_its_last_line_before_a_corrupt_bundle_s_error(tmp_path: Path) -> None:
    """Stopped by damage mid-answer, the transcript's half line is ended before the error line,
    on stdout and stderr sharing one pipe as on a terminal (was: `assistant: accepted answer
    trace-reducer: corrupt bundle …`, the newline flushed after the error)."""
    source = one_turn_bundle(tmp_path / "src")
    data = bytearray((source / "trace.binpb").read_bytes())
    # The frame after the answer's deltas: the transcript stops inside `assistant: …`.
    data[frame_ends(bytes(data))[11] - 2] ^= 0x01
    bundle = tmp_path / "corrupt"
    bundle.mkdir()
    (bundle / "trace.binpb").write_bytes(bytes(data))
    done = subprocess.run(
        [*WATCH, str(bundle)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=DEADLINE_SECONDS,
        check=False,
    )
    output = done.stdout.decode()
    assert done.returncode == 1, output
    assert "\nassistant: accepted answer \ntrace-reducer: corrupt bundle " in output, output
    assert output.endswith("CRC mismatch\n"), output
