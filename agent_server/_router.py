"""The routing of `serve --workers N`: every call for a thread answered by the worker owning it."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from agent_server.agent import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, Agent, check_status_filter
from agent_server.config import WorkerRole
from agent_server.errors import ERRORS, InvalidPageTokenError
from agent_server.threads import recorded_thread
from grpc_common import DEFAULT_MAX_RECEIVE_BYTES, abort
from rollout.agent.v1 import agent_pb2
from trace_reducer import list_recorded

__all__ = ["FORWARDED_KEY", "Router", "caller_peer", "is_forwarded"]

log = logging.getLogger(__name__)

_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name

# Marks a call one worker sent another: it is answered where it arrives, never forwarded again
# (no loops). It only suppresses forwarding, and only on the private Unix socket: the caller's
# token travels with the call and the owner checks it like any other.
FORWARDED_KEY = "x-rollout-forwarded"
# The caller as the first worker saw it, so the owner records who interrupted or rewarded.
FORWARDED_PEER_KEY = "x-rollout-forwarded-peer"
# What a call carries from its caller besides its own metadata: gRPC sets these itself.
_NOT_CARRIED = frozenset({FORWARDED_KEY, FORWARDED_PEER_KEY, "user-agent"})
# Threads whose owner this worker remembers; the oldest are forgotten first.
_OWNERS_KEPT = 100_000
# How long asking the other workers who owns a thread may take, when the caller set no deadline.
_LOOKUP_SECONDS = 10.0
# Calls carried to the owner even when their caller is gone before it has them: one process
# applies an Interrupt or a CloseThread the moment it arrives, and a client sends them on its
# way out (Ctrl-C, a short deadline, a cancel right after). Bounded by this, not the caller's
# deadline.
_CARRIED = frozenset({"Interrupt", "CloseThread"})
_CARRIED_SECONDS = 30.0
# At most this many carried calls held at once after their callers left: each holds its request
# and its caller's metadata (~9 KB) for up to the lookup's and the call's bounds (40 s) whatever
# the caller's deadline was, so a client sending thousands while an owner is not answering
# grew a worker by 180 MB every 20,000. Past it a leaving caller's call goes with it, as every
# other call does.
_CARRIED_HELD = 1_000
# Responses between workers are only as large as what the client gets; the client's own limit
# applies to them where they end.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", DEFAULT_MAX_RECEIVE_BYTES),
]

Context = grpc.aio.ServicerContext[Any, Any]
Behaviour = Callable[[Any, Context], Awaitable[Any]]
_Metadata = list[tuple[str, str | bytes]]

# How a call finds its worker: the owner of its thread (else the one it arrived at), or the
# owner else the worker a stable hash of the thread names (so that two workers never continue
# the same recorded thread at once, and rewards of a forgotten thread have one writer).
_OWNER = "owner"
_OWNER_OR_HASH = "owner-or-hash"
_ROUTES = {
    "StartTurn": _OWNER,
    "Interrupt": _OWNER,
    "StreamEvents": _OWNER,
    "GetThread": _OWNER,
    "CloseThread": _OWNER,
    "SubmitToolOutputs": _OWNER,
    "RecordReward": _OWNER_OR_HASH,
    "ForkThread": _OWNER_OR_HASH,
    "ResumeThread": _OWNER_OR_HASH,
}


def is_forwarded(context: Context) -> bool:
    """Whether another worker sent this call (over the private socket)."""
    if not context.peer().startswith("unix:"):
        return False
    return any(key == FORWARDED_KEY for key, _ in context.invocation_metadata() or ())


def caller_peer(context: Context) -> str:
    """The client of the call: for a forwarded call the one the first worker served."""
    if is_forwarded(context):
        for key, value in context.invocation_metadata() or ():
            if key == FORWARDED_PEER_KEY and isinstance(value, str):
                return value
    return context.peer()


def _pairs(metadata: Any) -> list[tuple[str, str | bytes]]:
    # grpc.aio.Metadata iterates as (key, value) pairs (its stubs call it a Mapping).
    return [(str(key), value) for key, value in metadata or ()]


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class Router:
    """Wraps the AgentService behaviours of one worker (add_to_server) so that a call for a
    thread another worker owns is answered by that worker, over its Unix socket."""

    def __init__(
        self, agent: Agent, role: WorkerRole, workers: int, trace_root: Path | None
    ) -> None:
        self._agent = agent
        self._index = role.index
        self._workers = workers
        self._trace_root = trace_root
        self._paths = {index: role.socket_path(index) for index in range(workers)}
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._owners: OrderedDict[str, int] = OrderedDict()
        # Carried calls whose caller left: held here until the owner has answered them.
        self._carried: set[asyncio.Future[Any]] = set()
        # Whether a call was dropped since the calls held reached _CARRIED_HELD (warned once).
        self._over_held = False
        # Calls this worker sent on to another, for the log and the tests.
        self.forwarded = 0

    @property
    def private_address(self) -> str:
        return f"unix:{self._paths[self._index]}"

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()

    def wrap(self, name: str, behaviour: Behaviour, response_type: type[Message]) -> Behaviour:
        """The method's behaviour, routed; StartThread stays where it lands (it owns the new
        thread there)."""
        if name == "ListThreads":
            return self._listing(behaviour)
        route = _ROUTES.get(name)
        if route is None:
            return behaviour
        if name == "StreamEvents":

            async def streamed(request: Any, context: Context) -> None:
                target = await self._target(name, route, request, context)
                if target is None:
                    await behaviour(request, context)
                else:
                    await self._relay_stream(target, name, request, context)

            return streamed

        async def unary(request: Any, context: Context) -> Any:
            target = await self._target(name, route, request, context)
            if target is None:
                return await behaviour(request, context)
            return await self._relay(target, name, request, response_type, context)

        if name not in _CARRIED:
            return unary

        async def carried_to_owner(request: Any, context: Context) -> Any:
            thread_id: str = request.thread_id
            if self._answered_here(thread_id, context):
                return await behaviour(request, context)
            # All the relay needs of its caller, read while the caller is there: a context is
            # not to be touched once its call has ended.
            metadata = self._metadata(context)
            carried = asyncio.ensure_future(
                self._carry(name, thread_id, request, response_type, metadata)
            )
            try:
                target, answer = await asyncio.shield(carried)
            except asyncio.CancelledError:
                if carried.done():
                    raise
                if len(self._carried) >= _CARRIED_HELD:
                    carried.cancel()
                    self._not_carried(name, thread_id)
                    raise
                # The caller left (a cancel, its deadline): the call still reaches the owner,
                # as it would have here, and its answer goes nowhere.
                self._carried.add(carried)
                carried.add_done_callback(self._delivered(name, thread_id))
                raise
            if target is None:
                # No worker holds the thread: refused here, as anywhere.
                return await behaviour(request, context)
            if isinstance(answer, grpc.aio.AioRpcError):
                await self._refuse(context, target, thread_id, answer)
            return answer

        return carried_to_owner

    async def _carry(
        self,
        name: str,
        thread_id: str,
        request: Any,
        response_type: type[Message],
        metadata: _Metadata,
    ) -> tuple[int | None, Any]:
        """A carried call sent to its thread's owner: (the owner, its answer or its refusal),
        (None, None) when no worker holds the thread."""
        target = await self._owner(thread_id, metadata, _LOOKUP_SECONDS)
        if target is None:
            return None, None
        call = self._unary_call(target, name, request, response_type, metadata, _CARRIED_SECONDS)
        try:
            return target, await call
        except grpc.aio.AioRpcError as error:
            return target, error

    def _not_carried(self, name: str, thread_id: str) -> None:
        """A call whose caller left, dropped with it: _CARRIED_HELD are held already. Said as a
        warning once until the calls held go back under the bound, each one at debug."""
        fields = {"rpc": name, "thread_id": thread_id, "held": len(self._carried)}
        if not self._over_held:
            self._over_held = True
            log.warning(
                "calls whose callers left are not carried to their owning worker while "
                f"{_CARRIED_HELD:,} are (an owner is not answering)",
                extra={"fields": fields},
            )
        log.debug("a call whose caller left was not carried", extra={"fields": fields})

    def _delivered(self, name: str, thread_id: str) -> Callable[[asyncio.Future[Any]], None]:
        def done(carried: asyncio.Future[Any]) -> None:
            self._carried.discard(carried)
            if len(self._carried) < _CARRIED_HELD:
                self._over_held = False
            if carried.cancelled():
                outcome = "cancelled"
            elif (error := carried.exception()) is not None:
                outcome = repr(error)
            else:
                target, answer = carried.result()
                outcome = (
                    "no worker holds the thread"
                    if target is None
                    else answer.code().name
                    if isinstance(answer, grpc.aio.AioRpcError)
                    else "OK"
                )
            # The caller is gone: the log is where a refusal (the turn had ended) is said.
            log.debug(
                "a call carried to its owner after its caller left has ended",
                extra={"fields": {"rpc": name, "thread_id": thread_id, "outcome": outcome}},
            )

        return done

    def _answered_here(self, thread_id: str, context: Context) -> bool:
        """A call this worker answers itself: it is stopping (its threads are draining), the
        call was forwarded to it, or it holds the thread (or none is named: refused here as it
        would be anywhere)."""
        return (
            self._agent.stopping
            or is_forwarded(context)
            or not thread_id
            or self._agent.holds(thread_id)
        )

    async def _target(self, name: str, route: str, request: Any, context: Context) -> int | None:
        """The worker to send the call to; None: answer it here."""
        thread_id: str = request.thread_id
        bundle_path: str = getattr(request, "bundle_path", "")
        if (
            route == _OWNER_OR_HASH
            and bundle_path
            and name != "RecordReward"
            and not self._agent.stopping
            and not is_forwarded(context)
        ):
            # Continued from the bundle whatever holds the thread (Agent's rule).
            return self._hashed(thread_id or bundle_path)
        if self._answered_here(thread_id, context):
            return None
        remaining = context.time_remaining()
        timeout = _LOOKUP_SECONDS if remaining is None else min(remaining, _LOOKUP_SECONDS)
        owner = await self._owner(thread_id, self._metadata(context), timeout)
        if owner is not None or route == _OWNER:
            return owner
        return self._hashed(thread_id)

    def _hashed(self, key: str) -> int | None:
        index = zlib.crc32(key.encode()) % self._workers
        return None if index == self._index else index

    async def _owner(self, thread_id: str, metadata: _Metadata, seconds: float) -> int | None:
        owner = self._owners.get(thread_id)
        if owner is not None:
            self._owners.move_to_end(thread_id)
            return owner
        owner = await self._ask_others(thread_id, metadata, seconds)
        if owner is not None:
            self._owners[thread_id] = owner
            if len(self._owners) > _OWNERS_KEPT:
                self._owners.popitem(last=False)
        return owner

    async def _ask_others(self, thread_id: str, metadata: _Metadata, seconds: float) -> int | None:
        """Which other worker holds the thread: a forwarded GetThread to each at once."""
        others = [index for index in range(self._workers) if index != self._index]
        request = agent_pb2.GetThreadRequest(thread_id=thread_id)

        async def holds(index: int) -> bool:
            call = self._channel(index).unary_unary(
                f"/{_SERVICE}/GetThread",
                request_serializer=_serialize,
                response_deserializer=None,
            )
            try:
                await call(request, metadata=metadata, timeout=seconds)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    log.debug(
                        "a worker did not answer who owns a thread",
                        extra={"fields": {"thread_id": thread_id, "asked": index}},
                    )
                return False
            return True

        answers = await asyncio.gather(*(holds(index) for index in others))
        return next((index for index, yes in zip(others, answers, strict=True) if yes), None)

    def _channel(self, index: int) -> grpc.aio.Channel:
        # Made on first use: the other workers may still be starting when this one is.
        channel = self._channels.get(index)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                f"unix:{self._paths[index]}", options=_CHANNEL_OPTIONS
            )
            self._channels[index] = channel
        return channel

    def _metadata(self, context: Context) -> _Metadata:
        """The caller's metadata (token, traceparent, …), marked as forwarded."""
        carried: list[tuple[str, str | bytes]] = [
            (key, value)
            for key, value in context.invocation_metadata() or ()
            if key not in _NOT_CARRIED and not key.startswith((":", "grpc-"))
        ]
        carried.append((FORWARDED_KEY, str(self._index)))
        carried.append((FORWARDED_PEER_KEY, context.peer()))
        return carried

    def _counted(self, name: str, target: int, request: Any) -> None:
        self.forwarded += 1
        log.debug(
            "forwarded to the owning worker",
            extra={"fields": {"rpc": name, "to": target, "thread_id": request.thread_id}},
        )

    def _unary_call(
        self,
        target: int,
        name: str,
        request: Any,
        response_type: type[Message],
        metadata: _Metadata,
        seconds: float | None,
    ) -> Any:
        """The call forwarding a unary request to worker target (counted and logged)."""
        self._counted(name, target, request)
        return self._channel(target).unary_unary(
            f"/{_SERVICE}/{name}",
            request_serializer=_serialize,
            response_deserializer=response_type.FromString,
        )(request, metadata=metadata, timeout=seconds)

    async def _relay(
        self,
        target: int,
        name: str,
        request: Any,
        response_type: type[Message],
        context: Context,
    ) -> Any:
        call = self._unary_call(
            target, name, request, response_type, self._metadata(context), context.time_remaining()
        )
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            await self._refuse(context, target, request.thread_id, error)
        finally:
            # A client's cancel reaches here as CancelledError: it cancels the owner's call too.
            call.cancel()

    async def _relay_stream(self, target: int, name: str, request: Any, context: Context) -> None:
        self._counted(name, target, request)
        # No deserializer: each message goes to the client as the bytes the owner sent.
        call = self._channel(target).unary_stream(
            f"/{_SERVICE}/{name}", request_serializer=_serialize, response_deserializer=None
        )(request, metadata=self._metadata(context), timeout=context.time_remaining())
        write = context.write
        try:
            async for message in call:
                await write(message)
        except grpc.aio.AioRpcError as error:
            await self._refuse(context, target, request.thread_id, error)
        finally:
            call.cancel()

    async def _refuse(
        self, context: Context, target: int, thread_id: str, error: grpc.aio.AioRpcError
    ) -> NoReturn:
        """End the call as the owner ended it: code, message and trailing metadata (the
        ErrorInfo) unchanged; a worker that cannot be reached is UNAVAILABLE."""
        code = error.code()
        if code == grpc.StatusCode.NOT_FOUND:
            # Forgotten by its owner (closed past its retention): ask again next time.
            self._owners.pop(thread_id, None)
        trailing = tuple(_pairs(error.trailing_metadata()))
        if code == grpc.StatusCode.UNAVAILABLE and not any(
            key == "grpc-status-details-bin" for key, _ in trailing
        ):
            log.warning(
                "a worker cannot be reached",
                extra={"fields": {"to": target, "error": error.details() or ""}},
            )
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "WORKER_UNAVAILABLE",
                f"worker {target}, which holds thread {thread_id!r}, cannot be reached",
            )
        await context.abort(code, error.details() or "", trailing)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def _listing(self, behaviour: Behaviour) -> Behaviour:
        async def list_threads(request: Any, context: Context) -> Any:
            if self._agent.stopping or is_forwarded(context):
                # Another worker gathering every worker's threads: this one's own.
                return await behaviour(request, context)
            async with ERRORS.translated(context, "ListThreads"):
                return await self._list_everywhere(request, context)
            raise AssertionError("unreachable")

        return list_threads

    async def _list_everywhere(
        self, request: agent_pb2.ListThreadsRequest, context: Context
    ) -> agent_pb2.ListThreadsResponse:
        """One page of every worker's threads, oldest first, then (include_recorded) those
        only under the trace root: the rules of Agent.list_threads over the merged list."""
        check_status_filter(request.status)
        after, after_bundle = _decode_page_token(request.page_token)
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        threads = [thread.to_proto(with_turns=False) for thread in self._agent.held_threads()]
        others = [index for index in range(self._workers) if index != self._index]
        try:
            for theirs in await asyncio.gather(*(self._threads_of(i, context) for i in others)):
                threads.extend(theirs)
        except _PeerError as failed:
            await self._refuse(context, failed.index, "", failed.error)
        threads.sort(key=_order)
        page: list[tuple[agent_pb2.Thread, str]] = []
        if after_bundle is None:
            for thread in threads:
                if _order(thread) <= after:
                    continue
                if request.status and thread.status != request.status:
                    continue
                if len(page) == size:
                    return _page(page, more=True)
                page.append((thread, _memory_token(thread)))
        root = self._trace_root
        if (
            not request.include_recorded
            or root is None
            or request.status == agent_pb2.THREAD_STATUS_ACTIVE
        ):
            return _page(page, more=False)
        # One more than fits tells whether a next page exists; a thread any worker holds is
        # listed as held, never again from its bundle.
        wanted = size - len(page) + 1
        held = frozenset(thread.id for thread in threads)
        recorded = await asyncio.to_thread(
            lambda: list(
                itertools.islice(list_recorded(root, after=after_bundle or "", skip=held), wanted)
            )
        )
        page.extend(
            (recorded_thread(summary), f"bundle:{summary.bundle_name}")
            for summary in recorded[: wanted - 1]
        )
        return _page(page, more=len(recorded) == wanted)

    async def _threads_of(self, index: int, context: Context) -> list[agent_pb2.Thread]:
        """Every thread worker `index` holds, page by page."""
        call = self._channel(index).unary_unary(
            f"/{_SERVICE}/ListThreads",
            request_serializer=_serialize,
            response_deserializer=agent_pb2.ListThreadsResponse.FromString,
        )
        metadata = self._metadata(context)
        threads: list[agent_pb2.Thread] = []
        token = ""
        while True:
            request = agent_pb2.ListThreadsRequest(page_size=MAX_PAGE_SIZE, page_token=token)
            try:
                reply = await call(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as error:
                raise _PeerError(index, error) from error
            threads.extend(reply.threads)
            token = reply.next_page_token
            if not token:
                return threads


class _PeerError(Exception):
    def __init__(self, index: int, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details())
        self.index = index
        self.error = error


def _order(thread: agent_pb2.Thread) -> tuple[int, str]:
    # Creation time across processes (each worker's own sequence means nothing to another).
    return thread.created_at.ToNanoseconds(), thread.id


def _memory_token(thread: agent_pb2.Thread) -> str:
    created, thread_id = _order(thread)
    return f"at:{created}:{thread_id}"


def _page(page: list[tuple[agent_pb2.Thread, str]], *, more: bool) -> agent_pb2.ListThreadsResponse:
    token = ""
    if more and page:
        token = base64.urlsafe_b64encode(page[-1][1].encode()).decode().rstrip("=")
    return agent_pb2.ListThreadsResponse(
        threads=[thread for thread, _ in page], next_page_token=token
    )


def _decode_page_token(token: str) -> tuple[tuple[int, str], str | None]:
    """(the last held thread's place, or the last recorded bundle's name), as _page made."""
    if not token:
        return (-1, ""), None
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        prefix, _, value = text.partition(":")
        if prefix == "at":
            created, _, thread_id = value.partition(":")
            if created.isdigit() and thread_id:
                return (int(created), thread_id), None
        if prefix == "bundle" and value:
            return (-1, ""), value
    except (ValueError, UnicodeDecodeError):
        pass
    raise InvalidPageTokenError("page_token is not one this server handed out")
