"""The agent: the registry of threads and the operations the gRPC service exposes."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from agent_server import telemetry
from agent_server.config import Settings
from agent_server.errors import (
    BundlePathDeniedError,
    EmptyInputError,
    InputTooLargeError,
    InstructionsTooLargeError,
    InvalidBundlePathError,
    InvalidForkCountError,
    InvalidGroupIdError,
    InvalidModelError,
    InvalidPageTokenError,
    InvalidRewardError,
    InvalidSamplingError,
    InvalidStatusFilterError,
    ItemNotFoundError,
    MetadataTooLargeError,
    MissingThreadIdError,
    MissingTurnIdError,
    RecordedThreadUnreadableError,
    RecordingOffError,
    RecordingStartFailedError,
    RewardsUnavailableError,
    ShuttingDownError,
    ThreadActiveError,
    ThreadClosedError,
    ThreadNotFoundError,
    TurnAlreadyRunningError,
    TurnNotAwaitingToolOutputsError,
    TurnNotFoundError,
    TurnNotRunningError,
    UnknownProviderError,
    unknown_enum,
)
from agent_server.events import EventBuffer
from agent_server.provider import ProviderClient
from agent_server.recorder import ForkSeed, Recorder
from agent_server.threads import Thread, Turn, missing_reward_target
from agent_server.tools import SubmittedOutput, Tool, parse_tools, tools_from_request
from agent_server.training import Sampling, TokenCapture, settings_from_request
from agent_server.turn import TurnRunner
from grpc_common import outlive_caller
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import (
    BundleError,
    BundleNotFoundError,
    BundlePathError,
    OutsideRootError,
    RecordedSummary,
    RecordingError,
    ReductionError,
    RewardError,
    RewardInput,
    StoredThread,
    TurnNotEndedError,
    TurnNotRecordedError,
    append_reward,
    canonical_json,
    check_reward,
    list_recorded,
    load_recorded,
    payload_id,
    thread_bundles,
)
from trace_reducer.bundle import BundleRoot, ConfinedBundle
from trace_reducer.reduce import replay_confined

if TYPE_CHECKING:
    from agent_server.replay_model import BranchPoint

log = logging.getLogger(__name__)

MAX_INPUT_BYTES = 1024 * 1024
MAX_INSTRUCTIONS_BYTES = 1024 * 1024
MAX_MODEL_CHARS = 256
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
CLOSE_REQUESTER = "close_thread"
SHUTDOWN_REQUESTER = "shutdown"
CLOSE_REASON = "closed"
SHUTDOWN_REASON = "shutdown"
FORK_FAILED_REASON = "fork_failed"
MAX_FORKS = 64
MAX_GROUP_ID_CHARS = 256


def user_message(texts: Sequence[str]) -> dict[str, object]:
    """A turn's input as one Responses API user message, one input_text part per text."""
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text} for text in texts],
    }


@dataclass(frozen=True)
class _ThreadSpec:
    """What a new thread is made of; a fork also brings its seed, origin and shared history."""

    model: str
    instructions: str
    metadata: Mapping[str, str]
    tools: tuple[Tool, ...]
    sampling: Sampling
    capture: TokenCapture
    fork: tuple[ForkSeed, agent_pb2.ForkOrigin, list[dict[str, object]]] | None = None
    provider: str = ""


@dataclass(frozen=True)
class _Origin:
    """The thread a fork or resume continues, as of one of its turns."""

    thread_id: str
    spec: _ThreadSpec
    bundle: str
    trace_id: str
    after_turn_id: str
    shared_turns: int
    history: list[dict[str, object]]
    # The payloads the parent's bundle (and those it refers to) holds.
    payloads: frozenset[str]
    parent_call_id: str = ""
    parent_tokens: Sequence[int] = ()


def _load_recorded(root: Path, thread_id: str, bundle_path: str) -> StoredThread:
    """The recorded thread, its lookup's failures as the agent's errors."""
    try:
        return load_recorded(root, thread_id=thread_id, bundle_path=bundle_path)
    except BundleNotFoundError as error:
        if bundle_path:
            raise ThreadNotFoundError(str(error), bundle_path=bundle_path) from error
        raise ThreadNotFoundError(f"no thread {thread_id!r}", thread_id=thread_id) from error
    except OutsideRootError as error:
        raise BundlePathDeniedError(str(error)) from error
    except BundlePathError as error:
        raise InvalidBundlePathError(str(error)) from error
    except (BundleError, ReductionError) as error:
        raise RecordedThreadUnreadableError(str(error)) from error


