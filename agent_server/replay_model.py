"""The replay provider: a loopback Responses endpoint answering from recorded bundles."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent_server.chat_completions import DONE_DATA, DONE_EVENT
from agent_server.chat_completions import PATH as CHAT_PATH
from agent_server.config import DEFAULT_STREAM_IDLE_TIMEOUT, ConfigError, Settings
from agent_server.loopback_http import (
    MAX_BODY_BYTES,
    HttpRequest,
    HttpResponse,
    LoopbackHttpServer,
    posted_route,
    send_error,
)
from agent_server.provider import _endpoint, pooled_session, read_limited
from grpc_common import Redactor
from rollout.trace.v1 import common_pb2, record_pb2
from trace_reducer import (
    CHAT_API,
    REPLAY_IGNORED_FIELDS,
    BundleError,
    RecordedCall,
    RecordedThread,
    ReductionError,
    canonical_json,
    comparable_request,
    read_recorded,
    request_difference,
)
from trace_reducer.reduce import group_repetitions

log = logging.getLogger(__name__)

# The HTTP status and error code of a request no recorded call answers.
DIVERGENCE_STATUS = 409
DIVERGENCE_CODE = "replay_divergence"

_DELTA_EVENT_TYPES = {
    record_pb2.DELTA_KIND_UNSPECIFIED: "response.output_text.delta",
    record_pb2.DELTA_KIND_REFUSAL: "response.refusal.delta",
    record_pb2.DELTA_KIND_REASONING_SUMMARY: "response.reasoning_summary_text.delta",
    record_pb2.DELTA_KIND_FUNCTION_ARGUMENTS: "response.function_call_arguments.delta",
}
_CALL_HEADER = "x-rollout-inference-call-id"
_FORWARDED_HEADERS = ("authorization", _CALL_HEADER)


@dataclass(frozen=True)
class ReplayChunk:
    """Events the provider's stream brought at one moment (one record's time): (SSE event
    name, data); a name "" sends the data alone, as Chat Completions streams do."""

    offset_us: int
    events: list[tuple[str, str]]


@dataclass(frozen=True)
class ReplayScript:
    """How to answer one recorded call: a whole body (an HTTP error, or the answer to a
    request that did not ask for a stream), or a stream of chunks and its ending (`end`:
    "complete" ends the stream, "hold" keeps it open until the client leaves, as an
    interrupted or stalled stream did, "reset" drops the connection)."""

    chunks: list[ReplayChunk]
    end: str
    http_status: int = 0
    body: bytes = b""


def _event(event_type: str, fields: dict[str, Any]) -> tuple[str, str]:
    return event_type, json.dumps({"type": event_type, **fields}, separators=(",", ":"))


def _logprobs(tokens: common_pb2.DeltaTokens, text: str) -> list[dict[str, Any]]:
    """The Responses API's `logprobs` entries the recorded columns came from; ValueError when
    the alternatives' columns hold fewer than their counts say (a damaged record)."""
    texts = list(tokens.texts)
    if not texts:
        start = 0
        for length in tokens.text_lengths:
            texts.append(text[start : start + length])
            start += length
    if tokens.top_counts:
        listed = min(len(texts), len(tokens.logprobs))
        needed = sum(tokens.top_counts[:listed])
        columns = [len(tokens.top_texts), len(tokens.top_logprobs)]
        if tokens.top_ids:
            columns.append(len(tokens.top_ids))
        if min(columns) < needed:
            raise ValueError(f"its tokens count {needed} alternatives but hold {min(columns)}")
    entries: list[dict[str, Any]] = []
    top_at = 0
    for index, (token, logprob) in enumerate(zip(texts, tokens.logprobs, strict=False)):
        entry: dict[str, Any] = {"token": token, "logprob": logprob}
        if tokens.top_counts:
            count = tokens.top_counts[index] if index < len(tokens.top_counts) else 0
            alternatives = []
            for at in range(top_at, top_at + count):
                alternative: dict[str, Any] = {
                    "token": tokens.top_texts[at],
                    "logprob": tokens.top_logprobs[at],
                }
                if tokens.top_ids:
                    alternative["token_id"] = tokens.top_ids[at]
                alternatives.append(alternative)
            top_at += count
            entry["top_logprobs"] = alternatives
        entries.append(entry)
    return entries


