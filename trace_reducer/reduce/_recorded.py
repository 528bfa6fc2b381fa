"""Recorded inference calls: what each call sent and the provider stream it got, for replay."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.trace.v1 import common_pb2, record_pb2, state_pb2

from ..bundle._bulk import DeltaRun
from ..bundle._confine import BundleRoot
from ..bundle._discover import no_bundles_there, walk_bundles
from ..bundle._errors import BundleError, BundleNotFoundError, PayloadError
from ..bundle._integrity import require_reducible
from ..bundle._layout import TRACE_FILE_NAME
from ..bundle._payloads import PayloadStore
from ..bundle._reader import BundleReader, Item, read_bundle, why_not_a_bundle
from ._forks import BundleForkResolver
from ._parents import ParentBundle, fork_payload
from ._replay import replay_reader
from ._requests import compose_request

# The bodies of a call's provider stream, as the agent recorded them in arrival order.
STREAM_BODIES = frozenset(
    {
        "response_created",
        "prompt_tokens",
        "output_item_added",
        "output_text_delta",
        "output_item_done",
        "provider_event",
    }
)


@dataclass
class RecordedCall:
    """One inference call (one attempt) of a recorded thread."""

    inference_call_id: str
    thread_id: str
    turn_id: str
    attempt: int
    model: str
    # The provider dialect it spoke: "" or "responses" (the Responses API), or "chat".
    provider_api: str
    # The exact JSON body the agent sent: its envelope with `input` (or `messages`) set.
    request: dict[str, Any]
    # Microseconds from the bundle's start to the call's inference_started record.
    started_us: int
    # The provider stream as recorded, in order (bodies of STREAM_BODIES), with their times.
    records: list[record_pb2.TraceRecord] = field(default_factory=list)
    # How the call ended (RUNNING when the recording stops first).
    execution: state_pb2.Execution = field(default_factory=state_pb2.Execution)
    error: common_pb2.TraceError = field(default_factory=common_pb2.TraceError)
    end_reason: str = ""
    # The prompt as the engine's token ids, when it sent them.
    prompt_token_ids: list[int] = field(default_factory=list)
    # Payloads its records refer to (output items, large provider events), by id.
    payloads: dict[str, bytes] = field(default_factory=dict)

    def payload_json(self, payload_id: str) -> Any:
        return json.loads(self.payloads[payload_id])


@dataclass
class RecordedThread:
    """A bundle's root thread: its calls in the order they were made, and its reduced state."""

    bundle: Path
    thread_id: str
    calls: list[RecordedCall]
    trace: state_pb2.RolloutTrace
    # Every payload the bundle and its ancestors hold: what a fork of it may refer to.
    payload_ids: frozenset[str] = frozenset()


def bundle_paths(path: str | os.PathLike[str]) -> list[Path]:
    """The bundles a path names: itself (a bundle directory or its trace.binpb), else every
    bundle directory directly under it, in name (so creation) order.

    Raises BundleNotFoundError when there is none."""
    given = Path(path)
    if given.is_file() or (given / TRACE_FILE_NAME).is_file():
        return [given]
    if not given.is_dir() or os.path.lexists(given / TRACE_FILE_NAME):
        # What it is, or its trace.binpb, said without opening it (a FIFO was called missing).
        raise why_not_a_bundle(given)
    found = [Path(bundle.path) for bundle in walk_bundles(given, recursive=False)]
    if not found:
        raise BundleNotFoundError(no_bundles_there(given))
    return found


def read_recorded(path: str | os.PathLike[str]) -> Iterator[RecordedThread]:
    """Every bundle `path` names (bundle_paths), read and reduced in one pass each; those found
    under a root are opened without following a link, whatever was swapped in since."""
    bundles = bundle_paths(path)
    if bundles == [Path(path)]:
        yield read_recorded_thread(path)
        return
    root = BundleRoot(path)
    for bundle in bundles:
        confined = root.open(bundle.name)
        confined.release_directory()
        reader = BundleReader(bundle / TRACE_FILE_NAME, confined.trace)
        yield read_recorded_thread(bundle, reader=reader)


def group_repetitions(root: str | os.PathLike[str]) -> dict[str, int]:
    """The highest repetition index taken in each export-rl group by the bundles directly
    under root: a fork's from its thread_forked record, a thread that is no fork 0 of its own
    group (its thread id). Each bundle is opened through the confined root and read only up
    to its thread_forked or thread_started record; one that cannot be read is passed over."""
    taken: dict[str, int] = {}
    bundles = BundleRoot(root)
    for found in walk_bundles(root, recursive=False):
        group, repetition = "", 0
        try:
            with bundles.open(found.name) as confined, confined.reader() as reader:
                for record in reader:
                    body = record.WhichOneof("body")
                    if body == "thread_forked":
                        forked = record.thread_forked
                        group, repetition = forked.group_id, forked.repetition_index
                        break
                    if body == "thread_started":
                        group = record.thread_started.thread_id
                        break
                    if body == "footer":
                        break
        except (BundleError, OSError):
            continue
        if group:
            taken[group] = max(taken.get(group, 0), repetition)
    return taken


