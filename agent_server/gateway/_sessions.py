"""Sessions: one bundle each, found by key, hint or continuation; turns; idle close."""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_server import telemetry
from agent_server.events import EventBuffer
from agent_server.recorder import Recorder
from agent_server.threads import Thread, Turn
from agent_server.tools import TRACE_STATUS, ToolCall
from grpc_common import outlive_caller
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import RecordingError

log = logging.getLogger(__name__)

# The gateway's threads never have a subscriber: a few events kept is enough.
_EVENT_CAPACITY = 16
# Closed sessions remembered for rewards by session key.
_CLOSED_KEPT = 4096
# How long a close waits for the calls it cut off to record their ends (each has only to
# write one record; its client's last bytes are not waited for).
_CUT_GRACE = 2.0
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED

# Where a session's key came from (thread metadata `gateway.session_source`).
SOURCE_HEADER = "header"
SOURCE_PATH = "path"
SOURCE_CONTINUATION = "continuation"
SOURCE_NEW = "new"
# A session key goes back to the client in the x-rollout-session header and into log lines:
# printable ASCII without spaces, and short.
MAX_SESSION_KEY_CHARS = 256


def session_key_problem(key: str) -> str:
    """Why a key a client named cannot be a session key ('' when it can)."""
    if len(key) > MAX_SESSION_KEY_CHARS:
        return f"a session key is at most {MAX_SESSION_KEY_CHARS} characters"
    if not all("!" <= char <= "~" for char in key):
        return "a session key is printable ASCII without spaces"
    return ""


def hint_key(name: str, value: str) -> SessionKey:
    """The session a hint names: `NAME:VALUE`, or `NAME#digest` when the value could not be
    a session key (the same value always gives the same session)."""
    key = f"{name}:{value}"
    if session_key_problem(key):
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        key = f"{name}#{digest}"
    return SessionKey(key, f"hint:{name}")


@dataclass(frozen=True)
class SessionKey:
    """Which session a request names, and how it named it (source 'hint:NAME' for hints)."""

    key: str
    source: str


@dataclass(frozen=True)
class ClosedSession:
    """What a closed session leaves behind: where its bundle is."""

    key: str
    thread_id: str
    bundle_path: str
    trace_id: str


@dataclass
class _OpenTurn:
    """A turn not ended yet: its calls running, how its last call that ended did, and whether
    it ends once they are done (a later turn has begun)."""

    turn: Turn
    running: int = 0
    last_call_status: common_pb2.ExecutionStatus.ValueType = COMPLETED
    ending: bool = False


@dataclass
class RunningCall:
    """A call being answered, as a close of its session cuts it off: the task answering it
    (cancelled, its upstream request closed with it) and whether its end is recorded."""

    task: asyncio.Task[Any]
    ended: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # Set by the close before it cancels the task: the handler tells that cancellation from
    # its client going away or the gateway stopping, and answers its client itself.
    cut: bool = False

    def end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