def script_of(call: RecordedCall) -> ReplayScript:
    """The provider's answer to a recorded call, rebuilt from its records.

    The typed records are turned back into the Responses API events they were recorded from
    (every other event was kept verbatim); events recorded at one moment form one chunk.
    Raises BundleError naming the call when its records cannot be sent again (a delta of a
    kind this server does not know, token columns shorter than their counts, an output item
    that is no JSON or is nested past the parser): ReplayModel.from_settings asks for every
    call's script at start-up, so a damaged bundle is refused there, not mid-run."""
    try:
        return _script_of(call)
    except (ValueError, RecursionError) as error:
        problem = "a payload is nested too deep" if isinstance(error, RecursionError) else error
        raise BundleError(f"call {call.inference_call_id}: {problem}") from error


def _script_of(call: RecordedCall) -> ReplayScript:
    if call.error.http_status and not call.records:
        message = call.error.message
        prefix = f"provider answered HTTP {call.error.http_status}: "
        error_json = {
            "error": {
                "code": call.error.code,
                "message": message.removeprefix(prefix),
                "type": "replayed_error",
            }
        }
        return ReplayScript([], "complete", call.error.http_status, json.dumps(error_json).encode())
    whole = _whole_body(call)
    if whole is not None:
        return ReplayScript([], "complete", 200, whole)
    if call.provider_api == CHAT_API:
        return ReplayScript(_chat_chunks(call), _ending(call))
    done_items = {
        record.output_item_done.item: _output_item(call, record.output_item_done.item_payload_id)
        for record in call.records
        if record.WhichOneof("body") == "output_item_done"
    }
    added: dict[int, record_pb2.OutputItemAdded] = {}
    latest = 0
    chunks: list[ReplayChunk] = []
    after_text_done = False
    for record in call.records:
        kind = record.WhichOneof("body")
        events: list[tuple[str, str]] = []
        if kind == "response_created":
            response: dict[str, Any] = {
                "id": record.response_created.response_id,
                "object": "response",
                "status": "in_progress",
                "model": call.model,
            }
            if call.prompt_token_ids:
                response["prompt_token_ids"] = call.prompt_token_ids
            events.append(_event("response.created", {"response": response}))
        elif kind == "output_item_added":
            body = record.output_item_added
            added[body.item] = body
            latest = body.item
            item: dict[str, Any] = {"id": body.provider_item_id, "type": body.item_type}
            if body.role:
                item["role"] = body.role
            done = done_items.get(body.item)
            if body.item_type == "function_call":
                item["arguments"] = ""
                if isinstance(done, dict):
                    item.update({k: done[k] for k in ("call_id", "name") if k in done})
            elif body.item_type == "message":
                item["content"] = []
            item["status"] = "in_progress"
            if not body.provider_item_id:
                del item["id"]
            events.append(
                _event(
                    "response.output_item.added", {"output_index": body.output_index, "item": item}
                )
            )
        elif kind == "output_text_delta":
            body_delta = record.output_text_delta
            if after_text_done and not body_delta.delta:
                # The tokens of an `output_text.done` (replayed verbatim just before): the
                # agent records them again from that event.
                after_text_done = False
                continue
            target = added.get(body_delta.item or latest)
            fields: dict[str, Any] = {}
            if target is not None:
                if target.provider_item_id:
                    fields["item_id"] = target.provider_item_id
                fields["output_index"] = target.output_index
            if body_delta.kind == record_pb2.DELTA_KIND_UNSPECIFIED:
                fields["content_index"] = 0
            fields["delta"] = body_delta.delta
            if body_delta.HasField("tokens"):
                tokens = body_delta.tokens
                if tokens.ids:
                    fields["token_ids"] = list(tokens.ids)
                if tokens.logprobs:
                    fields["logprobs"] = _logprobs(tokens, body_delta.delta)
            event_type = _DELTA_EVENT_TYPES.get(body_delta.kind)
            if event_type is None:
                # proto3 keeps an enum number it does not know (a newer writer, or damage).
                raise ValueError(f"a delta of unknown kind {body_delta.kind}")
            events.append(_event(event_type, fields))
        elif kind == "output_item_done":
            body_done = record.output_item_done
            source = added.get(body_done.item)
            index = source.output_index if source is not None else 0
            events.append(
                _event(
                    "response.output_item.done",
                    {"output_index": index, "item": done_items[body_done.item]},
                )
            )
        elif kind == "provider_event":
            event = record.provider_event
            data = (
                call.payloads[event.data_payload_id].decode("utf-8", "replace")
                if event.data_payload_id
                else event.data
            )
            events.append((event.event_type, data))
            after_text_done = event.event_type == "response.output_text.done"
            if events:
                chunks = _add(chunks, call, record, events)
            continue
        after_text_done = False
        if events:
            chunks = _add(chunks, call, record, events)
    return ReplayScript(chunks, _ending(call))


