"""The async client against a real agent server: turns, interrupts, errors, dropped connections."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from agent_server import AgentServer, Settings
from agent_server.local_model import reply_words
from grpc_common import AccessControl
from rollout.agent.v1 import agent_pb2
from rollout_client import (
    AgentClient,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    RolloutError,
    RpcError,
    Turn,
    UnauthenticatedError,
    UnavailableError,
    function_tool,
)
from tests.agent_server.scripted_provider import (
    ScriptedProvider,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from tests.grpc_common import test_server
from tests.rollout_client.tcp_proxy import TcpProxy
from trace_reducer import replay_bundle

# The self-signed certificate fixture the shared plumbing is tested with.
certificate = test_server.certificate


def kinds(events: list[agent_pb2.ThreadEvent]) -> list[str]:
    return [str(event.WhichOneof("kind")) for event in events]


async def test_a_thread_of_two_turns_streams_and_closes(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread(instructions="Be brief.", metadata={"run": "7"})
        assert thread.model == "local-echo-1"
        assert thread.info.metadata == {"run": "7"}
        indexes = []
        for prompt in ("first question", "second question"):
            turn = thread.run_turn(prompt)
            events = [event async for event in turn]
            indexes += [event.index for event in events]
            assert kinds(events)[0] == "turn_started"
            assert kinds(events)[-1] == "turn_completed"
            assert {event.turn_id for event in events} == {turn.id}
            assert turn.status_name == "COMPLETED"
            [done] = [e.item_completed.item for e in events if e.HasField("item_completed")]
            # The deltas add up to the completed item, which is the local model's reply.
            assert turn.text == done.text == "".join(reply_words(prompt))
        # Events are numbered per thread; the second turn's follow the first's.
        assert indexes == list(range(1, len(indexes) + 1))
        assert thread.last_index == indexes[-1]
        listed = await client.list_threads()
        assert [t.id for t in listed] == [thread.id]
        assert listed[0].turn_count == 2
        closed = await thread.close()
        assert closed.status == agent_pb2.THREAD_STATUS_CLOSED
    bundle = Path(closed.bundle_path)
    assert bundle.parent == server.settings.trace_root
    rollout = await asyncio.to_thread(replay_bundle, bundle)
    assert rollout.recording_complete
    assert len(rollout.turns) == 2


async def test_wait_returns_the_ended_turn(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        turn = thread.run_turn("just wait")
        ended = await turn.wait()
        assert ended.status == agent_pb2.TURN_STATUS_COMPLETED
        assert ended.id == turn.id
        with pytest.raises(RolloutError, match="read once"):
            aiter(turn)


async def test_wait_reads_what_a_loop_left(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        turn = thread.run_turn("read half")
        async for event in turn:
            if event.HasField("agent_message_delta"):
                break
        assert turn.result is None
        assert (await turn.wait()).status == agent_pb2.TURN_STATUS_COMPLETED
        assert turn.text == "".join(reply_words("read half"))


async def test_interrupt_mid_stream(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        turn = thread.run_turn("tell me everything")
        interrupted: agent_pb2.Turn | None = None
        seen = []
        async for event in turn:
            seen.append(event)
            if event.HasField("agent_message_delta") and interrupted is None:
                interrupted = await turn.interrupt()
                assert interrupted.status == agent_pb2.TURN_STATUS_INTERRUPTED
                # Was IN_PROGRESS until the rest of the turn's events were read.
                assert turn.status_name == "INTERRUPTED"
        assert kinds(seen)[-1] == "turn_completed"
        assert turn.status_name == "INTERRUPTED"
        assert len(turn.text) < len("".join(reply_words("tell me everything")))
        # Interrupting a turn that has ended answers with the turn as it ended.
        again = await turn.interrupt()
        assert again.status == agent_pb2.TURN_STATUS_INTERRUPTED
        # The thread takes the next turn.
        assert (await thread.run_turn("next").wait()).status == agent_pb2.TURN_STATUS_COMPLETED


async def test_a_turn_interrupted_without_reading_its_events_says_so(
    server: AgentServer,
) -> None:
    # A pipeline that interrupts after its first delta and moves on: status_name said
    # IN_PROGRESS for each of 192 interrupted rollouts.
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        turn = thread.run_turn("tell me everything")
        async for event in turn:
            if event.HasField("agent_message_delta"):
                break
        assert turn.status_name == "IN_PROGRESS"
        stopped = await turn.interrupt()
        assert stopped.status == agent_pb2.TURN_STATUS_INTERRUPTED
        assert turn.status == agent_pb2.TURN_STATUS_INTERRUPTED
        assert turn.result is None
        await thread.close()


async def test_errors_carry_code_reason_and_metadata(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        with pytest.raises(NotFoundError) as not_found:
            await client.thread("thread_nope")
        error = not_found.value
        assert (error.code.name, error.reason, error.domain) == (
            "NOT_FOUND",
            "THREAD_NOT_FOUND",
            "rollout-trace",
        )
        assert error.metadata == {"thread_id": "thread_nope"}
        assert "no thread 'thread_nope'" in error.message

        thread = await client.start_thread()
        with pytest.raises(InvalidArgumentError) as empty:
            await thread.run_turn("").start()
        assert empty.value.reason == "EMPTY_INPUT"

        running = thread.run_turn("a long one")
        await running.start()
        with pytest.raises(FailedPreconditionError) as busy:
            await thread.run_turn("too soon").start()
        assert busy.value.reason == "TURN_ALREADY_RUNNING"
        assert busy.value.metadata == {"turn_id": running.id}
        await running.interrupt()
        await running.wait()

        with pytest.raises(InvalidArgumentError) as model:
            await client.start_thread(model="x" * 300)
        assert model.value.reason == "INVALID_MODEL"
        # One hierarchy: every one of them is an RpcError and a RolloutError.
        assert isinstance(model.value, RpcError)


async def test_a_thread_started_elsewhere_is_joined_with_its_history_trimmed(
    provider: ScriptedProvider, tmp_path: Path
) -> None:
    # The first turn's 40-odd events overflow a buffer of 20 before a second client joins;
    # the second turn holds still after its first delta, so its own events all fit.
    items = [message(f"item {n}", f"msg-{n}") for n in range(12)]
    burst = asyncio.Event()
    provider.queue(
        sse(created()),
        burst,
        sse(
            *(event for item in items for event in (item_added(item), item_done(item))),
            completed(),
        ),
    )
    reply = message("joined reply", "msg-joined")
    gate = asyncio.Event()
    provider.queue(
        sse(created("resp-2"), item_added(reply), text_delta("joined", "msg-joined")),
        gate,
        sse(text_delta(" reply", "msg-joined"), item_done(reply), completed("resp-2")),
    )
    server = await AgentServer.start(
        Settings(listen="127.0.0.1:0", provider_url=provider.url, model="m", event_buffer=20)
    )
    try:
        async with AgentClient(server.address) as first, AgentClient(server.address) as second:
            started = await first.start_thread()
            filling = started.run_turn("fill the buffer")
            async for _ in filling:
                burst.set()
            assert filling.status_name == "COMPLETED"
            assert started.last_index > 20
            joined = await second.thread(started.id)
            assert joined.last_index == 0
            with pytest.raises(OutOfRangeError) as gone:
                async for _ in joined.events(0):
                    pass
            assert gone.value.reason == "EVENT_INDEX_OUT_OF_RANGE"
            turn = joined.run_turn("from the second client")
            events = []
            async for event in turn:
                events.append(event)
                if event.HasField("agent_message_delta"):
                    gate.set()
            assert kinds(events)[0] == "turn_started"
            assert turn.status_name == "COMPLETED"
            assert turn.text == "joined reply"
    finally:
        burst.set()
        gate.set()
        await server.stop()


async def test_a_turn_whose_first_events_are_gone_says_so(
    provider: ScriptedProvider, tmp_path: Path
) -> None:
    items = [message(f"item {n}", f"msg-{n}") for n in range(12)]
    provider.queue(
        sse(
            created(),
            *(event for item in items for event in (item_added(item), item_done(item))),
            completed(),
        )
    )
    server = await AgentServer.start(
        Settings(listen="127.0.0.1:0", provider_url=provider.url, model="m", event_buffer=20)
    )
    try:
        async with AgentClient(server.address) as client:
            thread = await client.start_thread()
            turn = thread.run_turn("burst")
            await turn.start()
            # The whole turn happens before its events are read: its first ones are dropped.
            await _until_turn_ended(client, thread.id, turn.id)
            with pytest.raises(OutOfRangeError, match="first events of turn"):
                await turn.wait()
    finally:
        await server.stop()


async def test_a_dropped_connection_resumes_after_the_last_event(
    provider: ScriptedProvider, scripted_server: AgentServer
) -> None:
    reply = message("before the cut, after the cut", "msg-1")
    gate = asyncio.Event()
    provider.queue(
        sse(created(), item_added(reply), text_delta("before the cut,", "msg-1")),
        gate,
        sse(text_delta(" after the cut", "msg-1"), item_done(reply), completed()),
    )
    proxy = await TcpProxy("127.0.0.1", scripted_server.port).start()
    try:
        async with (
            AgentClient(proxy.address, reconnect_timeout=60) as client,
            AgentClient(scripted_server.address) as direct,
        ):
            thread = await client.start_thread()
            turn = thread.run_turn("go")
            events = []
            async for event in turn:
                events.append(event)
                if event.agent_message_delta.delta == "before the cut,":
                    # The connection dies; the rest of the turn happens while it is down.
                    proxy.cut()
                    gate.set()
                    await _until_turn_ended(direct, thread.id, turn.id)
                    proxy.resume()
        assert proxy.connections >= 2, "the client never reconnected"
        indexes = [event.index for event in events]
        assert indexes == list(range(1, len(events) + 1)), "an event was missed or repeated"
        assert turn.text == "before the cut, after the cut"
        assert kinds(events)[-2:] == ["item_completed", "turn_completed"]
        assert turn.status_name == "COMPLETED"
    finally:
        await proxy.stop()


async def _until_turn_ended(client: AgentClient, thread_id: str, turn_id: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = (await client.thread(thread_id)).info
        if any(
            t.id == turn_id and t.status != agent_pb2.TURN_STATUS_IN_PROGRESS for t in info.turns
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the turn did not end")


async def test_a_connection_that_stays_down_fails_after_the_reconnect_timeout(
    provider: ScriptedProvider, scripted_server: AgentServer
) -> None:
    gate = asyncio.Event()
    provider.queue(
        sse(created(), item_added(message("x", "msg-1")), text_delta("x", "msg-1")), gate
    )
    proxy = await TcpProxy("127.0.0.1", scripted_server.port).start()
    try:
        async with AgentClient(proxy.address, reconnect_timeout=0.5) as client:
            thread = await client.start_thread()
            turn = thread.run_turn("go")
            with pytest.raises(UnavailableError) as raised:
                await _read_cutting_at_first_delta(turn, proxy)
            assert raised.value.reason == ""
    finally:
        gate.set()
        await proxy.stop()


async def _read_cutting_at_first_delta(turn: Turn, proxy: TcpProxy) -> None:
    async for event in turn:
        if event.HasField("agent_message_delta"):
            proxy.cut()


async def test_a_server_shutting_down_is_unavailable_not_retried(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread()
        await thread.run_turn("one").wait()
        await server.agent.shutdown()
        with pytest.raises(UnavailableError) as raised:
            await client.start_thread()
        assert raised.value.reason == "SHUTTING_DOWN"


async def test_token_and_tls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    access = AccessControl.load(
        token_env="T", tls_cert=cert, tls_key=key, environ={"T": "client-token"}
    )
    server = await AgentServer.start(
        Settings(listen="127.0.0.1:0", local_word_delay=0.0, access=access)
    )
    try:
        async with AgentClient(server.address, tls=cert) as anonymous:
            with pytest.raises(UnauthenticatedError) as raised:
                await anonymous.start_thread()
            assert raised.value.reason == "MISSING_TOKEN"
        async with AgentClient(server.address, tls=str(cert), token="client-token") as client:
            thread = await client.start_thread()
            assert (await thread.run_turn("secure").wait()).status == (
                agent_pb2.TURN_STATUS_COMPLETED
            )
        with pytest.raises(RolloutError, match="cannot read the CA certificates"):
            AgentClient(server.address, tls=cert.parent / "missing.pem")
    finally:
        await server.stop()


WEATHER = function_tool(
    "weather",
    "Today's weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}},
)
CLOCK = function_tool("clock", "The time.")


async def test_tool_handlers_answer_the_calls(server: AgentServer) -> None:
    asked: list[dict[str, object]] = []

    async def weather(arguments: dict[str, object]) -> dict[str, object]:
        asked.append(arguments)
        return {"sky": "sunny", "celsius": 21}

    def clock(arguments: dict[str, object]) -> str:
        raise RuntimeError("the clock is broken")

    async with AgentClient(server.address) as client:
        thread = await client.start_thread(tools=[WEATHER, CLOCK])
        assert [tool.name for tool in thread.info.tools] == ["weather", "clock"]
        turn = thread.run_turn(
            "What do weather and clock say about Paris?",
            tools={"weather": weather, "clock": clock},
        )
        events = [event async for event in turn]
    assert turn.status_name == "COMPLETED"
    requested = [e.tool_call_requested for e in events if e.HasField("tool_call_requested")]
    assert sorted(call.name for call in requested) == ["clock", "weather"]
    completed = {
        e.tool_call_completed.call_id: e.tool_call_completed
        for e in events
        if e.HasField("tool_call_completed")
    }
    by_name = {call.name: completed[call.call_id] for call in requested}
    assert json.loads(by_name["weather"].output) == {"sky": "sunny", "celsius": 21}
    assert not by_name["weather"].is_error
    assert by_name["clock"].is_error
    assert by_name["clock"].output == "RuntimeError: the clock is broken"
    # The local model puts its user's message in the tool's first string parameter.
    assert asked == [{"city": "What do weather and clock say about Paris?"}]
    assert '{"sky": "sunny", "celsius": 21}' in turn.text


async def test_a_tool_without_a_handler_gets_an_error_output(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread(tools=[WEATHER])
        turn = thread.run_turn("Ask weather.", tools={})
        events = [event async for event in turn]
    [done] = [e.tool_call_completed for e in events if e.HasField("tool_call_completed")]
    assert done.is_error
    assert done.output == "this client has no handler for the tool 'weather'"
    assert turn.status_name == "COMPLETED"


async def test_tool_calls_answered_by_hand(server: AgentServer) -> None:
    async with AgentClient(server.address) as client:
        thread = await client.start_thread(tools=[WEATHER])
        turn = thread.run_turn("Ask weather about Rome.")
        completed = []
        async for event in turn:
            if event.HasField("tool_call_completed"):
                completed.append(event.tool_call_completed)
            if event.HasField("tool_call_requested"):
                call = event.tool_call_requested
                assert json.loads(call.arguments) == {"city": "Ask weather about Rome."}
                answered = await turn.submit_tool_output(call.call_id, "rainy")
                assert answered.id == turn.id
        assert [(c.output, c.is_error) for c in completed] == [("rainy", False)]
        assert turn.status_name == "COMPLETED"
        assert '"rainy"' in turn.text
        with pytest.raises(FailedPreconditionError) as late:
            await turn.submit_tool_output("call_nope", "too late")
        assert late.value.reason == "TURN_NOT_AWAITING_TOOL_OUTPUTS"


async def test_a_url_for_the_address_says_the_host_and_port_to_give(server: AgentServer) -> None:
    # Was: `UNAVAILABLE: errors resolving http://127.0.0.1:50051: [...] Misformatted domain
    # name` at the first call, gRPC taking the URL (the gateway's kind of address) for a name.
    from rollout_client import ReducerClient, SyncAgentClient

    address = f"127.0.0.1:{server.port}"
    for kind in (AgentClient, ReducerClient, SyncAgentClient):
        with pytest.raises(ValueError, match=r"^the address is") as refused:
            kind(f"http://{address}/v1")
        assert str(refused.value) == (
            f"the address is the server's HOST:PORT, not a URL: give '{address}'"
        )
    with pytest.raises(ValueError, match=r"^the address is") as refused:
        AgentClient(f"https://user:S3CRET@{address}/v1?key=S3CRETQ")
    assert str(refused.value) == (
        f"the address is the server's HOST:PORT, not a URL: give '{address}' and tls=True"
    )
    # The address it names is the one that works; gRPC's own schemes pass as they are.
    for working in (address, f"dns:///{address}", f"ipv4:{address}"):
        async with AgentClient(working) as client:
            thread = await client.start_thread()
            await thread.close()


async def test_a_recorded_thread_is_listed_and_resumed_from_disk(
    server: AgentServer, tmp_path: Path
) -> None:
    # Was: neither in the client (README: "the client covers the whole API"), so continuing a
    # run from disk meant the raw stub: `client.call(client.stub.ResumeThread, ...)`.
    from rollout_client import SyncAgentClient

    async with AgentClient(f"127.0.0.1:{server.port}") as client:
        thread = await client.start_thread(instructions="Be brief.")
        turn = thread.run_turn("first question")
        await turn.wait()
        await thread.close()
    # A second server on the same trace root holds none of it: the thread is only on disk.
    later = await AgentServer.start(
        Settings(listen="127.0.0.1:0", trace_root=tmp_path / "traces", local_word_delay=0.001)
    )
    try:
        async with AgentClient(f"127.0.0.1:{later.port}") as client:
            assert await client.list_threads() == []
            [listed] = await client.list_threads(include_recorded=True)
            assert (listed.id, listed.recorded) == (thread.id, True)
            resumed = await client.resume_thread(thread.id, after_turn_id=turn.id)
            assert resumed.id != thread.id
            assert resumed.info.fork.resumed
            again = resumed.run_turn("second question")
            await again.wait()
            assert again.status_name == "COMPLETED"
            await resumed.close()

        def blocking_client() -> None:  # off the loop the server answers on
            with SyncAgentClient(f"127.0.0.1:{later.port}") as blocking:
                ids = {t.id for t in blocking.list_threads(include_recorded=True)}
                assert ids == {thread.id, resumed.id}
                by_path = blocking.resume_thread(bundle_path=thread.bundle_path)
                assert by_path.info.fork.resumed
                by_path.close()

        await asyncio.to_thread(blocking_client)
    finally:
        await later.stop()
    trace = replay_bundle(resumed.bundle_path)
    assert len(trace.fork.ancestors) == 1
