"""The agent: the registry of threads and the operations the gRPC service exposes."""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence

from agent_server.config import Settings
from agent_server.errors import (
    EmptyInputError,
    InputTooLargeError,
    InstructionsTooLargeError,
    InvalidModelError,
    InvalidPageTokenError,
    MetadataTooLargeError,
    MissingThreadIdError,
    MissingTurnIdError,
    RecordingStartFailedError,
    ShuttingDownError,
    ThreadClosedError,
    ThreadNotFoundError,
    TurnAlreadyRunningError,
    TurnNotAwaitingToolOutputsError,
    TurnNotFoundError,
    TurnNotRunningError,
)
from agent_server.events import EventBuffer
from agent_server.provider import ProviderClient
from agent_server.recorder import Recorder
from agent_server.threads import Thread, Turn
from agent_server.tools import SubmittedOutput, Tool, parse_tools
from agent_server.turn import TurnRunner
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import RecordingError

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


def user_message(texts: Sequence[str]) -> dict[str, object]:
    """A turn's input as one Responses API user message, one input_text part per text."""
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text} for text in texts],
    }


class Agent:
    """Owns every thread of the server; each method is one client operation."""

    def __init__(self, settings: Settings, provider: ProviderClient) -> None:
        self._settings = settings
        self._provider = provider
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

    def check_serving(self) -> None:
        if self._stopping:
            raise ShuttingDownError()

    async def start_thread(
        self,
        model: str,
        instructions: str,
        metadata: Mapping[str, str],
        tools: Sequence[agent_pb2.FunctionTool] = (),
    ) -> Thread:
        self.check_serving()
        _check_thread_arguments(model, instructions, metadata)
        checked = parse_tools(tools)
        # A caller that gives up must not leave a bundle without its thread behind: the thread
        # is made anyway, and shutdown finishes its bundle like any other.
        starting = asyncio.create_task(self._start_thread(model, instructions, metadata, checked))
        self._starting.add(starting)
        starting.add_done_callback(self._starting.discard)
        return await asyncio.shield(starting)

    async def _start_thread(
        self,
        model: str,
        instructions: str,
        metadata: Mapping[str, str],
        tools: tuple[Tool, ...],
    ) -> Thread:
        thread_id = f"thread_{uuid.uuid4().hex}"
        model = model or self._settings.model
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
            tools=tools,
            events=EventBuffer(self._settings.event_buffer),
            seq=next(self._thread_seq),
        )
        self._threads[thread_id] = thread
        self._forget_closed()
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

    def list_threads(
        self, page_size: int, page_token: str, status: agent_pb2.ThreadStatus.ValueType
    ) -> tuple[list[Thread], str]:
        """One page of threads, oldest first, and the token of the next page ('' at the end)."""
        self.check_serving()
        self._forget_closed()
        after = _decode_page_token(page_token)
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        page: list[Thread] = []
        more = False
        for thread in self._threads.values():
            if thread.seq <= after:
                continue
            if status and thread.status != status:
                continue
            if len(page) == size:
                more = True
                break
            page.append(thread)
        return page, _encode_page_token(page[-1].seq) if more else ""

    def thread(self, thread_id: str) -> Thread:
        self.check_serving()
        if not thread_id:
            raise MissingThreadIdError("thread_id is required")
        self._forget_closed()
        thread = self._threads.get(thread_id)
        if thread is None:
            raise ThreadNotFoundError(f"no thread {thread_id!r}", thread_id=thread_id)
        return thread

    def start_turn(self, thread_id: str, texts: Sequence[str]) -> Turn:
        """Record and announce the turn, start its task, and return it IN_PROGRESS."""
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
        turn_id = f"turn_{uuid.uuid4().hex}"
        items = [user_message(texts)]
        ordinal = thread.recorder.turn_started(turn_id, items)
        thread.history.extend(items)
        turn = Turn(id=turn_id, thread_id=thread_id, ordinal=ordinal)
        runner = TurnRunner(thread, turn, self._provider, self._settings)
        runner.start()
        thread.emit(turn_id, turn_started=agent_pb2.TurnStartedEvent(turn=turn.to_proto()))
        return turn

    async def interrupt(self, thread_id: str, turn_id: str, requested_by: str) -> Turn:
        """Stop the running turn; return once it has stopped, INTERRUPTED."""
        thread = self.thread(thread_id)
        if not turn_id:
            raise MissingTurnIdError("turn_id is required")
        turn = thread.turns.get(turn_id)
        if turn is None or not turn.running:
            state = "is not a turn of" if turn is None else "is no longer running in"
            raise TurnNotRunningError(
                f"turn {turn_id!r} {state} thread {thread_id!r}", turn_id=turn_id
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
        await asyncio.shield(thread.closing)

    async def _finish_thread(
        self,
        thread: Thread,
        status: common_pb2.ExecutionStatus.ValueType,
        reason: str,
        requested_by: str,
    ) -> None:
        if thread.running is not None:
            await thread.running.interrupt(requested_by)
        await thread.recorder.finish(status, reason)
        thread.mark_closed()
        self._closed.append((time.monotonic(), thread.id))
        self._forget_closed()


def _encode_page_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"after:{seq}".encode()).decode().rstrip("=")


def _decode_page_token(token: str) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        prefix, _, value = text.partition(":")
        if prefix == "after" and value.isdigit():
            return int(value)
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