@dataclass
class Session:
    """One session: a thread with one bundle; its current turn; its last exchange."""

    key: str
    thread: Thread
    last_used: float = field(default_factory=time.monotonic)
    turn: Turn | None = None
    turn_count: int = 0
    # Fingerprints of the last call's input followed by its accepted output: what a request
    # continuing the session starts with.
    exchange: tuple[str, ...] = ()
    # The same, its leading system and developer messages as one placeholder
    # (`without_instructions`); None when it has none.
    masked: tuple[str, ...] | None = None
    # The last call's other choices (Chat's n > 1): (exchange, masked) with that choice as the
    # output, which a request may extend as well.
    other_choices: list[tuple[tuple[str, ...], tuple[str, ...] | None]] = field(
        default_factory=list
    )
    # The index keys it is found by (Sessions), and the response ids it answered with.
    keys: list[ExchangeKey] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)
    # Function calls the model made whose outputs have not come back yet, by call_id.
    pending_tools: dict[str, ToolCall] = field(default_factory=dict)
    calls_running: int = 0
    closed: bool = False
    # The turns not ended yet, by id: the current one, and earlier ones whose calls still run
    # (a client may start the next turn while a call of the last one streams).
    open_turns: dict[str, _OpenTurn] = field(default_factory=dict)
    # The calls being answered, by call ordinal: a close cuts them off.
    running: dict[int, RunningCall] = field(default_factory=dict)
    closing: asyncio.Task[ClosedSession] | None = None

    @property
    def recorder(self) -> Recorder:
        return self.thread.recorder

    def begin_turn(self, items: Sequence[dict[str, Any]], traceparent: str = "") -> Turn:
        """End the current turn (its unanswered tool calls cancelled) and start one; a W3C
        `traceparent` the request carried makes the turn's spans children of the caller's."""
        self.end_turn()
        self.turn_count += 1
        turn_id = f"turn_{uuid.uuid4().hex}"
        ordinal = self.recorder.turn_started(turn_id, list(items), traceparent)
        turn = Turn(id=turn_id, thread_id=self.thread.id, ordinal=ordinal)
        self.thread.turns[turn_id] = turn
        self.turn = turn
        self.open_turns[turn_id] = _OpenTurn(turn)
        return turn

    async def cut_calls(self, grace: float) -> None:
        """Cancel the calls still running (each closes its upstream request, records itself
        CANCELLED with what had arrived and tells its client) and wait up to grace for their
        ends to be recorded, so the turn ends after its calls. Was: a cut-off call kept its
        upstream request open until the upstream sent more, or for the stream idle timeout."""
        cut = [running for running in self.running.values() if not running.ended.done()]
        for running in cut:
            running.cut = True
            running.task.cancel()
        if cut:
            await asyncio.wait([running.ended for running in cut], timeout=grace)

    def call_started(self, turn_id: str) -> None:
        """A call of turn turn_id was recorded as started; call_ended follows it."""
        opened = self.open_turns.get(turn_id)
        if opened is not None:
            opened.running += 1

    def call_ended(self, turn_id: str, status: common_pb2.ExecutionStatus.ValueType) -> None:
        """A call of turn turn_id ended with status; an earlier turn waiting for its calls
        ends with its last one (one of a turn already ended changes nothing)."""
        opened = self.open_turns.get(turn_id)
        if opened is None:
            return
        opened.running -= 1
        opened.last_call_status = status
        if opened.ending and opened.running <= 0:
            self._record_end(opened)

    def end_turn(self, *, now: bool = False) -> None:
        """End the current turn, its unanswered tool calls cancelled. While calls of it still
        run its turn_ended waits for the last of them: the reducer ends a turn's calls with
        it, so their later records would contradict it. now: end every open turn at once
        (the session is closing; what its calls record after that fails as recording does
        once a bundle is finished)."""
        turn, self.turn = self.turn, None
        if turn is not None:
            self._cancel_pending_tools()
            opened = self.open_turns.get(turn.id)
            if opened is not None:
                opened.ending = True
                if opened.running <= 0:
                    self._record_end(opened)
        if now:
            for opened in list(self.open_turns.values()):
                self._record_end(opened)

    def _cancel_pending_tools(self) -> None:
        for call in self.pending_tools.values():
            call.status = agent_pb2.TOOL_CALL_STATUS_CANCELLED
            self.recorder.tool_call_ended(
                call.ordinal,
                TRACE_STATUS[call.status],
                error=common_pb2.TraceError(
                    code="no_tool_output",
                    message="the client sent no output for this call before the turn ended",
                ),
            )
        self.pending_tools.clear()

    def _record_end(self, opened: _OpenTurn) -> None:
        """turn_ended: CANCELLED when the turn's last call was (the client went away, the
        gateway stopped) and no later one answered (SPEC section 4), or when a call of it still
        runs (the session is closed under it: the call is cut off, and takes its turn's status,
        which COMPLETED made a call with no answer look finished); else COMPLETED (a failed
        call leaves the turn to the client, which may retry it)."""
        del self.open_turns[opened.turn.id]
        turn = opened.turn
        cut_off = opened.running > 0
        status = CANCELLED if cut_off or opened.last_call_status == CANCELLED else COMPLETED
        self.recorder.turn_ended(turn.ordinal, status)
        # The turn's spans can go out (a live OTLP export): its records are written.
        telemetry.bundle_advanced(self.recorder.bundle_path)
        turn.end(
            agent_pb2.TURN_STATUS_COMPLETED
            if status == COMPLETED
            else agent_pb2.TURN_STATUS_INTERRUPTED
        )

    def on_tool_call(self, call: ToolCall) -> None:
        """An accepted function call: pending until a request brings its output."""
        self.pending_tools[call.call_id] = call
        if self.turn is not None:
            self.turn.tool_calls.append(call)

    def tool_output(self, call_id: str, item: dict[str, Any]) -> None:
        """A request brought a function call's output: the tool call ends with it."""
        call = self.pending_tools.pop(call_id, None)
        if call is None:
            return
        call.output = item
        call.status = agent_pb2.TOOL_CALL_STATUS_COMPLETED
        self.recorder.tool_output_submitted(
            call.ordinal, output_item=item, is_error=False, submitted_by="gateway client"
        )
        self.recorder.tool_call_ended(call.ordinal, TRACE_STATUS[call.status])


