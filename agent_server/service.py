"""The AgentService servicer: request validation and translation, nothing else."""

from __future__ import annotations

import grpc
from google.protobuf import message_factory

from agent_server._router import Router, caller_peer
from agent_server.agent import Agent
from agent_server.errors import ERRORS, EmptyInputError, InvalidFlushWindowError
from agent_server.events import DEFAULT_FLUSH_WINDOW_MS, MAX_FLUSH_WINDOW_MS
from agent_server.threads import Thread, recorded_thread
from agent_server.tools import SubmittedOutput
from agent_server.training import capture_from, sampling_from
from rollout.agent.v1 import agent_pb2, agent_pb2_grpc
from trace_reducer import RewardInput

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name

Context = grpc.aio.ServicerContext[object, object]


def _texts(inputs: list[agent_pb2.UserInput]) -> list[str]:
    texts = []
    for position, user_input in enumerate(inputs):
        if user_input.WhichOneof("content") != "text":
            raise EmptyInputError(f"input[{position}] has no content")
        texts.append(user_input.text)
    return texts


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    async def StartThread(  # noqa: N802
        self, request: agent_pb2.StartThreadRequest, context: Context
    ) -> agent_pb2.StartThreadResponse:
        async with ERRORS.translated(context, "StartThread"):
            thread = await self._agent.start_thread(
                request.model,
                request.instructions,
                dict(request.metadata),
                list(request.tools),
                sampling=sampling_from(request),
                capture=capture_from(request),
                provider=request.provider,
            )
            return agent_pb2.StartThreadResponse(thread=thread.to_proto())

    async def StartTurn(  # noqa: N802
        self, request: agent_pb2.StartTurnRequest, context: Context
    ) -> agent_pb2.StartTurnResponse:
        async with ERRORS.translated(context, "StartTurn"):
            await self._agent.branch_before_turn(request.thread_id)
            turn = self._agent.start_turn(
                request.thread_id,
                _texts(list(request.input)),
                sampling_from(request),
                traceparent=_traceparent(context),
            )
            return agent_pb2.StartTurnResponse(turn=turn.to_proto())

    async def Interrupt(  # noqa: N802
        self, request: agent_pb2.InterruptRequest, context: Context
    ) -> agent_pb2.InterruptResponse:
        async with ERRORS.translated(context, "Interrupt"):
            turn = await self._agent.interrupt(
                request.thread_id, request.turn_id, caller_peer(context)
            )
            return agent_pb2.InterruptResponse(turn=turn.to_proto())

    async def StreamEvents(  # type: ignore[override]  # noqa: N802 - writes bytes, see add_to_server
        self, request: agent_pb2.StreamEventsRequest, context: Context
    ) -> None:
        # A coroutine that writes each message itself, as grpc.aio runs a response generator:
        # without a generator layer of its own, each delta costs one resumption fewer.
        async with ERRORS.translated(context, "StreamEvents"):
            window_ms = (
                request.flush_window_ms
                if request.HasField("flush_window_ms")
                else DEFAULT_FLUSH_WINDOW_MS
            )
            if window_ms > MAX_FLUSH_WINDOW_MS:
                raise InvalidFlushWindowError(
                    f"flush_window_ms {window_ms} is above the most allowed, {MAX_FLUSH_WINDOW_MS}"
                )
            events = self._agent.thread(request.thread_id).events
            # Already-serialized StreamEventsResponse messages (see add_to_server).
            write = context.write
            async for message in events.subscribe(request.after_index, window_ms / 1000):
                await write(message)

    async def GetThread(  # noqa: N802
        self, request: agent_pb2.GetThreadRequest, context: Context
    ) -> agent_pb2.GetThreadResponse:
        async with ERRORS.translated(context, "GetThread"):
            return agent_pb2.GetThreadResponse(
                thread=self._agent.thread(request.thread_id).to_proto()
            )

    async def ListThreads(  # noqa: N802
        self, request: agent_pb2.ListThreadsRequest, context: Context
    ) -> agent_pb2.ListThreadsResponse:
        async with ERRORS.translated(context, "ListThreads"):
            threads, next_token = await self._agent.list_threads(
                request.page_size,
                request.page_token,
                request.status,
                request.include_recorded,
            )
            return agent_pb2.ListThreadsResponse(
                threads=[
                    thread.to_proto(with_turns=False)
                    if isinstance(thread, Thread)
                    else recorded_thread(thread)
                    for thread in threads
                ],
                next_page_token=next_token,
            )

    async def SubmitToolOutputs(  # noqa: N802
        self, request: agent_pb2.SubmitToolOutputsRequest, context: Context
    ) -> agent_pb2.SubmitToolOutputsResponse:
        async with ERRORS.translated(context, "SubmitToolOutputs"):
            outputs = [
                SubmittedOutput(output.call_id, output.output, output.is_error)
                for output in request.outputs
            ]
            turn = self._agent.submit_tool_outputs(
                request.thread_id, request.turn_id, outputs, caller_peer(context)
            )
            return agent_pb2.SubmitToolOutputsResponse(turn=turn.to_proto())

    async def CloseThread(  # noqa: N802
        self, request: agent_pb2.CloseThreadRequest, context: Context
    ) -> agent_pb2.CloseThreadResponse:
        async with ERRORS.translated(context, "CloseThread"):
            thread = await self._agent.close_thread(request.thread_id)
            return agent_pb2.CloseThreadResponse(thread=thread.to_proto())

    async def ForkThread(  # noqa: N802
        self, request: agent_pb2.ForkThreadRequest, context: Context
    ) -> agent_pb2.ForkThreadResponse:
        async with ERRORS.translated(context, "ForkThread"):
            threads = await self._agent.fork_thread(
                request.thread_id,
                request.after_turn_id,
                request.count,
                request.group_id,
                request.bundle_path,
            )
            return agent_pb2.ForkThreadResponse(threads=[t.to_proto() for t in threads])

    async def ResumeThread(  # noqa: N802
        self, request: agent_pb2.ResumeThreadRequest, context: Context
    ) -> agent_pb2.ResumeThreadResponse:
        async with ERRORS.translated(context, "ResumeThread"):
            thread = await self._agent.resume_thread(
                request.thread_id, request.bundle_path, request.after_turn_id
            )
            return agent_pb2.ResumeThreadResponse(thread=thread.to_proto())
        raise AssertionError("unreachable")

    async def RecordReward(  # noqa: N802
        self, request: agent_pb2.RecordRewardRequest, context: Context
    ) -> agent_pb2.RecordRewardResponse:
        async with ERRORS.translated(context, "RecordReward"):
            bundle, seq = await self._agent.record_reward(
                RewardInput(
                    thread_id=request.thread_id,
                    turn_id=request.turn_id,
                    item_id=request.item_id,
                    name=request.name,
                    value=request.value,
                    weight=request.weight,
                    source=request.source,
                    metadata=dict(request.metadata),
                    recorded_by=caller_peer(context),
                )
            )
            return agent_pb2.RecordRewardResponse(bundle_path=bundle, seq=seq)


# The methods whose handler yields messages already serialized (bytes, sent as they are).
_PRESERIALIZED = frozenset({"StreamEvents"})


def add_to_server(
    service: AgentService, server: grpc.aio.Server, router: Router | None = None
) -> None:
    """Register the service as the generated code would, except that StreamEvents sends the
    bytes its events were serialized to once (grpc sends a response as it is when the method
    has no serializer); with a router (`serve --workers`), each method routed by it."""
    handlers = {}
    for method in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
        behaviour = getattr(service, method.name)
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        if router is not None:
            behaviour = router.wrap(method.name, behaviour, response_type)
        serializer = None if method.name in _PRESERIALIZED else response_type.SerializeToString
        if method.client_streaming:
            raise TypeError(f"{method.name}: no AgentService method takes a request stream")
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            behaviour,
            request_deserializer=request_type.FromString,
            response_serializer=serializer,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # What the generated registration also does (grpcio >= 1.63; not in the type stubs).
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]


def _traceparent(context: Context) -> str:
    """The caller's W3C `traceparent` metadata, if any (the recorder keeps only a valid one)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent" and isinstance(value, str):
            return value
    return ""