def read_recorded_thread(
    path: str | os.PathLike[str], *, reader: BundleReader | None = None
) -> RecordedThread:
    """One bundle read once: the reducer's state (forks resolved, rewards attached) and, from
    the same records, each inference call's request body and provider stream.

    Raises BundleError when path is not a bundle or its records do not fit together."""
    payloads = PayloadStore(budget=None)
    streams: dict[int, list[record_pb2.TraceRecord]] = {}
    started: dict[int, record_pb2.TraceRecord] = {}
    instructions: dict[str, str] = {}
    forked: list[record_pb2.ThreadForked] = []

    def observe(batch: list[Item]) -> None:
        for entry in batch:
            if isinstance(entry, DeltaRun):
                streams.setdefault(entry.call, []).extend(entry.records())
                continue
            body = entry.WhichOneof("body")
            if body == "payload":
                try:
                    payloads.add(entry.payload)
                except PayloadError:
                    continue
            elif body == "thread_forked":
                forked.append(entry.thread_forked)
            elif body == "thread_started":
                begun_thread = entry.thread_started
                instructions[begun_thread.thread_id] = begun_thread.instructions_payload_id
            elif body == "inference_started":
                started[entry.inference_started.call] = entry
            elif body in STREAM_BODIES:
                streams.setdefault(getattr(entry, body).call, []).append(entry)

    with reader or read_bundle(path) as reader:
        bundle_dir = reader.bundle_dir
        # Every byte of a parent: request bodies are rebuilt from its payloads.
        forks = BundleForkResolver(bundle_dir, every_payload=True)
        trace = replay_reader(reader, forks=forks, observe=observe)
    # A file without a header is no recorded run (was: a run of no calls, so `diff` compared
    # any file with a bundle); a damaged one replays what it holds.
    require_reducible(trace.integrity, salvage=True, source=str(path))
    # The resolver reduced a fork's parent once, during the pass; this is that parent again.
    parent: ParentBundle | None = forks.resolve(forked[0]) if forked else None

    def payload(pid: str) -> bytes:
        try:
            return fork_payload(payloads, parent, pid)
        except PayloadError:
            if trace.integrity.fork_unresolved and forked:
                # The fork's requests are made of its parent's payloads: say which parent, and
                # that it is looked for beside the fork (was: "payload <id> is missing" alone).
                origin = forked[0]
                raise BundleError(
                    f"{path}: its requests refer to its parent's payloads, and its parent "
                    f"(thread {origin.parent_thread_id}, bundle "
                    f"{origin.parent_bundle or '(unrecorded)'}) is not beside it, or not whole: "
                    "put the parent bundle in the same directory"
                ) from None
            raise BundleError(f"{path}: payload {pid} is missing") from None

    # Each payload parsed once: a conversation re-sends its whole history with every request,
    # and the calls share the items they have in common (never changed after this).
    parsed: dict[str, Any] = {}

    def item(pid: str) -> Any:
        found = parsed.get(pid)
        if found is None:
            found = parsed[pid] = json.loads(payload(pid))
        return found

    calls: list[RecordedCall] = []
    for ordinal, record in sorted(started.items()):
        begun = record.inference_started
        state = trace.inference_calls.get(begun.inference_call_id)
        if state is None:
            continue
        try:
            instructions_id = instructions.get(state.thread_id, "")
            request = compose_request(
                json.loads(payload(state.request_envelope_payload_id)),
                [item(pid) for pid in state.input_payload_ids],
                provider_api=begun.provider_api,
                instructions=payload(instructions_id).decode() if instructions_id else "",
                input_as_string=begun.input_as_string,
            )
        except (ValueError, RecursionError) as error:
            # A payload the reducer kept opaque (nested past any parser) cannot be sent again.
            problem = "a payload is nested too deep" if isinstance(error, RecursionError) else error
            raise BundleError(f"{path}: call {begun.inference_call_id}: {problem}") from error
        call = RecordedCall(
            inference_call_id=begun.inference_call_id,
            thread_id=state.thread_id,
            turn_id=state.turn_id,
            attempt=state.attempt,
            model=state.model,
            provider_api=begun.provider_api,
            request=request,
            started_us=record.time_us,
            records=streams.get(ordinal, []),
            execution=state.execution,
            error=state.error,
            end_reason=state.end_reason,
            prompt_token_ids=list(state.prompt_token_ids),
        )
        for stream_record in call.records:
            kind = stream_record.WhichOneof("body")
            pid = (
                stream_record.output_item_done.item_payload_id
                if kind == "output_item_done"
                else stream_record.provider_event.data_payload_id
                if kind == "provider_event"
                else ""
            )
            if pid:
                call.payloads[pid] = payload(pid)
        calls.append(call)
    return RecordedThread(
        bundle=bundle_dir,
        thread_id=trace.root_thread_id,
        calls=calls,
        trace=trace,
        payload_ids=payloads.ids() | (parent.payload_ids() if parent is not None else frozenset()),
    )