class ExchangeKey:
    """An exchange's fingerprints as an index key whose hash is computed once: a tuple hashes
    all its items at every lookup, so a session's key cost its whole conversation each time it
    was looked up or removed (a long session: quadratic time)."""

    __slots__ = ("_hash", "fingerprints")

    def __init__(self, fingerprints: tuple[str, ...]) -> None:
        self.fingerprints = fingerprints
        self._hash = hash(fingerprints)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, ExchangeKey)
            and self._hash == other._hash
            and self.fingerprints == other.fingerprints
        )

    def __len__(self) -> int:
        return len(self.fingerprints)


class _Sharing:
    """The open sessions whose last exchange is one key, in the order they got there, and a
    heap of those that may be idle (no call being answered), oldest first: which one a request
    continues is found in amortized O(log n), not by walking them all (runs of one prompt that
    got one answer share a key: 2,000 of them cost 2,000 steps a request, and as many to take
    one out)."""

    __slots__ = ("idle", "members", "queued")

    def __init__(self) -> None:
        # By id(session): (the order it joined in, the session).
        self.members: OrderedDict[int, tuple[int, Session]] = OrderedDict()
        # (order, id): members that were idle when pushed, checked when read; one found busy
        # is dropped, and pushed again when its calls end (Sessions.calls_ended). No session
        # itself: an entry left by one that moved on must not keep it (orders are never
        # reused, so an id reused by a later session does not match it).
        self.idle: list[tuple[int, int]] = []
        # By id(session): the order of its entry in the heap, so that none is pushed twice.
        self.queued: dict[int, int] = {}

    def join(self, session: Session, order: int) -> None:
        self.members[id(session)] = (order, session)
        self._push(session, order)

    def leave(self, session: Session) -> None:
        # Its heap entry goes when it comes to the top (it is no member then).
        self.members.pop(id(session), None)

    def idle_again(self, session: Session) -> None:
        member = self.members.get(id(session))
        if member is not None and self.queued.get(id(session)) != member[0]:
            self._push(session, member[0])

    def _push(self, session: Session, order: int) -> None:
        heapq.heappush(self.idle, (order, id(session)))
        self.queued[id(session)] = order

    def pick(self) -> Session | None:
        """The oldest member no call is answering, else the oldest member."""
        idle = self.idle
        while idle:
            order, key = idle[0]
            member = self.members.get(key)
            if member is not None and member[0] == order:
                session = member[1]
                if not session.calls_running and not session.closed:
                    return session
            heapq.heappop(idle)
            if self.queued.get(key) == order:
                del self.queued[key]
        return next((s for _, s in self.members.values() if not s.closed), None)