class Agent:
    """Owns every thread of the server; each method is one client operation."""

    def __init__(
        self,
        settings: Settings,
        provider: ProviderClient,
        named: Mapping[str, ProviderClient] | None = None,
        *,
        branch_point: Callable[[str, int], BranchPoint | None] | None = None,
    ) -> None:
        self._settings = settings
        # --replay-branch-at: where a replayed thread (by its latest call id and the turns it
        # has had) forks from the recorded thread it replays, if its next turn is the one.
        self._branch_point = branch_point
        # Threads whose bundle is becoming a fork's: their next turn waits for it.
        self._branching: dict[str, asyncio.Task[None]] = {}
        self._provider = provider
        # The config's named providers, which a thread may choose instead of the default.
        self._named = dict(named or {})
        self._models = {p.name: p.model for p in settings.providers if p.model}
        # Every thread the server knows, in the order they were created.
        self._threads: dict[str, Thread] = {}
        self._thread_seq = itertools.count(1)
        # Closed threads in the order they closed, with when: they are forgotten after the
        # retention period, or sooner when too many are kept.
        self._closed: deque[tuple[float, str]] = deque()
        self._stopping = False
        # Threads whose bundle is being created: shutdown waits for them.
        self._starting: set[asyncio.Task[Thread]] = set()

    def thread_ids(self) -> list[str]:
        return list(self._threads)

    def holds(self, thread_id: str) -> bool:
        """Whether the thread is this server's (open, or closed and still kept)."""
        self._forget_closed()
        return thread_id in self._threads

    def held_threads(self) -> list[Thread]:
        """Every thread this server keeps, oldest first (what ListThreads pages through)."""
        self._forget_closed()
        return list(self._threads.values())

    @property
    def stopping(self) -> bool:
        return self._stopping

    def check_serving(self) -> None:
        if self._stopping:
            raise ShuttingDownError()

    async def start_thread(
        self,
        model: str,
        instructions: str,
        metadata: Mapping[str, str],
        tools: Sequence[agent_pb2.FunctionTool] = (),
        *,
        sampling: Sampling | None = None,
        capture: TokenCapture | None = None,
        provider: str = "",
    ) -> Thread:
        self.check_serving()
        _check_thread_arguments(model, instructions, metadata)
        checked = parse_tools(tools)
        if provider and provider not in self._named:
            known = ", ".join(sorted(self._named)) or "none are configured"
            raise UnknownProviderError(
                f"no provider named {provider!r} ([providers.NAME] in the config: {known})",
                provider=provider,
            )
        choice = (sampling or Sampling()).tool_choice
        if isinstance(choice, dict) and choice.get("name") not in {t.name for t in checked}:
            raise InvalidSamplingError(
                f"tool_choice names {choice.get('name')!r}, which is not a tool of the thread",
                field="tool_choice",
            )
        return await self._shielded_start(
            _ThreadSpec(
                model,
                instructions,
                metadata,
                checked,
                sampling or Sampling(),
                capture or TokenCapture(),
                provider=provider,
            )
        )

    async def _shielded_start(self, spec: _ThreadSpec) -> Thread:
        # A caller that gives up must not leave a bundle without its thread behind: the thread
        # is made anyway, and shutdown finishes its bundle like any other.
        starting = asyncio.create_task(self._start_thread(spec), name="StartThread")
        self._starting.add(starting)
        starting.add_done_callback(self._starting.discard)
        return await outlive_caller(starting)

    async def _start_thread(self, spec: _ThreadSpec) -> Thread:
        thread_id = f"thread_{uuid.uuid4().hex}"
        model = spec.model or self._models.get(spec.provider) or self._settings.model
        instructions, metadata, fork = spec.instructions, spec.metadata, spec.fork
        trace_root = self._settings.trace_root
        if trace_root is None:
            recorder = Recorder.off(thread_id)
        else:
            try:
                recorder = await Recorder.start(
                    trace_root,
                    thread_id,
                    model=model,
                    instructions=instructions,
                    metadata=metadata,
                    fork=fork[0] if fork is not None else None,
                )
            except RecordingError as error:
                raise RecordingStartFailedError(str(error)) from error
        if self._stopping:
            # Shutdown began while the bundle was being made: finish it like the others.
            await recorder.finish(common_pb2.EXECUTION_STATUS_CANCELLED, SHUTDOWN_REASON)
            raise ShuttingDownError()
        thread = Thread(
            id=thread_id,
            model=model,
            instructions=instructions,
            metadata=dict(metadata),
            recorder=recorder,
            tools=spec.tools,
            events=EventBuffer(self._settings.event_buffer),
            seq=next(self._thread_seq),
            sampling=spec.sampling,
            capture=spec.capture,
            provider=self._named[spec.provider] if spec.provider else self._provider,
        )
        if fork is not None:
            thread.fork = fork[1]
            thread.history = [dict(item) for item in fork[2]]
        self._threads[thread_id] = thread
        self._forget_closed()
        telemetry.thread_started(
            thread.id,
            model=thread.model,
            bundle_path=thread.recorder.bundle_path,
            trace_id=thread.recorder.trace_id,
        )
        return thread

    def _forget_closed(self) -> None:
        """Drop closed threads past their retention, and the oldest beyond the count kept."""
        retention = self._settings.closed_thread_retention
        keep = self._settings.max_closed_threads
        deadline = time.monotonic() - retention
        closed = self._closed
        while closed and (len(closed) > keep or closed[0][0] <= deadline):
            _, thread_id = closed.popleft()
            self._threads.pop(thread_id, None)

    async def list_threads(
        self,
        page_size: int,
        page_token: str,
        status: agent_pb2.ThreadStatus.ValueType,
        include_recorded: bool = False,
    ) -> tuple[list[Thread | RecordedSummary], str]:
        """One page of threads, oldest first, and the token of the next page ('' at the end);
        with include_recorded, after those in memory, those only under the trace root."""
        self.check_serving()
        check_status_filter(status)
        self._forget_closed()
        after, after_bundle = _decode_page_token(page_token)
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        page: list[Thread | RecordedSummary] = []
        if after_bundle is None:
            for thread in self._threads.values():
                if thread.seq <= after:
                    continue
                if status and thread.status != status:
                    continue
                if len(page) == size:
                    return page, _encode_page_token(page[-1])
                page.append(thread)
        root = self._settings.trace_root
        if not include_recorded or root is None or status == agent_pb2.THREAD_STATUS_ACTIVE:
            return page, ""
        # One more than fits tells whether a next page exists.
        wanted = size - len(page) + 1
        held = frozenset(self._threads)
        recorded = await asyncio.to_thread(
            lambda: list(
                itertools.islice(list_recorded(root, after=after_bundle or "", skip=held), wanted)
            )
        )
        page.extend(recorded[: wanted - 1])
        return page, _encode_page_token(page[-1]) if len(recorded) == wanted else ""

    def thread(self, thread_id: str) -> Thread:
        self.check_serving()
        if not thread_id:
            raise MissingThreadIdError("thread_id is required")
        self._forget_closed()
        thread = self._threads.get(thread_id)
        if thread is None:
            raise ThreadNotFoundError(f"no thread {thread_id!r}", thread_id=thread_id)
        return thread

    async def fork_thread(
        self, thread_id: str, after_turn_id: str, count: int, group_id: str, bundle_path: str = ""
    ) -> list[Thread]:
        """`count` new threads continuing thread_id's history as of after_turn_id (its end when
        empty); each bundle refers to the parent's for what they share. A thread the server
        holds open forks from memory; a closed one, one it no longer holds, or one named by
        bundle_path, from its bundle under the trace root."""
        self.check_serving()
        if not 1 <= count <= MAX_FORKS:
            raise InvalidForkCountError(
                f"count must be 1 to {MAX_FORKS}, not {count}", limit=str(MAX_FORKS)
            )
        if len(group_id) > MAX_GROUP_ID_CHARS or not group_id.isprintable():
            raise InvalidGroupIdError(
                f"group_id must be at most {MAX_GROUP_ID_CHARS} printable characters"
            )
        held = self._held(thread_id) if not bundle_path else None
        if held is not None and not (held.closed or held.closing is not None):
            origin = self._origin_in_memory(held, after_turn_id)
        else:
            origin = await self._origin_recorded(thread_id, bundle_path, after_turn_id, held)
        return await self._spawn(origin, count, group_id or f"group_{uuid.uuid4().hex}")

    async def resume_thread(self, thread_id: str, bundle_path: str, after_turn_id: str) -> Thread:
        """A new thread going on with a closed or recorded thread's conversation after
        after_turn_id (its last ended turn when empty), its bundle linked to the old one."""
        self.check_serving()
        if not thread_id and not bundle_path:
            raise MissingThreadIdError("thread_id or bundle_path is required")
        held = self._held(thread_id) if not bundle_path else None
        if held is not None and not held.closed:
            raise ThreadActiveError(
                f"thread {thread_id!r} is still open: StartTurn continues it (ForkThread "
                "branches it)",
                thread_id=thread_id,
            )
        origin = await self._origin_recorded(thread_id, bundle_path, after_turn_id, held)
        (thread,) = await self._spawn(origin, 1, "", resumed=True)
        return thread

    def _held(self, thread_id: str) -> Thread | None:
        if not thread_id:
            raise MissingThreadIdError("thread_id is required")
        self._forget_closed()
        return self._threads.get(thread_id)

    def _origin_in_memory(self, parent: Thread, after_turn_id: str) -> _Origin:
        """What forking an open thread after after_turn_id continues, from its history."""
        thread_id = parent.id
        turn_ids = list(parent.turns)
        if after_turn_id:
            turn = parent.turns.get(after_turn_id)
            if turn is None:
                raise TurnNotFoundError(
                    f"thread {thread_id!r} has no turn {after_turn_id!r}", turn_id=after_turn_id
                )
            if turn.running or after_turn_id not in parent.history_marks:
                raise TurnAlreadyRunningError(
                    f"turn {after_turn_id!r} has not ended yet", turn_id=after_turn_id
                )
            shared = parent.history[: parent.history_marks[after_turn_id]]
        else:
            if parent.running is not None:
                running_id = parent.running.turn.id
                raise TurnAlreadyRunningError(
                    f"turn {running_id!r} of thread {thread_id!r} is still running; fork after "
                    "an ended turn, or when it has ended",
                    turn_id=running_id,
                )
            shared = list(parent.history)
            after_turn_id = turn_ids[-1] if turn_ids else ""
        parent_call_id, parent_tokens = parent.recorder.held_tokens()
        return _Origin(
            thread_id=thread_id,
            spec=_ThreadSpec(
                parent.model,
                parent.instructions,
                parent.metadata,
                parent.tools,
                parent.sampling,
                parent.capture,
                provider=parent.provider.name if parent.provider is not None else "",
            ),
            bundle=Path(parent.recorder.bundle_path).name if parent.recorder.bundle_path else "",
            trace_id=parent.recorder.trace_id,
            after_turn_id=after_turn_id,
            shared_turns=turn_ids.index(after_turn_id) + 1 if after_turn_id else 0,
            history=shared,
            payloads=parent.recorder.payload_ids,
            parent_call_id=parent_call_id,
            parent_tokens=parent_tokens,
        )

    async def _origin_recorded(
        self, thread_id: str, bundle_path: str, after_turn_id: str, held: Thread | None
    ) -> _Origin:
        """What continuing a thread from its bundle continues: the history, tools and
        settings its records hold (the latest request's, for tools and settings)."""
        root = self._settings.trace_root
        if held is not None and not held.recorder.bundle_path:
            raise RecordingOffError(
                f"thread {thread_id!r} is closed and was not recorded: nothing is left to "
                "continue it from",
                thread_id=thread_id,
            )
        if root is None:
            if bundle_path:
                raise RecordingOffError("bundle_path needs a trace root (recording is off)")
            raise ThreadNotFoundError(f"no thread {thread_id!r}", thread_id=thread_id)
        name = Path(held.recorder.bundle_path).name if held is not None else bundle_path
        recorded = await asyncio.to_thread(
            _load_recorded, root, thread_id if not bundle_path else "", name
        )
        try:
            after_turn_id, shared_turns, history = recorded.continue_after(after_turn_id)
        except TurnNotEndedError as error:
            raise TurnAlreadyRunningError(str(error), turn_id=error.turn_id) from error
        except TurnNotRecordedError as error:
            raise TurnNotFoundError(str(error), turn_id=error.turn_id) from error
        except (BundleError, ValueError) as error:
            raise RecordedThreadUnreadableError(str(error)) from error
        envelope, policy_version = recorded.last_request()
        sampling, capture = settings_from_request(envelope, policy_version)
        thread = recorded.thread
        return _Origin(
            thread_id=recorded.thread_id,
            spec=_ThreadSpec(
                thread.model,
                recorded.instructions(),
                dict(thread.metadata),
                tools_from_request(envelope.get("tools")),
                sampling,
                capture,
            ),
            bundle=recorded.bundle_dir.name,
            trace_id=recorded.trace.trace_id,
            after_turn_id=after_turn_id,
            shared_turns=shared_turns,
            history=history,
            payloads=recorded.payload_ids(),
        )

    async def _spawn(
        self, origin: _Origin, count: int, group: str, *, resumed: bool = False
    ) -> list[Thread]:
        """Start `count` threads continuing origin, all or none."""
        # Refer to the parent's payloads only when it holds every one the prefix needs.
        needed = {payload_id(canonical_json(item)) for item in origin.history}
        payloads = origin.payloads if needed <= origin.payloads else frozenset()
        forks: list[Thread] = []
        try:
            for index in range(count):
                fork = agent_pb2.ForkOrigin(
                    parent_thread_id=origin.thread_id,
                    after_turn_id=origin.after_turn_id,
                    group_id=group,
                    repetition_index=index,
                    resumed=resumed,
                )
                seed = ForkSeed(
                    parent_thread_id=origin.thread_id,
                    parent_bundle=origin.bundle,
                    parent_trace_id=origin.trace_id,
                    after_turn_id=origin.after_turn_id,
                    group_id=group,
                    repetition_index=index,
                    shared_turns=origin.shared_turns,
                    prefix_items=origin.history,
                    parent_payloads=payloads,
                    parent_call_id=origin.parent_call_id,
                    parent_tokens=origin.parent_tokens,
                    resumed=resumed,
                )
                forks.append(
                    await self._shielded_start(
                        replace(origin.spec, fork=(seed, fork, origin.history))
                    )
                )
        except BaseException:
            # All or nothing: the threads made so far are closed, their bundles finished.
            for made in forks:
                await self._close(
                    made, common_pb2.EXECUTION_STATUS_CANCELLED, FORK_FAILED_REASON, "fork_thread"
                )
            raise
        return forks

    async def record_reward(self, reward: RewardInput) -> tuple[str, int]:
        """Append a reward to the rewards of the thread's bundle; (bundle path, its seq).

        A thread the server still knows is checked in memory; one it has forgotten (closed
        and past its retention, or from an earlier run) is found by its id under the trace
        root and checked against its reduced bundle."""
        self.check_serving()
        if not reward.thread_id:
            raise MissingThreadIdError("thread_id is required")
        try:
            check_reward(reward)
        except RewardError as error:
            raise InvalidRewardError(str(error), error.reason) from error
        self._forget_closed()
        thread = self._threads.get(reward.thread_id)
        if thread is not None:
            if not thread.recorder.bundle_path:
                raise RecordingOffError(
                    f"thread {reward.thread_id!r} has no bundle (recording is off): rewards "
                    "are recorded beside it",
                    thread_id=reward.thread_id,
                )
            if reward.turn_id and reward.turn_id not in thread.turns:
                raise TurnNotFoundError(
                    f"thread {reward.thread_id!r} has no turn {reward.turn_id!r}",
                    turn_id=reward.turn_id,
                )
            if reward.item_id and reward.item_id not in thread.accepted_items:
                raise ItemNotFoundError(
                    f"thread {reward.thread_id!r} has no item {reward.item_id!r}",
                    item_id=reward.item_id,
                )
            held = Path(thread.recorder.bundle_path).name, thread.recorder.trace_id
        else:
            held = None
        try:
            bundle_dir, seq = await asyncio.to_thread(self._append_reward, reward, held)
        except RewardError as error:
            code = (
                grpc.StatusCode.DATA_LOSS
                if error.reason == "REWARDS_CORRUPT"
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            raise RewardsUnavailableError(str(error), error.reason, code) from error
        return str(bundle_dir), seq

    def _append_reward(self, reward: RewardInput, held: tuple[str, str] | None) -> tuple[Path, int]:
        """Append the reward beside its thread's bundle: `held`, (its name under the trace
        root, its trace id) for a thread the server holds, else the bundle found under the
        root. The bundle is opened from the root through descriptors that follow no link, and
        the reward written through its directory's: a directory of the root swapped for a
        symbolic link since the bundle was found (or made) leads nowhere outside it."""
        root = self._settings.trace_root
        thread_id = reward.thread_id
        missing = ThreadNotFoundError(f"no thread {thread_id!r}", thread_id=thread_id)
        if root is None:
            raise missing
        if held is not None:
            name, trace_id = held
        else:
            candidates = thread_bundles(root, thread_id)
            if not candidates:
                raise missing
            name, trace_id = candidates[-1].name, ""
        try:
            bundle = BundleRoot(root).open(name)
        except BundleError as error:
            if held is not None:
                raise RewardError(
                    f"cannot record rewards: {error}", "REWARDS_UNWRITABLE"
                ) from error
            raise missing from error
        with bundle:
            if held is None:
                trace_id = self._check_reward_target(bundle, reward, missing)
            bundle_dir = Path(bundle.display_dir)
            seq = append_reward(bundle_dir, reward, trace_id=trace_id, dir_fd=bundle.dir_fd)
        return bundle_dir, seq

    @staticmethod
    def _check_reward_target(
        bundle: ConfinedBundle, reward: RewardInput, missing: ThreadNotFoundError
    ) -> str:
        """The trace id of a bundle the server no longer holds, checked to be the reward's
        thread's and to have the turn and item the reward names."""
        thread_id = reward.thread_id
        try:
            trace = replay_confined(bundle)
        except (BundleError, ReductionError) as error:
            raise missing from error
        if trace.root_thread_id != thread_id:
            raise missing
        missing_target = missing_reward_target(trace, reward.turn_id, reward.item_id)
        if missing_target == "turn":
            raise TurnNotFoundError(
                f"thread {thread_id!r} has no turn {reward.turn_id!r}", turn_id=reward.turn_id
            )
        if missing_target == "item":
            raise ItemNotFoundError(
                f"thread {thread_id!r} has no item {reward.item_id!r}", item_id=reward.item_id
            )
        return trace.trace_id

    async def branch_before_turn(self, thread_id: str) -> None:
        """--replay-branch-at: a replayed thread about to start the turn that holds the branch
        call continues as a fork of the recorded thread, after the turn before that one. Its
        bundle so far, a replay of the recorded turns the fork now shares, gives way to the
        fork's, which refers to the recorded bundle for them (the thread and its id stay)."""
        if self._branch_point is None:
            return
        thread = self.thread(thread_id)
        pending = self._branching.get(thread_id)
        if pending is None:
            root = self._settings.trace_root
            if (
                root is None
                or thread.fork is not None
                or thread.running is not None
                or thread.closed
                or thread.closing is not None
                or not thread.recorder.bundle_path
            ):
                return
            point = self._branch_point(thread.last_call_id, len(thread.turns))
            if point is None:
                return
            pending = asyncio.create_task(
                self._branch(thread, root, point), name=f"branch of {thread.id}"
            )
            self._branching[thread_id] = pending
            pending.add_done_callback(lambda _: self._branching.pop(thread_id, None))
        # Shielded: a caller that gives up must not leave the thread between two bundles.
        await outlive_caller(pending)

    async def _branch(self, thread: Thread, root: Path, point: BranchPoint) -> None:
        recorded = point.thread
        seed = ForkSeed(
            parent_thread_id=recorded.thread_id,
            parent_bundle=recorded.bundle.name,
            parent_trace_id=recorded.trace.trace_id,
            after_turn_id=point.after_turn_id,
            group_id=point.group_id,
            repetition_index=point.repetition_index,
            shared_turns=point.shared_turns,
            prefix_items=list(thread.history),
            parent_payloads=recorded.payload_ids,
        )
        # Refer to the recorded bundle's payloads only when it holds every one the prefix needs.
        needed = {payload_id(canonical_json(item)) for item in thread.history}
        if not needed <= recorded.payload_ids:
            seed = replace(seed, parent_payloads=frozenset())
        # First out of the way: the fork's bundle may take the same name (thread id and second).
        await thread.recorder.discard()
        try:
            recorder = await Recorder.start(
                root,
                thread.id,
                model=thread.model,
                instructions=thread.instructions,
                metadata=thread.metadata,
                fork=seed,
            )
        except RecordingError as error:
            # The turn does not start; the next StartTurn tries again.
            raise RecordingStartFailedError(
                f"the branch cannot start its fork's bundle: {error}"
            ) from error
        thread.recorder = recorder
        thread.fork = agent_pb2.ForkOrigin(
            parent_thread_id=recorded.thread_id,
            after_turn_id=point.after_turn_id,
            group_id=point.group_id,
            repetition_index=point.repetition_index,
        )
        log.info(
            "thread %s branches from %s after turn %d: recording into %s",
            thread.id,
            recorded.bundle,
            point.shared_turns,
            recorder.bundle_path,
        )

    def start_turn(
        self,
        thread_id: str,
        texts: Sequence[str],
        sampling: Sampling | None = None,
        *,
        traceparent: str = "",
    ) -> Turn:
        """Record and announce the turn, start its task, and return it IN_PROGRESS.

        `traceparent` (W3C) makes the turn's spans children of the caller's span."""
        thread = self.thread(thread_id)
        if not any(texts):
            raise EmptyInputError("input must contain at least one non-empty text")
        size = sum(len(text.encode()) for text in texts)
        if size > MAX_INPUT_BYTES:
            raise InputTooLargeError(
                f"input holds {size} bytes of text; the limit is {MAX_INPUT_BYTES}",
                limit=str(MAX_INPUT_BYTES),
            )
        if thread.closed or thread.closing is not None:
            raise ThreadClosedError(f"thread {thread_id!r} is closed", thread_id=thread_id)
        if thread.running is not None:
            running_id = thread.running.turn.id
            raise TurnAlreadyRunningError(
                f"turn {running_id!r} of thread {thread_id!r} is still running",
                turn_id=running_id,
            )
        choice = sampling.tool_choice if sampling is not None else None
        if isinstance(choice, dict) and choice.get("name") not in {t.name for t in thread.tools}:
            raise InvalidSamplingError(
                f"tool_choice names {choice.get('name')!r}, which is not a tool of the thread",
                field="tool_choice",
            )
        turn_id = f"turn_{uuid.uuid4().hex}"
        items = [user_message(texts)]
        ordinal = thread.recorder.turn_started(turn_id, items, traceparent)
        thread.history.extend(items)
        turn = Turn(
            id=turn_id,
            thread_id=thread_id,
            ordinal=ordinal,
            sampling=thread.sampling.overridden(sampling or Sampling()),
        )
        runner = TurnRunner(thread, turn, thread.provider or self._provider, self._settings)
        runner.start()
        thread.emit(turn_id, turn_started=agent_pb2.TurnStartedEvent(turn=turn.to_proto()))
        return turn

    async def interrupt(self, thread_id: str, turn_id: str, requested_by: str) -> Turn:
        """Stop the running turn; return once it has stopped, INTERRUPTED."""
        thread = self.thread(thread_id)
        if not turn_id:
            raise MissingTurnIdError("turn_id is required")
        turn = thread.turns.get(turn_id)
        if turn is None:
            # As every other RPC that names a turn says it (was: TURN_NOT_RUNNING).
            raise TurnNotFoundError(
                f"thread {thread_id!r} has no turn {turn_id!r}", turn_id=turn_id
            )
        if not turn.running:
            raise TurnNotRunningError(
                f"turn {turn_id!r} is no longer running in thread {thread_id!r}", turn_id=turn_id
            )
        runner = thread.running
        if runner is not None and runner.turn is turn:
            await runner.interrupt(requested_by)
        return turn

    def submit_tool_outputs(
        self,
        thread_id: str,
        turn_id: str,
        outputs: Sequence[SubmittedOutput],
        submitted_by: str,
    ) -> Turn:
        """Answer tool calls the running turn waits for; return the turn."""
        thread = self.thread(thread_id)
        if not turn_id:
            raise MissingTurnIdError("turn_id is required")
        turn = thread.turns.get(turn_id)
        if turn is None:
            raise TurnNotFoundError(
                f"thread {thread_id!r} has no turn {turn_id!r}", turn_id=turn_id
            )
        runner = thread.running
        if runner is None or runner.turn is not turn:
            raise TurnNotAwaitingToolOutputsError(
                f"turn {turn_id!r} is not waiting for tool outputs", turn_id=turn_id
            )
        runner.submit_tool_outputs(outputs, submitted_by)
        return turn

    async def close_thread(self, thread_id: str) -> Thread:
        """Interrupt a running turn, end the thread and its recording; idempotent."""
        thread = self.thread(thread_id)
        await self._close(
            thread, common_pb2.EXECUTION_STATUS_COMPLETED, CLOSE_REASON, CLOSE_REQUESTER
        )
        return thread

    async def shutdown(self) -> None:
        """Refuse new work, interrupt running turns, finish every open bundle."""
        self._stopping = True
        # They see the flag once their bundle exists, and finish it themselves.
        if self._starting:
            await asyncio.wait(self._starting)
        await asyncio.gather(
            *(
                self._close(
                    thread,
                    common_pb2.EXECUTION_STATUS_CANCELLED,
                    SHUTDOWN_REASON,
                    SHUTDOWN_REQUESTER,
                )
                for thread in list(self._threads.values())
            )
        )

    async def _close(
        self,
        thread: Thread,
        status: common_pb2.ExecutionStatus.ValueType,
        reason: str,
        requested_by: str,
    ) -> None:
        if thread.closing is None:
            thread.closing = asyncio.create_task(
                self._finish_thread(thread, status, reason, requested_by),
                name=f"close {thread.id}",
            )
        # The close goes on when the caller is cancelled; every caller sees the same end.
        await outlive_caller(thread.closing)

    async def _finish_thread(
        self,
        thread: Thread,
        status: common_pb2.ExecutionStatus.ValueType,
        reason: str,
        requested_by: str,
    ) -> None:
        branching = self._branching.get(thread.id)
        if branching is not None:
            # A branch is swapping the thread's bundle for its fork's: finish the one it ends
            # with (was: the old one, so the fork's stayed UNCLOSED and open for good).
            await asyncio.wait([branching])
        if thread.running is not None:
            await thread.running.interrupt(requested_by)
        await thread.recorder.finish(status, reason)
        thread.mark_closed()
        telemetry.thread_closed(
            thread.id, reason, turns=len(thread.turns), recording=thread.recorder.status
        )
        self._closed.append((time.monotonic(), thread.id))
        self._forget_closed()


def check_status_filter(status: int) -> None:
    """ListThreads' status filter: unset, or a ThreadStatus (an unknown number matched no
    thread, an empty list that said nothing of why)."""
    problem = unknown_enum(agent_pb2.ThreadStatus.DESCRIPTOR, status, "status")
    if problem:
        raise InvalidStatusFilterError(problem, field="status")


def _encode_page_token(last: Thread | RecordedSummary) -> str:
    # Threads in memory are paged by creation order, then recorded ones by bundle name.
    text = f"after:{last.seq}" if isinstance(last, Thread) else f"bundle:{last.bundle_name}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_page_token(token: str) -> tuple[int, str | None]:
    """(the last thread's seq in memory, the last recorded bundle's name or None)."""
    if not token:
        return 0, None
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        prefix, _, value = text.partition(":")
        if prefix == "after" and value.isdigit():
            return int(value), None
        if prefix == "bundle" and value:
            return 0, value
    except (ValueError, UnicodeDecodeError):
        pass
    raise InvalidPageTokenError("page_token is not one this server handed out")


def _check_thread_arguments(model: str, instructions: str, metadata: Mapping[str, str]) -> None:
    """Refuse what no provider accepts and what would bloat every request of the thread."""
    if len(model) > MAX_MODEL_CHARS or not model.isprintable():
        raise InvalidModelError(
            f"model must be at most {MAX_MODEL_CHARS} printable characters", model=model
        )
    size = len(instructions.encode())
    if size > MAX_INSTRUCTIONS_BYTES:
        raise InstructionsTooLargeError(
            f"instructions hold {size} bytes; the limit is {MAX_INSTRUCTIONS_BYTES}",
            limit=str(MAX_INSTRUCTIONS_BYTES),
        )
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise MetadataTooLargeError(
            f"metadata has {len(metadata)} entries; the limit is {MAX_METADATA_ENTRIES}"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise MetadataTooLargeError(
                f"metadata keys are limited to {MAX_METADATA_KEY_CHARS} characters and values "
                f"to {MAX_METADATA_VALUE_CHARS}",
                key=key,
            )
