"""Threads and turns: their state, their public views, and each thread's event stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeAlias

from google.protobuf import timestamp_pb2

from agent_server import telemetry
from agent_server.events import MAX_DELTA_CHARS, EventBuffer
from agent_server.provider import EncodedItems, ProviderClient
from agent_server.recorder import Recorder
from agent_server.tools import SubmittedOutput, Tool, ToolCall
from agent_server.training import Sampling, TokenCapture, fill_thread
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import state_pb2
from trace_reducer import RecordedSummary

TurnStatus: TypeAlias = agent_pb2.TurnStatus.ValueType


def now() -> datetime:
    return datetime.now(UTC)


def timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    """moment as a Timestamp (naive: UTC), what FromDatetime gives, without its arithmetic in
    Python: every turn's events carry its times."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return timestamp_pb2.Timestamp(
        seconds=(moment - _EPOCH) // _SECOND, nanos=moment.microsecond * 1000
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)


@dataclass
class Turn:
    """One turn: IN_PROGRESS until it ends COMPLETED, FAILED or INTERRUPTED (never again)."""

    id: str
    thread_id: str
    # The turn's ordinal in the thread's bundle.
    ordinal: int
    started_at: datetime = field(default_factory=now)
    status: TurnStatus = agent_pb2.TURN_STATUS_IN_PROGRESS
    error: agent_pb2.TurnError | None = None
    completed_at: datetime | None = None
    # The function calls the model made in this turn, in the order they were accepted, and
    # their views as one message, copied whole into every view of the turn.
    tool_calls: list[ToolCall] = field(default_factory=list)
    _tool_call_views: agent_pb2.Turn = field(default_factory=agent_pb2.Turn, repr=False)
    # The thread's sampling settings with the turn's overrides.
    sampling: Sampling = field(default_factory=Sampling)

    @property
    def running(self) -> bool:
        """Not ended yet: in progress, or waiting for tool outputs."""
        return self.status in (
            agent_pb2.TURN_STATUS_IN_PROGRESS,
            agent_pb2.TURN_STATUS_AWAITING_TOOL_OUTPUTS,
        )

    def add_tool_call(self, call: ToolCall) -> None:
        """The call joins the turn; its view becomes the turn's, so status changes show."""
        view = self._tool_call_views.tool_calls.add()
        view.CopyFrom(call.view)
        call.view = view
        self.tool_calls.append(call)

    def end(self, status: TurnStatus, error: agent_pb2.TurnError | None = None) -> None:
        self.status = status
        self.error = error
        self.completed_at = now()

    def to_proto(self) -> agent_pb2.Turn:
        turn = agent_pb2.Turn(
            id=self.id,
            thread_id=self.thread_id,
            status=self.status,
            started_at=timestamp(self.started_at),
        )
        if self.error is not None:
            turn.error.CopyFrom(self.error)
        if self.completed_at is not None:
            turn.completed_at.CopyFrom(timestamp(self.completed_at))
        turn.MergeFrom(self._tool_call_views)
        return turn


class Runner(Protocol):
    """What runs a thread's turn (agent_server.turn.TurnRunner), as the thread sees it."""

    @property
    def turn(self) -> Turn: ...

    async def interrupt(self, requested_by: str) -> None:
        """Stop the turn; return once it has ended (at once when it already had)."""

    def submit_tool_outputs(self, outputs: Sequence[SubmittedOutput], submitted_by: str) -> None:
        """Answer pending tool calls (all of outputs or none: raises AgentError)."""