class Sessions:
    """The open sessions of one gateway: by key, by response id, by their last exchange."""

    def __init__(self, trace_root: Path, idle_timeout: float) -> None:
        self._root = trace_root
        self._idle_timeout = idle_timeout
        self._by_key: dict[str, Session] = {}
        self._by_response: dict[str, Session] = {}
        # Sessions by their last exchange, oldest first (runs of one prompt that got one
        # answer share it: each is a session of its own); the lengths present, to look
        # prefixes up.
        self._by_exchange: dict[ExchangeKey, _Sharing] = {}
        self._lengths: Counter[int] = Counter()
        self._joined = itertools.count()
        self._closed: OrderedDict[str, ClosedSession] = OrderedDict()
        # Sessions whose close is under way (their calls being cut off, the footer written).
        self._closing: dict[str, Session] = {}
        self._creating: dict[str, asyncio.Task[Session]] = {}
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="gateway idle sessions")

    @property
    def open(self) -> list[Session]:
        return list(self._by_key.values())

    def find(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def closed(self, key: str) -> ClosedSession | None:
        return self._closed.get(key)

    def closing(self, key: str) -> Session | None:
        """The session of key whose close has begun and not ended yet."""
        return self._closing.get(key)

    def by_response(self, response_id: str) -> Session | None:
        return self._by_response.get(response_id)

    def continuing(
        self,
        fingerprints: Sequence[str],
        masked: Sequence[str] | None = None,
        *,
        retry: bool = False,
    ) -> Session | None:
        """The open session whose last exchange the request's input extends (longest first);
        else, masked given (the input's leading system and developer messages as one
        placeholder), the one whose exchange so masked it extends: the instructions changed,
        as an agent's handoff changes them, the conversation going on.

        retry: the client says the request is its retry of one it sent before (an SDK's
        `x-stainless-retry-count`); its input may then be that exchange itself, a call that
        got no answer (failed, timed out, cut off) sent again. Without the client saying so,
        an input equal to an exchange may be a new run of the same prompt."""
        found = self._extended(fingerprints, retry)
        if found is None and masked is not None:
            found = self._extended(masked, retry)
        return found

    def _extended(self, fingerprints: Sequence[str], retry: bool) -> Session | None:
        for length in sorted(self._lengths, reverse=True):
            if 0 < length < len(fingerprints) or (retry and 0 < length == len(fingerprints)):
                found = self._by_exchange.get(ExchangeKey(tuple(fingerprints[:length])))
                # One that no call is answering first: two runs that shared an exchange go
                # on one each, whichever comes first (their bundles are the same so far).
                # Was: the last one to get there kept the exchange, so both went on in it and
                # the other's bundle stopped there.
                session = found.pick() if found is not None else None
                if session is not None:
                    return session
        return None

    def calls_ended(self, session: Session) -> None:
        """The session's calls_running fell to 0: it is idle again under its keys."""
        if session.calls_running == 0:
            for key in session.keys:
                sharing = self._by_exchange.get(key)
                if sharing is not None:
                    sharing.idle_again(session)

    async def get_or_create(
        self, key: SessionKey, *, model: str, reason: str
    ) -> tuple[Session, bool]:
        """The open session of key, or a new one (its bundle created; RecordingError when it
        cannot be). Concurrent first requests of one key share one creation."""
        existing = self._by_key.get(key.key)
        if existing is not None:
            return existing, False
        creating = self._creating.get(key.key)
        if creating is None:
            creating = asyncio.create_task(
                self._create(key, model, reason), name=f"session {key.key}"
            )
            self._creating[key.key] = creating
            try:
                session = await outlive_caller(creating)
            finally:
                self._creating.pop(key.key, None)
            return session, True
        return await outlive_caller(creating), False

    async def _create(self, key: SessionKey, model: str, reason: str) -> Session:
        thread_id = f"thread_{uuid.uuid4().hex}"
        metadata = {
            "gateway.session": key.key,
            "gateway.session_source": key.source,
            "gateway.session_reason": reason,
        }
        recorder = await Recorder.start(
            self._root, thread_id, model=model, instructions="", metadata=metadata
        )
        thread = Thread(
            id=thread_id,
            model=model,
            instructions="",
            metadata=metadata,
            recorder=recorder,
            events=EventBuffer(_EVENT_CAPACITY),
        )
        session = Session(key=key.key, thread=thread)
        self._by_key[key.key] = session
        log.info("session %s started (thread %s, %s): %s", key.key, thread_id, key.source, reason)
        return session

    def exchanged(
        self,
        session: Session,
        fingerprints: tuple[str, ...],
        masked: tuple[str, ...] | None,
        response_id: str,
        other_choices: Sequence[tuple[tuple[str, ...], tuple[str, ...] | None]] = (),
    ) -> None:
        """Remember a finished call's input and output (masked: with its instructions as
        `without_instructions` has them): the next request may extend it, or one of
        other_choices (the same with another choice of the answer as its output)."""
        if session.closed:
            return
        self._unindex(session)
        session.exchange, session.masked = fingerprints, masked
        session.other_choices = list(other_choices)
        # A masked key never equals an exact one: the placeholder is no entry's fingerprint.
        order = next(self._joined)
        # Once each: two choices may say the same.
        keys = {
            ExchangeKey(fingerprinted): None
            for pair in [(fingerprints, masked), *other_choices]
            for fingerprinted in pair
            if fingerprinted
        }
        for key in keys:
            self._by_exchange.setdefault(key, _Sharing()).join(session, order)
            self._lengths[len(key)] += 1
            session.keys.append(key)
        if response_id:
            self._by_response[response_id] = session
            session.response_ids.append(response_id)

    def _unindex(self, session: Session) -> None:
        for key in session.keys:
            sharing = self._by_exchange.get(key)
            if sharing is None:
                continue
            sharing.leave(session)
            if not sharing.members:
                del self._by_exchange[key]
            self._lengths[len(key)] -= 1
            if not self._lengths[len(key)]:
                del self._lengths[len(key)]
        session.keys.clear()

    async def close(self, session: Session, reason: str) -> ClosedSession:
        """Cut off its running calls, end the turn, record thread_ended and the footer; forget
        the session. Closes at once share one (a second waited for nothing, and found no
        closed session yet); a caller that leaves does not stop it halfway."""
        if session.closing is None:
            self._closing[session.key] = session
            session.closing = asyncio.create_task(
                self._close(session, reason), name=f"close session {session.key}"
            )
        return await outlive_caller(session.closing)

    async def _close(self, session: Session, reason: str) -> ClosedSession:
        try:
            return await self._finish(session, reason)
        finally:
            if self._closing.get(session.key) is session:
                del self._closing[session.key]

    async def _finish(self, session: Session, reason: str) -> ClosedSession:
        session.closed = True
        self._unindex(session)
        if self._by_key.get(session.key) is session:
            del self._by_key[session.key]
        for response_id in session.response_ids:
            if self._by_response.get(response_id) is session:
                del self._by_response[response_id]
        await session.cut_calls(_CUT_GRACE)
        session.end_turn(now=True)
        await session.recorder.finish(COMPLETED, reason)
        session.thread.mark_closed()
        closed = ClosedSession(
            session.key,
            session.thread.id,
            session.recorder.bundle_path,
            session.recorder.trace_id,
        )
        self._closed[session.key] = closed
        while len(self._closed) > _CLOSED_KEPT:
            self._closed.popitem(last=False)
        log.info("session %s closed (%s)", session.key, reason)
        return closed

    async def close_all(self, reason: str) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait([self._reaper])
        for session in list(self._by_key.values()) + list(self._closing.values()):
            await self.close(session, reason)

    async def _reap(self) -> None:
        """Close the sessions no request has used for the idle timeout."""
        period = min(max(self._idle_timeout / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self._idle_timeout
            for session in list(self._by_key.values()):
                if session.calls_running == 0 and session.last_used < deadline:
                    try:
                        await self.close(session, "idle")
                    except RecordingError:
                        log.exception("closing idle session %s failed", session.key)