def _output_item(call: RecordedCall, payload_id: str) -> Any:
    try:
        return call.payload_json(payload_id)
    except ValueError as error:
        raise ValueError(f"output item {payload_id} is no JSON: {error}") from error


# The event a whole (not streamed) answer is recorded as, verbatim (the gateway's records).
_WHOLE_EVENTS = {
    CHAT_API: frozenset({"chat.completion"}),
    "": frozenset({"response.completed", "response.failed", "response.incomplete"}),
}


def _whole_body(call: RecordedCall) -> bytes | None:
    """The recorded body of a call that asked for no stream; None for a streamed call."""
    if call.request.get("stream") is True:
        return None
    names = _WHOLE_EVENTS.get(call.provider_api if call.provider_api == CHAT_API else "")
    for record in reversed(call.records):
        if record.WhichOneof("body") != "provider_event":
            continue
        event = record.provider_event
        if names is not None and event.event_type in names:
            if event.data_payload_id:
                return call.payloads[event.data_payload_id]
            return event.data.encode()
    return None


def _chat_chunks(call: RecordedCall) -> list[ReplayChunk]:
    """A Chat Completions stream: every chunk was kept verbatim (the typed records beside
    them are what the agent made of them, and it makes them again)."""
    chunks: list[ReplayChunk] = []
    for record in call.records:
        if record.WhichOneof("body") != "provider_event":
            continue
        event = record.provider_event
        if event.event_type == DONE_EVENT:
            data = DONE_DATA
        elif event.data_payload_id:
            data = call.payloads[event.data_payload_id].decode("utf-8", "replace")
        else:
            data = event.data
        if not data:
            # An event the agent derived from the chunks: it came with no bytes of its own.
            continue
        _add(chunks, call, record, [("", data)])
    return chunks


def _add(
    chunks: list[ReplayChunk],
    call: RecordedCall,
    record: record_pb2.TraceRecord,
    events: list[tuple[str, str]],
) -> list[ReplayChunk]:
    offset = max(0, record.time_us - call.started_us)
    if chunks and chunks[-1].offset_us == offset:
        chunks[-1].events.extend(events)
    else:
        chunks.append(ReplayChunk(offset, events))
    return chunks


def _ending(call: RecordedCall) -> str:
    status = call.execution.status
    if status == common_pb2.EXECUTION_STATUS_COMPLETED:
        return "complete"
    if status == common_pb2.EXECUTION_STATUS_FAILED:
        code = call.error.code
        if code == "connection_error":
            return "reset"
        if code == "stream_idle_timeout":
            return "hold"
        return "complete"
    # Cancelled (interrupted, shut down) or never ended: the stream was still open.
    return "hold"


