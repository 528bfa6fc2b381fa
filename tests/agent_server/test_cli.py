"""`agent-server serve` and `agent-server demo` as users run them: real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format

from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import (
    AGENT_SERVER,
    EventLog,
    clean_env,
    error_reason,
    reduce_with_cli,
    serve,
)
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    answer,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from tests.commands import interrupt_while_importing
from tests.ports import free_port
from trace_reducer import read_bundle
from trace_reducer._exits import EXIT_INTERRUPTED

FAKE_KEY = "sk-test-0123456789-SECRET-never-written"


@pytest.mark.parametrize(
    ("loop_args", "loop"), [((), "uvloop"), (("--event-loop", "asyncio"), "asyncio")]
)
async def test_serve_records_a_turn_and_exits_cleanly_on_sigterm(
    provider: ScriptedProvider, tmp_path: Path, loop_args: tuple[str, ...], loop: str
) -> None:
    provider.queue(answer("served answer"))
    traces = tmp_path / "traces"
    async with serve(
        *loop_args,
        "--provider-url",
        provider.url,
        ROLLOUT_TRACE_ROOT=str(traces),
        OPENAI_API_KEY=FAKE_KEY,
    ) as served:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
            events = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id)))
            turn = (
                await stub.StartTurn(
                    agent_pb2.StartTurnRequest(
                        thread_id=thread.id, input=[agent_pb2.UserInput(text="hi")]
                    )
                )
            ).turn
            done = await events.turn_completed(turn.id)
            assert done.status == agent_pb2.TURN_STATUS_COMPLETED
            served.process.send_signal(signal.SIGTERM)
            # The stream ends when the server shuts the thread down.
            await events.until_end()
        assert await served.process.wait() == 0

    [bundle] = sorted(traces.iterdir())
    with read_bundle(bundle) as reader:
        assert sum(1 for _ in reader) > 5
        assert reader.integrity.status == state_pb2.INTEGRITY_STATUS_CLEAN
    # The key went to the provider as a header, and nowhere else.
    assert provider.requests[0].headers["authorization"] == f"Bearer {FAKE_KEY}"
    written = b"".join(p.read_bytes() for p in bundle.rglob("*") if p.is_file())
    for output in (written, served.stdout, served.stderr, provider.requests[0].body):
        assert FAKE_KEY.encode() not in output
    assert b"Traceback" not in served.stderr
    assert f"(event loop {loop})".encode() in served.stderr


@pytest.mark.parametrize("kind", ["a regular file", "a FIFO"])
async def test_serve_warns_about_an_unusable_trace_root_and_keeps_serving(
    tmp_path: Path, kind: str
) -> None:
    # Unwritable is a warning (README: it still starts, StartThread tries again), so is a path
    # that is no directory: removing it fixes the next thread.
    traces = tmp_path / "traces"
    if kind == "a FIFO":
        os.mkfifo(traces)
    else:
        traces.write_text("not a directory")
    async with serve("--trace-root", str(traces)) as served:
        channel = grpc.aio.insecure_channel(served.address)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.StartThread(agent_pb2.StartThreadRequest())
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(raised.value) == "RECORDING_START_FAILED"
        try:
            traces.unlink()
            thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
            assert thread.bundle_path.startswith(str(traces))
        finally:
            await channel.close(None)
    assert served.process.returncode == 0
    stderr = served.stderr.decode()
    # Was `trace root is not a directory: PATH`, a FIFO and a file alike.
    assert f"trace root is not a directory: {traces} is {kind}; threads will fail" in stderr
    assert "built-in local model" in stderr
    assert "Traceback" not in stderr


async def test_serve_rejects_bad_flags_without_a_traceback() -> None:
    for args in (
        ["--max-retries", "-1"],
        ["--listen", "nowhere"],
        ["--provider-url", "ftp://x"],
        # Was: a server whose every turn failed.
        ["--stream-idle-timeout", "nan"],
        ["--tool-output-timeout", "inf"],
    ):
        process = await asyncio.create_subprocess_exec(
            AGENT_SERVER,
            "serve",
            *args,
            env=clean_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await process.communicate()
        assert process.returncode == 2, args
        assert stderr.decode().startswith(f"agent-server: {args[0]}")
        assert "Traceback" not in stderr.decode()


@pytest.mark.parametrize("where", ["a-file", "/proc/no-such-dir"])
async def test_demo_with_a_trace_root_it_cannot_record_under_is_one_line_and_exit_2(
    tmp_path: Path, where: str
) -> None:
    # Was: the server's start-up warning, then `agent-server: FAILED_PRECONDITION: failed to
    # start rollout recording: … (RECORDING_START_FAILED)`, exit 1.
    root = Path(where) if where.startswith("/") else tmp_path / where
    if where == "a-file":
        root.write_text("")
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "demo",
        "--trace-root",
        str(root),
        env=clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    said = stderr.decode()
    assert process.returncode == 2, said
    if where == "a-file":
        assert said == f"agent-server: trace root is not a directory: {root} is a regular file\n"
    else:
        # /proc takes no directory: said by the check before the server starts, or (as root,
        # whom the check cannot tell) by the bundle's creation.
        [line] = said.splitlines()
        assert line.startswith("agent-server: "), line
        assert line.endswith(str(root)), line
        assert "FAILED_PRECONDITION" not in line
    assert b"[turn" not in stdout


async def test_demo_runs_and_reduces_its_bundle(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        "demo",
        "--trace-root",
        str(tmp_path),
        "--local-word-delay",
        "0.005",
        env=clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    text = stdout.decode()
    assert "recording complete: true (CLEAN" in text
    # The transcript says INTERRUPTED (the API's word), the summary CANCELLED (state.json's):
    # the summary says whose words it uses before it starts.
    assert "\nthe reduced bundle, in state.json's words (an INTERRUPTED turn is CANCELLED " in text
    assert text.index("the reduced bundle, in") < text.index("recording complete:")
    assert ": COMPLETED" in text
    assert ": CANCELLED" in text
    lines = text.strip().splitlines()
    state_path = Path(lines[-2].removeprefix("state.json: "))
    assert await asyncio.to_thread(state_path.is_file)
    assert state_path.parent.parent == tmp_path
    # It ends with the page of the bundle.
    view_path = Path(lines[-1].removeprefix("view.html: "))
    assert view_path == state_path.parent / "view.html"
    assert "<!DOCTYPE html>" in await asyncio.to_thread(view_path.read_text)
    assert "Traceback" not in stderr.decode()
    # One tool round trip, one call still awaited when its turn was interrupted.
    state = json_format.Parse(
        await asyncio.to_thread(state_path.read_text), state_pb2.RolloutTrace()
    )
    statuses = sorted(
        common_pb2.ExecutionStatus.Name(t.execution.status) for t in state.tool_calls.values()
    )
    assert statuses == ["EXECUTION_STATUS_CANCELLED", "EXECUTION_STATUS_COMPLETED"]
    assert "tool call lookup" in text
    assert "[turn 3: interrupted while awaiting a tool output: INTERRUPTED]" in text
    # A person reads the word, not the raw enum name (docs/vocabulary.md).
    assert "[thread CLOSED]" in text
    assert "THREAD_STATUS_" not in text


# Where the server dies: (what it streams, then what the client has seen when the kill comes).
KILL_POINTS = {
    "before_any_turn": 0,
    "mid_first_item": 1,
    "after_one_item_mid_the_next": 2,
    "between_turns": 3,
}


@pytest.mark.parametrize("kill_point", sorted(KILL_POINTS))
async def test_kill_9_keeps_every_item_a_client_saw_completed(
    provider: ScriptedProvider, tmp_path: Path, kill_point: str
) -> None:
    point = KILL_POINTS[kill_point]
    survivor = message("survives the kill", "msg-survivor")
    if point == 3:
        provider.queue(answer("the first turn's answer", "msg-first"))
    else:
        provider.queue(
            sse(
                created(),
                item_added(survivor),
                text_delta("survives", "msg-survivor"),
                *([] if point == 1 else [text_delta(" the kill", "msg-survivor")]),
                *([] if point == 1 else [item_done(survivor)]),
                *([] if point == 1 else [item_added(message("", "msg-cut"))]),
                *([] if point == 1 else [text_delta("cut short")]),
            ),
            asyncio.Event(),
        )
    traces = tmp_path / "traces"
    async with (
        serve("--provider-url", provider.url, "--trace-root", str(traces)) as served,
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        thread = (await stub.StartThread(agent_pb2.StartThreadRequest())).thread
        events = EventLog(stub.StreamEvents(agent_pb2.StreamEventsRequest(thread_id=thread.id)))
        if point:
            turn = await stub.StartTurn(
                agent_pb2.StartTurnRequest(
                    thread_id=thread.id, input=[agent_pb2.UserInput(text="go")]
                )
            )
            if point == 1:
                await events.wait_for(lambda e: e.agent_message_delta.delta == "survives")
            elif point == 2:
                await events.wait_for(lambda e: e.agent_message_delta.delta == "cut short")
            else:
                await events.turn_completed(turn.turn.id)
        served.process.kill()
        await served.process.wait()
        await events.until_end()
    seen = {e.item_completed.item.id for e in events.of_kind("item_completed")}
    assert len(seen) == (1 if point >= 2 else 0)

    rollout = await reduce_with_cli(Path(thread.bundle_path))
    assert not rollout.recording_complete
    assert rollout.integrity.status in {
        state_pb2.INTEGRITY_STATUS_UNCLOSED,
        state_pb2.INTEGRITY_STATUS_TRUNCATED,
    }
    assert list(rollout.threads) == [thread.id]
    accepted = {
        item.responses_item_id
        for item in rollout.conversation_items.values()
        if item.role == state_pb2.CONVERSATION_ROLE_ASSISTANT
    }
    assert accepted == seen
    if point in {1, 2}:
        # The text a client saw of the unfinished item is in the trace, as discarded output.
        [call] = rollout.inference_calls.values()
        assert call.execution.status == common_pb2.EXECUTION_STATUS_RUNNING
        partial = [d.partial_text for d in call.discarded_outputs]
        assert partial == (["survives"] if point == 1 else ["cut short"])


@pytest.mark.parametrize("stdout", ["full", "gone"])
@pytest.mark.parametrize("command", ["serve", "gateway"])
async def test_a_server_serves_on_when_its_stdout_fails(
    tmp_path: Path, command: str, stdout: str
) -> None:
    # Was: `agent-server serve | true` exited 1 with "[Errno 32] Broken pipe".
    if stdout == "full":
        target = os.open("/dev/full", os.O_WRONLY)
    else:
        reader, target = os.pipe()
        os.close(reader)
    port = free_port()
    argv = [command, "--listen", f"127.0.0.1:{port}", "--trace-root", str(tmp_path / "traces")]
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER, *argv, stdout=target, stderr=asyncio.subprocess.PIPE, env=clean_env()
    )
    os.close(target)
    try:
        if command == "serve":
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(channel.channel_ready(), 30)
        else:
            async with httpx.AsyncClient(timeout=30) as http:
                async with asyncio.timeout(30):
                    while True:
                        try:
                            reply = await http.get(f"http://127.0.0.1:{port}/rollout/v1/sessions")
                            break
                        except httpx.ConnectError:
                            await asyncio.sleep(0.05)
                assert reply.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stderr is not None
        stderr = (await process.stderr.read()).decode()
        assert "Traceback" not in stderr
        assert "Exception ignored" not in stderr
        assert ("cannot write to stdout" in stderr) == (stdout == "full"), stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("command", ["serve", "gateway"])
async def test_a_sigterm_as_soon_as_the_port_opens_shuts_down_gracefully(
    tmp_path: Path, command: str
) -> None:
    # Was: the handlers came after the start (and its collector pass), so a SIGTERM in between
    # killed the process outright, bundles of threads already started left without a footer.
    port = free_port()
    argv = [command, "--listen", f"127.0.0.1:{port}", "--trace-root", str(tmp_path / "traces")]
    process = await asyncio.create_subprocess_exec(
        AGENT_SERVER,
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.001)  # polling the port, not waiting for an outcome
                    continue
                writer.close()
                break
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stderr is not None
        assert "Traceback" not in (await process.stderr.read()).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        ([AGENT_SERVER, "--version"], "grpc_common"),
        ([AGENT_SERVER, "serve", "--listen", "127.0.0.1:0"], "agent_server.config"),
        ([sys.executable, "-m", "agent_server", "health"], "agent_server._health"),
    ],
    ids=["script", "serve", "dash-m"],
)
def test_a_ctrl_c_while_the_command_loads_exits_130_quietly(argv: list[str], module: str) -> None:
    # Was: a traceback through the import the Ctrl-C landed in, and the SIGINT's own status.
    done = interrupt_while_importing(argv, module)
    assert (done.returncode, done.stderr, done.stdout) == (EXIT_INTERRUPTED, "", "")