@dataclass
class Thread:
    """A conversation: its history, its turns (at most one running), its events, its bundle."""

    id: str
    model: str
    instructions: str
    metadata: dict[str, str]
    recorder: Recorder
    events: EventBuffer
    tools: tuple[Tool, ...] = ()
    created_at: datetime = field(default_factory=now)
    # Order of creation among the server's threads: what ListThreads pages by.
    seq: int = 0
    closed_at: datetime | None = None
    turns: dict[str, Turn] = field(default_factory=dict)
    # Every item the model has been shown or has produced, in order: the next request's input.
    history: list[dict[str, Any]] = field(default_factory=list)
    # The history's items as its last request encoded them (each request re-sends them all).
    encoded_history: EncodedItems = field(default_factory=EncodedItems)
    # The runner of the turn that has not yet emitted turn_completed; changed only by
    # begin_turn and end_turn.
    running: Runner | None = None
    closing: asyncio.Task[None] | None = None
    sampling: Sampling = field(default_factory=Sampling)
    capture: TokenCapture = field(default_factory=TokenCapture)
    # Optional request fields the provider refused (best effort): left out from then on.
    refused_fields: frozenset[str] = frozenset()
    # Where its requests go; None until the agent sets it (tests may leave it).
    provider: ProviderClient | None = None
    # Set on a thread made by ForkThread.
    fork: agent_pb2.ForkOrigin | None = None
    # How long the history was when each turn ended: what a fork after that turn shares.
    history_marks: dict[str, int] = field(default_factory=dict)
    # The ids of the items the model produced and the thread accepted (what rewards may name).
    accepted_items: set[str] = field(default_factory=set)
    # The id of the latest inference call it sent (what a replay branch finds its place by).
    last_call_id: str = ""

    def begin_turn(self, runner: Runner) -> None:
        """Make runner the thread's running turn; the caller has checked that none runs."""
        assert self.running is None, "a turn is already running"
        self.turns[runner.turn.id] = runner.turn
        self.running = runner

    def end_turn(self, runner: Runner) -> None:
        """The runner's turn has ended: the thread may start the next one."""
        if self.running is runner:
            self.running = None
        self.history_marks[runner.turn.id] = len(self.history)

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    @property
    def status(self) -> agent_pb2.ThreadStatus.ValueType:
        return agent_pb2.THREAD_STATUS_CLOSED if self.closed else agent_pb2.THREAD_STATUS_ACTIVE

    def mark_closed(self) -> None:
        """The thread is over: its history is no longer needed, its events stay for replay."""
        self.closed_at = now()
        self.history = []
        self.encoded_history.clear()
        self.events.close()

    def to_proto(self, *, with_turns: bool = True) -> agent_pb2.Thread:
        thread = agent_pb2.Thread(
            id=self.id,
            model=self.model,
            status=self.status,
            created_at=timestamp(self.created_at),
            bundle_path=self.recorder.bundle_path,
            recording_status=self.recorder.status,
            recording_error=self.recorder.error,
            metadata=self.metadata,
            turn_count=len(self.turns),
            tools=[tool.to_proto() for tool in self.tools],
        )
        fill_thread(thread, self.sampling, self.capture)
        if self.provider is not None:
            thread.provider = self.provider.name
            thread.provider_api = self.provider.dialect.name
            thread.provider_url = self.provider.display_url
        thread.refused_fields.extend(sorted(self.refused_fields))
        if self.fork is not None:
            thread.fork.CopyFrom(self.fork)
        if with_turns:
            thread.turns.extend(turn.to_proto() for turn in self.turns.values())
        if self.closed_at is not None:
            thread.closed_at.CopyFrom(timestamp(self.closed_at))
        return thread

    def emit_delta(self, turn_id: str, item_id: str, delta: str, *, refusal: bool = False) -> None:
        """Publish a text delta, merged into the item's latest one while no subscriber has it;
        one too large for a client's message limit goes out in pieces."""
        telemetry.on_delta(turn_id)
        pieces = (
            [delta]
            if len(delta) <= MAX_DELTA_CHARS
            else [delta[i : i + MAX_DELTA_CHARS] for i in range(0, len(delta), MAX_DELTA_CHARS)]
        )
        for piece in pieces:
            if refusal or not self.events.merge_delta(turn_id, item_id, piece):
                # The body filled in place (a body message made and then copied in costs
                # twice, once per delta); setting its fields marks it the event's kind.
                event = agent_pb2.ThreadEvent(thread_id=self.id, turn_id=turn_id)
                body = event.agent_message_delta
                body.item_id = item_id
                body.delta = piece
                if refusal:
                    body.refusal = True
                _stamp(event)
                # telemetry.on_event has nothing to do for a delta (on_delta above counts it).
                self.events.publish(event)

    def emit(self, turn_id: str, **kind: Any) -> None:
        """Publish one event (exactly one `kind=message` keyword) to the thread's subscribers."""
        event = agent_pb2.ThreadEvent(thread_id=self.id, turn_id=turn_id, **kind)
        _stamp(event)
        self.events.publish(event)
        telemetry.on_event(self.id, event)


def _stamp(event: agent_pb2.ThreadEvent) -> None:
    """Set the event's time to now (GetCurrentTime() goes through datetime arithmetic; this
    runs once per event)."""
    stamp = event.time
    stamp.seconds, stamp.nanos = divmod(time.time_ns(), 1_000_000_000)


def missing_reward_target(trace: state_pb2.RolloutTrace, turn_id: str, item_id: str) -> str | None:
    """What a reward names that a closed thread's reduced bundle lacks ("turn" or "item"),
    checked as a live thread checks it: a turn by its id, an item by the id the model gave
    it in an answer."""
    if turn_id and turn_id not in trace.turns:
        return "turn"
    if item_id and not any(
        item.responses_item_id == item_id
        and any(p.WhichOneof("producer") == "inference" for p in item.produced_by)
        for item in trace.conversation_items.values()
    ):
        return "item"
    return None


def recorded_thread(summary: RecordedSummary) -> agent_pb2.Thread:
    """A thread only its bundle knows, as ListThreads shows it."""
    thread = agent_pb2.Thread(
        id=summary.thread_id,
        model=summary.model,
        status=agent_pb2.THREAD_STATUS_CLOSED,
        created_at=timestamp(summary.created_at),
        bundle_path=str(summary.bundle_dir),
        recording_status=agent_pb2.RECORDING_STATUS_CLOSED,
        metadata=summary.metadata,
        recorded=True,
    )
    fork = summary.fork
    if fork is not None:
        thread.fork.CopyFrom(
            agent_pb2.ForkOrigin(
                parent_thread_id=fork.parent_thread_id,
                after_turn_id=fork.after_turn_id,
                group_id=fork.group_id,
                repetition_index=fork.repetition_index,
                resumed=fork.resumed,
            )
        )
    return thread