def _conversation(body: dict[str, Any]) -> Any:
    """What a request sends of the conversation: Responses' `input`, Chat's `messages`."""
    return body.get("input") if "input" in body else body.get("messages")


def _entries(body: dict[str, Any]) -> list[Any]:
    """The conversation's entries; none when it is no list (a number, an object: a request
    that diverges, described, not a TypeError)."""
    items = _conversation(body)
    return items if isinstance(items, list) else []


@dataclass
class _Cursor:
    """A recorded thread a replayed thread follows: the next of its calls to answer."""

    thread: RecordedThread
    position: int = 0
    # The next call's body as canonical JSON, made once per position.
    _expected: tuple[int, bytes] | None = None

    def expected(self) -> bytes | None:
        """The body the next call sent, as the agent encodes it; None past the last call."""
        calls = self.thread.calls
        if self.position >= len(calls):
            return None
        if self._expected is None or self._expected[0] != self.position:
            self._expected = (self.position, canonical_json(calls[self.position].request))
        return self._expected[1]


@dataclass(frozen=True)
class BranchPoint:
    """Where a branched thread forks from the recorded thread it replayed: after a turn of it
    (the one before the turn that holds the call --replay-branch-at names)."""

    thread: RecordedThread
    after_turn_id: str
    # The recorded turns the branch shares: 1 to the after turn.
    shared_turns: int
    # Its place in the recorded thread's export-rl group: the first one no run of the group
    # has taken (the recorded run is 0 when it was not forked; an earlier branch took 1).
    repetition_index: int = 1

    @property
    def group_id(self) -> str:
        """The recorded thread's export-rl group (its own id when it was not forked)."""
        return self.thread.trace.fork.group_id or self.thread.thread_id


@dataclass(frozen=True)
class Answer:
    """What a request gets: a recorded call's script, the live provider, or a divergence."""

    call: RecordedCall | None = None
    live: bool = False
    divergence: str = ""
    # An HTTP error for a request that is not one at all: (status, code, message).
    error: tuple[int, str, str] | None = None


class ReplayBook:
    """Matches each request to a recorded call: by the thread's call sequence and its body.

    A request continues the recorded thread whose next call sent the same body (apart from
    REPLAY_IGNORED_FIELDS), else starts following the first recorded thread not followed yet
    whose first call did. Replayed threads are told apart by their requests, so threads that
    sent identical requests may swap which recorded thread each follows.
    """

    def __init__(
        self,
        threads: Sequence[RecordedThread],
        *,
        on_divergence: str = "fail",
        branch_at: int = 0,
        repetitions: dict[str, int] | None = None,
    ) -> None:
        """repetitions: the highest repetition index each export-rl group has taken in the
        trace root the branches are recorded in (trace_reducer.reduce.group_repetitions)."""
        self._threads = [thread for thread in threads if thread.calls]
        self._on_divergence = on_divergence
        # The first call (1-based, in the thread's order) that goes live; 0: none.
        self._branch_at = branch_at
        self._cursors: list[_Cursor] = []
        self._claimed: set[int] = set()
        # Each recorded thread's first request as canonical JSON, once asked for.
        self._first: dict[int, bytes] = {}
        # The last input each live thread sent: its next request extends it.
        self._live_inputs: list[list[Any]] = []
        # With a branch point: the cursor each replayed call (by its call id header) moved.
        self._replayed_by: dict[str, _Cursor] = {}
        self._repetitions = dict(repetitions or {})
        # The repetition index given to the branch of each recorded thread (by its id), once.
        self._branch_repetition: dict[str, int] = {}
        # Requests answered, byte-identical to the recorded ones, and divergent.
        self.answered = 0
        self.byte_identical = 0
        self.diverged = 0

    def answer(self, raw: bytes, call_id: str = "") -> Answer:
        """The answer to a request body, as sent (call_id: the agent's id for the call)."""
        answer, cursor = self._answer(raw)
        if cursor is not None and answer.call is not None and self._branch_at and call_id:
            self._replayed_by[call_id] = cursor
        return answer

    def branch_point(self, call_id: str, turns_done: int) -> BranchPoint | None:
        """Where a thread whose latest call was call_id forks, when the turn it starts next
        (after turns_done turns) is the one that holds call --replay-branch-at of the recorded
        thread it replays; None for any other turn, or when call_id was not replayed."""
        cursor = self._replayed_by.get(call_id)
        if cursor is None:
            return None
        calls = cursor.thread.calls
        upcoming, branch = cursor.position, self._branch_at - 1
        if not upcoming <= branch < len(calls):
            return None
        turn_id = calls[upcoming].turn_id
        if calls[branch].turn_id != turn_id or calls[upcoming - 1].turn_id == turn_id:
            return None
        turn_ids = list(cursor.thread.trace.threads[cursor.thread.thread_id].turn_ids)
        shared = turn_ids.index(turn_id) if turn_id in turn_ids else 0
        if shared != turns_done or shared < 1:
            return None
        return BranchPoint(
            cursor.thread, turn_ids[shared - 1], shared, self._repetition_for(cursor.thread)
        )

    def _repetition_for(self, thread: RecordedThread) -> int:
        """The next free repetition index of the thread's group, taken once per recorded
        thread (a branch that failed to start and is tried again keeps its index). Was 1
        always: a second branch of a run, or a branch of a fork whose group had a repetition
        1 already, gave export-rl two samples at one place of a group."""
        found = self._branch_repetition.get(thread.thread_id)
        if found is None:
            group = thread.trace.fork.group_id or thread.thread_id
            own = thread.trace.fork.repetition_index
            found = max(self._repetitions.get(group, 0), own) + 1
            self._repetitions[group] = found
            self._branch_repetition[thread.thread_id] = found
        return found

    def _answer(self, raw: bytes) -> tuple[Answer, _Cursor | None]:
        # The agent sends canonical JSON, and a recorded body re-encoded is byte for byte the
        # one it sent: when nothing was set aside, bytes decide, without parsing either.
        for cursor in self._cursors:
            if cursor.expected() == raw:
                self.byte_identical += 1
                return self._take(cursor, cursor.thread.calls[cursor.position].request), cursor
        for index, thread in enumerate(self._threads):
            if index not in self._claimed and self._first_bytes(index) == raw:
                self.byte_identical += 1
                return self._claim(index, thread.calls[0].request)
        too_deep = (400, "invalid_json", "the request body is nested too deep")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        except RecursionError:
            # The gateway passes its clients' bodies on: one nested past what json reads...
            return Answer(error=too_deep), None
        if not isinstance(body, dict):
            error = (400, "invalid_json", "the request body is not a JSON object")
            return Answer(error=error), None
        try:
            return self._answer_parsed(body)
        except RecursionError:
            # ...or just within it, past what comparing or describing it recurses through.
            return Answer(error=too_deep), None

    def _first_bytes(self, index: int) -> bytes:
        found = self._first.get(index)
        if found is None:
            found = self._first[index] = canonical_json(self._threads[index].calls[0].request)
        return found

    def _claim(self, index: int, body: dict[str, Any]) -> tuple[Answer, _Cursor]:
        self._claimed.add(index)
        cursor = _Cursor(self._threads[index])
        self._cursors.append(cursor)
        return self._take(cursor, body), cursor

    def _answer_parsed(self, body: dict[str, Any]) -> tuple[Answer, _Cursor | None]:
        wanted = comparable_request(body)
        for cursor in self._cursors:
            calls = cursor.thread.calls
            if (
                cursor.position < len(calls)
                and comparable_request(calls[cursor.position].request) == wanted
            ):
                return self._take(cursor, body), cursor
        for index, thread in enumerate(self._threads):
            if index not in self._claimed and comparable_request(thread.calls[0].request) == wanted:
                return self._claim(index, body)
        if self._continues_live(wanted):
            return Answer(live=True), None
        self.diverged += 1
        if self._on_divergence == "live":
            self._go_live(wanted)
            return Answer(live=True, divergence=self._describe(wanted)), None
        return Answer(divergence=self._describe(wanted)), None

    def _take(self, cursor: _Cursor, body: dict[str, Any]) -> Answer:
        cursor.position += 1
        if self._branch_at and cursor.position >= self._branch_at:
            cursor.position = len(cursor.thread.calls)
            self._go_live(comparable_request(body))
            return Answer(live=True)
        self.answered += 1
        return Answer(call=cursor.thread.calls[cursor.position - 1])

    def _go_live(self, wanted: dict[str, Any]) -> None:
        """A thread goes live from the request `wanted` (as comparable_request makes it)."""
        items = _conversation(wanted)
        self._live_inputs.append(list(items) if isinstance(items, list) else [])

    def _continues_live(self, wanted: dict[str, Any]) -> bool:
        """Whether the request `wanted` (as comparable_request makes it) extends the last
        input of a thread that went live, compared as recorded calls are."""
        items = _conversation(wanted)
        if not isinstance(items, list):
            return False
        for index, before in enumerate(self._live_inputs):
            if before and items[: len(before)] == before:
                self._live_inputs[index] = list(items)
                return True
        return False

    def _describe(self, wanted: dict[str, Any]) -> str:
        """The divergence in one line: the nearest recorded call and the first difference."""
        candidates = [
            (cursor.thread, cursor.position)
            for cursor in self._cursors
            if cursor.position < len(cursor.thread.calls)
        ] + [(thread, 0) for i, thread in enumerate(self._threads) if i not in self._claimed]
        if not candidates:
            return "the request matches no recorded call: every recorded call was answered"

        def shared(candidate: tuple[RecordedThread, int]) -> int:
            recorded = comparable_request(candidate[0].calls[candidate[1]].request)
            items, others = _entries(wanted), _entries(recorded)
            count = 0
            for mine, theirs in zip(items, others, strict=False):
                if mine != theirs:
                    break
                count += 1
            return count

        thread, position = max(candidates, key=shared)
        call = thread.calls[position]
        recorded_chat = call.provider_api == CHAT_API
        # The field only the other API sends, without the one this call's API sends.
        own, other = ("messages", "input") if recorded_chat else ("input", "messages")
        if other in wanted and own not in wanted:
            # The other API altogether: its first field differing ("input: [...] vs absent")
            # would not say so.
            names = {True: "Chat Completions", False: "Responses API"}
            return (
                f"the request is a {names[not recorded_chat]} one, and recorded call "
                f"{position + 1} of thread {thread.thread_id} ({call.inference_call_id}) was "
                f"a {names[recorded_chat]} one: replay in the API it was recorded in "
                f"(serve --provider-api {'chat' if recorded_chat else 'responses'})"
            )
        difference = request_difference(comparable_request(call.request), wanted)
        return (
            f"the request differs from recorded call {position + 1} of thread "
            f"{thread.thread_id} ({call.inference_call_id}): {difference}"
        )


# Forwarding to a live provider: a connection's wait, and the connections held at once.
_LIVE_CONNECT_TIMEOUT = 30.0
_LIVE_CONNECTIONS = 16


class ReplayModel:
    """Serves POST /responses and /chat/completions on 127.0.0.1 from a ReplayBook, paced
    as recorded or fast."""

    def __init__(self, book: ReplayBook, pace: str, live_url: str | None) -> None:
        self._book = book
        self._pace = pace
        self._live_url = live_url.rstrip("/") if live_url else None
        # What the live provider may echo of its URL's credentials, kept from what is relayed
        # (the agent's own redactor knows only this loopback URL and the key).
        self._redactor = Redactor(url=self._live_url)
        self._http: LoopbackHttpServer | None = None
        self._live: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def start(
        cls,
        book: ReplayBook,
        *,
        pace: str = "fast",
        live_url: str | None = None,
        idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
    ) -> ReplayModel:
        """idle_timeout: how long a live answer may go quiet (the agent's own provider
        setting, --stream-idle-timeout)."""
        model = cls(book, pace, live_url)
        if live_url:
            # The agent's provider transport; one connection is all a replay forwards on.
            model._live = pooled_session(idle_timeout, _LIVE_CONNECT_TIMEOUT, _LIVE_CONNECTIONS)
        model._http = await LoopbackHttpServer.start(model._handle)
        return model

    @classmethod
    async def from_settings(cls, settings: Settings) -> ReplayModel:
        """The replay provider over every bundle --replay-from names, read once at start-up;
        what diverges goes live to the provider URL (`serve`'s --provider-url, `gateway`'s
        --upstream). Raises ConfigError when the bundles cannot be read."""
        source = settings.replay_from
        assert source is not None
        try:
            threads = await asyncio.to_thread(_read_replayable, source)
        except (BundleError, ReductionError, OSError) as error:
            raise ConfigError(f"--replay-from: {error}") from error
        if not any(thread.calls for thread in threads):
            # Every request would be a divergence ("every recorded call was answered").
            raise ConfigError(f"--replay-from: no inference call to replay in {source}")
        longest = max(len(thread.calls) for thread in threads)
        if settings.replay_branch_at > longest:
            # No thread would reach the call: the whole run replayed, no branch, no word.
            raise ConfigError(
                f"--replay-branch-at {settings.replay_branch_at}: the recorded threads made at "
                f"most {longest} inference call{'s' if longest != 1 else ''}, so none would branch"
            )
        root = settings.trace_root
        if settings.replay_branch_at and root is not None:
            # A branch is recorded as a fork of its recorded run, which it finds beside itself.
            for thread in threads:
                if thread.bundle.resolve().parent != root.resolve():
                    raise ConfigError(
                        "--replay-branch-at records each branch as a fork of its recorded run, "
                        f"beside it: --trace-root must be the directory that holds {thread.bundle}"
                    )
        repetitions: dict[str, int] = {}
        if settings.replay_branch_at and root is not None:
            # The runs already in each group, earlier branches among them: a branch takes the
            # next place.
            try:
                repetitions = await asyncio.to_thread(group_repetitions, root)
            except OSError as error:
                raise ConfigError(f"--trace-root: {error}") from error
        book = ReplayBook(
            threads,
            on_divergence=settings.replay_on_divergence,
            branch_at=settings.replay_branch_at,
            repetitions=repetitions,
        )
        return await cls.start(
            book,
            pace=settings.replay_pace,
            live_url=settings.provider_url,
            idle_timeout=settings.stream_idle_timeout,
        )

    @property
    def url(self) -> str:
        assert self._http is not None
        return self._http.url

    @property
    def book(self) -> ReplayBook:
        return self._book

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
        if self._live is not None:
            await self._live.close()

    async def _handle(self, request: HttpRequest, response: HttpResponse) -> None:
        route = await posted_route(request, response, ("/responses", CHAT_PATH))
        if route is None:
            return
        async with self._lock:
            answer = self._book.answer(request.body, request.headers.get(_CALL_HEADER, ""))
        if answer.error is not None:
            await _replay_error(response, *answer.error)
            return
        if answer.divergence:
            log.warning("replay divergence: %s", answer.divergence)
        if answer.live:
            await self._forward(route, request, response)
        elif answer.call is None:
            await _replay_error(response, DIVERGENCE_STATUS, DIVERGENCE_CODE, answer.divergence)
        else:
            await self._play(script_of(answer.call), response)

    async def _play(self, script: ReplayScript, response: HttpResponse) -> None:
        if script.http_status:
            await response.send(script.http_status, script.body)
            return
        await response.start()
        began = time.monotonic()
        # A call the client interrupted (a held stream) keeps its recorded gaps between
        # chunks even at fast: the interrupt answered what the client saw, and its chunks sent
        # together reached it as one delta. A client that interrupts after so many deltas (the
        # demo's, after five) then never did, and the stream, held open until the interrupt,
        # never ended: the turn hung. At fast its first chunk still comes at once.
        paced = self._pace == "recorded" or script.end == "hold"
        skipped = 0 if self._pace == "recorded" or not script.chunks else script.chunks[0].offset_us
        for chunk in script.chunks:
            if paced:
                wait = began + (chunk.offset_us - skipped) / 1e6 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            # One `data:` line per line of the recorded data (a provider may have split an
            # event over several, which SSE joins with newlines): written as one line, all but
            # the first were no field at all, and the event's JSON arrived cut short.
            data = b"".join(_sse(event_type, data) for event_type, data in chunk.events)
            await response.write(data)
        if script.end == "reset":
            response.reset()
        elif script.end == "hold":
            await response.wait_disconnected()
            response.reset()

    async def _forward(self, route: str, request: HttpRequest, response: HttpResponse) -> None:
        """Pass the request to the live provider and its answer back, byte for byte."""
        if self._live is None or self._live_url is None:
            await _replay_error(
                response,
                DIVERGENCE_STATUS,
                DIVERGENCE_CODE,
                "the request goes to a live provider, but none was given",
            )
            return
        headers = {"Content-Type": "application/json"}
        headers.update({n: request.headers[n] for n in _FORWARDED_HEADERS if n in request.headers})
        # The route goes before the URL's query, and its user info becomes Basic auth, as for
        # the agent's own provider.
        url, basic = _endpoint(self._live_url, route)
        if basic is not None:
            headers["Authorization"] = basic
        redactor = self._redactor
        try:
            async with self._live.post(url, data=request.body, headers=headers) as upstream:
                content_type = upstream.headers.get("Content-Type", "application/json")
                if upstream.status != 200 or not content_type.startswith("text/event-stream"):
                    body = await read_limited(upstream, MAX_BODY_BYTES, errors=True)
                    await response.send(
                        upstream.status, redactor.data(body), content_type=content_type
                    )
                    return
                await response.start(content_type=content_type)
                async for data in redactor.chunks(upstream.content.iter_any()):
                    await response.write(data)
        except (aiohttp.ClientError, TimeoutError) as error:
            if response.started:
                response.reset()
                return
            await _replay_error(
                response, 502, "live_provider_unreachable", f"live provider: {type(error).__name__}"
            )


def _read_replayable(source: Path) -> list[RecordedThread]:
    """Every recorded thread under source, each call's answer rebuilt once to check it can be
    (then dropped: it is rebuilt when asked for). A call that cannot be is a BundleError
    naming its bundle; was a KeyError or IndexError when the request came, a traceback in the
    log and the turn FAILED with `internal_error`."""
    threads = list(read_recorded(source))
    for thread in threads:
        for call in thread.calls:
            try:
                script_of(call)
            except BundleError as error:
                raise BundleError(f"{thread.bundle}: {error}") from error
    return threads


async def _replay_error(response: HttpResponse, status: int, code: str, message: str) -> None:
    await send_error(response, status, code, message, "replay_error")


def _sse(event_type: str, data: str) -> bytes:
    lines = [f"event: {event_type}"] if event_type else []
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


__all__ = [
    "DIVERGENCE_CODE",
    "DIVERGENCE_STATUS",
    "REPLAY_IGNORED_FIELDS",
    "Answer",
    "BranchPoint",
    "ReplayBook",
    "ReplayModel",
    "ReplayScript",
    "script_of",
]
