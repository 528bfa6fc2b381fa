"""`export-rl`: one training sample per thread, with the engine's own tokens, loss masks,
logprobs, group, rewards and stop reason, in the shapes verl, SkyRL and ART load."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rollout.trace.v1 import common_pb2, record_pb2, state_pb2

from ..bundle._confine import open_found_trace, write_aside
from ..bundle._discover import no_bundles_there, walk_bundles
from ..bundle._errors import (
    BundleError,
    CorruptBundleError,
    ExportError,
    MissingExtraError,
    NotABundleError,
    not_reduced_reason,
)
from ..bundle._integrity import bundle_warning, integrity_name, require_reducible
from ..bundle._layout import TRACE_FILE_NAME
from ..bundle._names import KIND_WORDS, ROLE_WORDS, STOP_WORDS, rollout_group, rollout_outcome
from ..bundle._reader import BundleReader, resolve_trace_file
from ..bundle._rewards import mean_reward
from ..reduce._forks import BundleForkResolver, bundles_by_thread
from ..reduce._pass import reduce_reader
from ..reduce._pool import PoolEngine, run_chunks

FORMATS = ("jsonl", "verl", "skyrl", "art")
# The formats that hold token ids only, so only the samples with exact tokens.
PARQUET_FORMATS = ("verl", "skyrl")
FILE_NAMES = {
    "jsonl": "samples.jsonl",
    "verl": "verl.parquet",
    "skyrl": "skyrl.parquet",
    "art": "art.jsonl",
}
# The drift vocabulary of common_pb2.TokenDrift, the same words the reduced state uses.
EXACT, REALIGN, FORK = "EXACT", "REALIGN", "FORK"
_DRIFT_RANK = {EXACT: 0, REALIGN: 1, FORK: 2}
_FINISH = {
    common_pb2.STOP_REASON_COMPLETED: "stop",
    common_pb2.STOP_REASON_LENGTH: "length",
}


def stop_name(reason: common_pb2.StopReason.ValueType) -> str:
    """`completed`, `length`, `interrupted`, `provider_error`, `infra_error` ('' unknown)."""
    if not reason:
        return ""
    return STOP_WORDS.get(reason, "")


# -- finding and reducing bundles ---------------------------------------------------------------


def find_bundles(
    paths: Iterable[str | os.PathLike[str]],
    *,
    warn: Callable[[str], None] | None = None,
    irregular: bool = False,
) -> list[Path]:
    """Bundle directories: each path a bundle, or a trace root holding bundles (found as
    reduce-all finds them; a directory passed over on the way is said to `warn`; `irregular`:
    with the directories whose trace.binpb is a FIFO or a link, which reduce-all and `list`
    report as bundles that cannot be read)."""
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir() and not (path / TRACE_FILE_NAME).exists():
            inside = [
                Path(bundle.path) for bundle in walk_bundles(path, irregular=irregular, warn=warn)
            ]
            if not inside:
                raise NotABundleError(no_bundles_there(path))
            found.extend(inside)
        else:
            trace_file = resolve_trace_file(path)
            if trace_file.name != TRACE_FILE_NAME:
                # A bundle is its directory: a file of another name is not its trace.binpb
                # (was: the trace.binpb beside it was exported, or none found, exit 1).
                raise NotABundleError(
                    f"not a trace bundle: {path} is no {TRACE_FILE_NAME} (give its directory)"
                )
            found.append(trace_file.parent)
    unique: dict[Path, None] = {}
    for bundle in found:
        unique.setdefault(bundle.resolve(), None)
    return list(unique)


def _reduce_one(
    bundle: Path, resolver: BundleForkResolver, *, salvage: bool
) -> tuple[state_pb2.RolloutTrace, str]:
    """A bundle's reduced state (rewards attached) and its thread's instructions."""
    resolver.add_root(bundle.parent)
    instructions: dict[str, bytes] = {}

    def keep(record: record_pb2.TraceRecord) -> None:
        if (
            record.WhichOneof("body") == "payload"
            and record.payload.kind == record_pb2.PAYLOAD_KIND_INSTRUCTIONS
            and record.payload.chunk_count <= 1
        ):
            instructions[record.payload.payload_id] = record.payload.data

    # Opened as reduce-all opens a bundle it found: a trace.binpb that is a link or a FIFO
    # (planted, or swapped in since the walk) is a bundle that cannot be read, never followed.
    with BundleReader(bundle / TRACE_FILE_NAME, open_found_trace(bundle)) as reader:
        reduced = reduce_reader(reader, forks=resolver, on_record=keep)
    trace = reduced.trace
    require_reducible(trace.integrity, salvage=salvage, source=str(bundle))
    thread = trace.threads.get(trace.root_thread_id)
    pid = thread.instructions_payload_id if thread is not None else ""
    data = instructions.get(pid) if pid else None
    if pid and data is None and reduced.parent is not None:
        data = reduced.parent.payload(pid)
    return trace, (data or b"").decode("utf-8", "replace")


def _regular_trace(bundle: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(bundle / TRACE_FILE_NAME).st_mode)
    except OSError:
        return False


def _resolver(
    candidates: Sequence[str | os.PathLike[str]], by_thread: Mapping[str, Path] | None = None
) -> BundleForkResolver:
    # Forks resolve against the bundles given, the explicit parents and their siblings, each
    # parent reduced once (per resolver).
    return BundleForkResolver(None, list(candidates), every_payload=True, explicit_ids=by_thread)


def reduce_all(
    bundles: Sequence[Path], *, parents: Iterable[str | os.PathLike[str]] = (), salvage: bool
) -> list[tuple[Path, state_pb2.RolloutTrace, str]]:
    """Each bundle's reduced state (rewards attached) and its thread's instructions."""
    resolver = _resolver([*bundles, *parents])
    return [(bundle, *_reduce_one(bundle, resolver, salvage=salvage)) for bundle in bundles]


@dataclass(frozen=True)
class _Reduced:
    """What a worker sends back for one bundle: its sample's row in the format being written
    (None for a thread without inference calls, or without the exact tokens a Parquet format
    needs), what the summary counts of it, and the warning its integrity deserves. The row,
    not the sample: a sample holds its whole reduced state, which held for every bundle until
    the file was written was most of the export's memory (and sent back from a worker, most
    of its pickling)."""

    row: Any
    counted: _Counted | None
    warning: str
    # Why the bundle could not be reduced (then there is no row): it is left out of the file.
    unreduced: Unreduced | None = None


@dataclass(frozen=True)
class Unreduced:
    """A bundle export-rl could not reduce, so left out of the file, and why, in reduce-all's
    words: `corrupt` (`--salvage` exports its records before the damage), else failed (not a
    bundle, contradicting records, unreadable)."""

    bundle: str
    reason: str
    # For a corrupt bundle, where its bad frame is: `at byte 7105 (seq 25)`.
    corrupt_at: str = ""

    @property
    def corrupt(self) -> bool:
        return bool(self.corrupt_at)

    def __str__(self) -> str:
        # reduce-all's summary line for the same bundle.
        said = f"CORRUPT {self.corrupt_at}" if self.corrupt else "FAILED"
        return f"{said}: {self.bundle}: {self.reason}"


@dataclass(frozen=True)
class _Counted:
    """Of one sample, what Exported counts: its thread, whether its tokens are exact, and the
    inference calls whose prompts departed from the held tokens (0: no drift); and its group
    and fork parent, which tell a thread forked into a group of others (its prompt)."""

    thread_id: str
    exact: bool
    drifted_calls: int
    drifted: bool
    group_id: str = ""
    parent_thread_id: str = ""


def _reduce_and_sample(
    bundle: Path, resolver: BundleForkResolver, *, salvage: bool, fmt: str
) -> _Reduced:
    try:
        trace, instructions = _reduce_one(bundle, resolver, salvage=salvage)
    except CorruptBundleError as error:
        integrity = error.integrity
        where = f"at byte {integrity.bad_frame_offset} (seq {integrity.bad_frame_seq})"
        return _Reduced(None, None, "", Unreduced(str(bundle), integrity.detail, where))
    except Exception as error:  # noqa: BLE001 - one bad bundle never stops the export
        return _Reduced(None, None, "", Unreduced(str(bundle), not_reduced_reason(error)))
    warning = ""
    if trace.integrity.status != state_pb2.INTEGRITY_STATUS_CLEAN or trace.integrity.detail:
        warning = bundle_warning(
            trace.integrity.status, bundle.name, trace.integrity.detail or "exported what it holds"
        )
    sample = build_sample(bundle, trace, instructions)
    if sample is None:
        return _Reduced(None, None, warning)
    exact = sample.tokens == "exact"
    counted = _Counted(
        sample.thread_id,
        exact,
        len(sample.drift_events) if exact and sample.drift != EXACT else 0,
        exact and sample.drift != EXACT,
        sample.group_id,
        sample.trace.fork.parent_thread_id,
    )
    return _Reduced(_ROWS[fmt](sample), counted, warning)


# Each worker's copy of the bundles' thread index, set once by _start_worker.
_worker_by_thread: dict[str, Path] = {}


def _reduce_chunk(chunk: Sequence[Path], salvage: bool, fmt: str) -> list[_Reduced]:
    """A chunk of a worker process's share: its own resolver, so a parent is reduced once per
    chunk, over the thread index the worker was given once (was: every chunk read every
    bundle's header again, N/16 times N reads)."""
    resolver = _resolver((), _worker_by_thread)
    return [_reduce_and_sample(bundle, resolver, salvage=salvage, fmt=fmt) for bundle in chunk]


def _start_worker(by_thread: dict[str, Path]) -> None:
    _worker_by_thread.update(by_thread)


def _reduce_samples(
    bundles: Sequence[Path],
    parents: Iterable[str | os.PathLike[str]],
    *,
    salvage: bool,
    fmt: str,
    jobs: int,
    progress: Callable[[int], None] | None,
    warn: Callable[[str], None] | None,
) -> list[_Reduced]:
    """Every bundle reduced into its sample's row, in the order given, on `jobs` processes
    (reduce-all's pool: a worker that dies is replaced, the bundle it was on retried alone)."""
    candidates = [*bundles, *parents]
    # Every bundle's header read once, here, whatever the number of processes and chunks; a
    # trace.binpb that is a link is no bundle to resolve a fork against (it is reported).
    by_thread = bundles_by_thread([*filter(_regular_trace, bundles), *parents])
    if jobs <= 1 or len(bundles) <= 1:
        resolver = _resolver(candidates, by_thread)
        reduced = []
        for bundle in bundles:
            reduced.append(_reduce_and_sample(bundle, resolver, salvage=salvage, fmt=fmt))
            if progress is not None:
                progress(1)
        return reduced
    # Chunks small enough to keep every worker busy to the end and to move the progress.
    size = max(1, min(16, len(bundles) // (jobs * 8)))
    chunks = [list(bundles[start : start + size]) for start in range(0, len(bundles), size)]
    in_order: list[_Reduced] = []
    engine = PoolEngine(
        min(jobs, len(chunks)), _reduce_chunk, initializer=_start_worker, initargs=(by_thread,)
    )
    run_chunks(
        engine,
        chunks,
        (salvage, fmt),
        died=_worker_died,
        emit=in_order.append,
        advanced=(lambda done: progress(len(done))) if progress is not None else lambda _: None,
    )
    if engine.restarts and warn is not None:
        warn(engine.restarts_said())
    return in_order


def _worker_died(bundle: Path, error: BaseException) -> _Reduced:
    """The result of a bundle that kept killing the worker reducing it: left out, in the
    words reduce-all gives it."""
    reason = f"the worker died reducing it ({type(error).__name__}: {error})"
    return _Reduced(None, None, "", Unreduced(str(bundle), reason))


# -- one sample ---------------------------------------------------------------------------------


@dataclass
class Sample:
    """One thread as a trainer sees it."""

    bundle: str
    trace: state_pb2.RolloutTrace
    thread_id: str
    group_id: str
    repetition_index: int
    messages: list[dict[str, Any]]
    tokens: str  # "exact" or "absent"
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    prompt_length: int = 0
    drift: str = EXACT
    drift_events: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    stop_reason: str = ""
    # The rollout's outcome in `list`'s words (its last turn's status).
    status: str = ""
    policy_version: str = ""
    policy_versions: list[str] = field(default_factory=list)
    calls: list[state_pb2.InferenceCall] = field(default_factory=list)
    absent_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "thread_id": self.thread_id,
            "trace_id": self.trace.trace_id,
            "bundle": self.bundle,
            "group_id": self.group_id,
            "repetition_index": self.repetition_index,
            "parent_thread_id": self.trace.fork.parent_thread_id,
            "messages": self.messages,
            "tokens": self.tokens,
            "tokens_absent_reason": self.absent_reason,
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "prompt_length": self.prompt_length,
            "drift": self.drift,
            "drift_events": self.drift_events,
            "rewards": self.rewards,
            "reward": self.reward,
            "stop_reason": self.stop_reason,
            "status": self.status,
            "policy_version": self.policy_version,
            "policy_versions": self.policy_versions,
            "integrity": integrity_name(self.trace.integrity.status),
            "recording_complete": self.trace.recording_complete,
        }


def _thread_calls(trace: state_pb2.RolloutTrace, thread_id: str) -> list[state_pb2.InferenceCall]:
    thread = trace.threads[thread_id]
    calls = []
    for turn_id in thread.turn_ids:
        for call_id in trace.turns[turn_id].inference_call_ids:
            calls.append(trace.inference_calls[call_id])
    return calls


def _producer(item: state_pb2.ConversationItem) -> str:
    if item.HasField("inherited"):
        return "inherited"
    kinds = [ref.WhichOneof("producer") for ref in item.produced_by]
    if "inference" in kinds:
        return "model"
    if "tool" in kinds:
        return "tool"
    return "user"


def _message(item: state_pb2.ConversationItem) -> dict[str, Any]:
    message: dict[str, Any] = {
        "item_id": item.item_id,
        "responses_item_id": item.responses_item_id,
        "role": ROLE_WORDS.get(item.role, "user"),
        "kind": KIND_WORDS.get(item.kind, "unspecified"),
        "content": item.output
        if item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT
        else "".join(part.text for part in item.content),
        "turn_id": item.turn_id,
        "produced_by": _producer(item),
        # Model output of this thread is what a loss is taken on; a fork's inherited prefix
        # and every input are context.
        "loss_mask": 1 if _producer(item) == "model" else 0,
        "token_span": None,
    }
    if item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL:
        message.update(name=item.name, arguments=item.arguments, call_id=item.call_id)
    elif item.kind == state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT:
        message["call_id"] = item.call_id
    return message


def _number(value: float) -> float | None:
    """A recorded float as strict JSON can carry it: NaN and the infinities (a logprob the
    provider sent as `-1e999`, a value in a sidecar another tool wrote) become null."""
    return value if math.isfinite(value) else None


def _rewards(trace: state_pb2.RolloutTrace) -> tuple[list[dict[str, Any]], float | None]:
    rewards = []
    for reward in trace.rewards:
        rewards.append(
            {
                "name": reward.name,
                "value": _number(reward.value),
                "weight": _number(reward.weight),
                "source": reward.source,
                "metadata": dict(reward.metadata),
                "turn_id": reward.target.turn_id,
                "item_id": reward.target.item_id,
                "conversation_item_id": reward.target.conversation_item_id,
                "found": reward.target.found,
            }
        )
    return rewards, mean_reward(trace.rewards)


def _common_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    limit = min(len(held), len(prompt))
    index = 0
    while index < limit and held[index] == prompt[index]:
        index += 1
    return index


def build_sample(
    bundle: Path, trace: state_pb2.RolloutTrace, instructions: str = ""
) -> Sample | None:
    """The sample of a bundle's thread; None for a thread without inference calls."""
    thread_id = trace.root_thread_id
    if thread_id not in trace.threads:
        return None
    calls = _thread_calls(trace, thread_id)
    if not calls:
        return None
    thread = trace.threads[thread_id]
    messages = [_message(trace.conversation_items[i]) for i in thread.conversation_item_ids]
    if instructions:
        # The thread's instructions, as the system message they are to the model.
        messages.insert(
            0,
            {
                "item_id": "",
                "responses_item_id": "",
                "role": "system",
                "kind": "instructions",
                "content": instructions,
                "turn_id": "",
                "produced_by": "instructions",
                "loss_mask": 0,
                "token_span": None,
            },
        )
    rewards, reward = _rewards(trace)
    group_id, repetition_index = rollout_group(trace)
    versions = list(dict.fromkeys(call.policy_version for call in calls if call.policy_version))
    sample = Sample(
        bundle=bundle.name,
        trace=trace,
        thread_id=thread_id,
        group_id=group_id,
        repetition_index=repetition_index,
        messages=messages,
        tokens="absent",
        rewards=rewards,
        reward=reward,
        stop_reason=stop_name(calls[-1].stop_reason),
        status=rollout_outcome(trace),
        policy_version=calls[-1].policy_version,
        policy_versions=versions,
        calls=calls,
    )
    _fill_tokens(sample, calls, {m["item_id"]: m for m in messages if m["item_id"]})
    return sample


def _fill_tokens(
    sample: Sample, calls: list[state_pb2.InferenceCall], messages: dict[str, dict[str, Any]]
) -> None:
    """The flat sequence from the engine's own ids: each prompt as the engine saw it, each
    accepted output as it was sampled (mask 1); never re-tokenized. When a prompt does not
    extend the tokens held so far, the prompt wins from where they part (mask 0 there) and
    the sample records the drift."""
    used = [call for call in calls if call.response_item_ids or call.output_tokens.count]
    for call in used:
        if not call.prompt_token_ids:
            sample.absent_reason = f"inference call {call.inference_call_id} has no prompt ids"
            return
        if not call.output_tokens.exact:
            sample.absent_reason = (
                f"inference call {call.inference_call_id} has no exact output token ids"
            )
            return
    if not used:
        sample.absent_reason = "no inference call produced output"
        return
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    output_start = 0
    seen_items: set[str] = set()
    # An interrupted rollout ends in the output its last call was sampling when the client cut
    # it: never an item (no next prompt holds it), but the tokens the policy sampled, with
    # their logprobs, and what its reward was given for. They end the sequence (mask 1), so a
    # verl or SkyRL row has a response to take that reward on (was: empty); `stop_reason`
    # `interrupted` and `status` `cancelled` say how it ended.
    last = calls[-1]
    cut = last.stop_reason == common_pb2.STOP_REASON_INTERRUPTED
    for index, call in enumerate(used):
        prompt = list(call.prompt_token_ids)
        common = _common_prefix(ids, prompt)
        if ids and common < len(ids):
            kind = REALIGN if common >= output_start else FORK
            lost = sum(mask[common:])
            sample.drift_events.append(
                {
                    "call_index": index,
                    "inference_call_id": call.inference_call_id,
                    "kind": kind,
                    "position": common,
                    "held_tokens": len(ids),
                    "unmasked_tokens": lost,
                }
            )
            if _DRIFT_RANK[kind] > _DRIFT_RANK[sample.drift]:
                sample.drift = kind
            del ids[common:], mask[common:], logprobs[common:]
            for message in messages.values():
                span = message["token_span"]
                if span is not None and span[1] > common:
                    message["token_span"] = None
        start = len(ids)
        ids.extend(prompt[common:])
        mask.extend([0] * (len(prompt) - common))
        logprobs.extend([None] * (len(prompt) - common))
        # The request's new inputs arrived with the tokens just added.
        for item_id in call.request_item_ids:
            if item_id not in seen_items:
                seen_items.add(item_id)
                arrived = messages.get(item_id)
                if arrived is not None and len(ids) > start:
                    arrived["token_span"] = [start, len(ids)]
        output_start = len(ids)
        tokens = call.output_tokens
        for span in tokens.spans:
            if not span.item_id and not (cut and call.inference_call_id == last.inference_call_id):
                # Never completed, mid-thread: the next prompt does not have it.
                continue
            begin = len(ids)
            ids.extend(tokens.ids[span.start : span.start + span.count])
            mask.extend([1] * span.count)
            if tokens.logprobs:
                logprobs.extend(
                    _number(value)
                    for value in tokens.logprobs[span.start : span.start + span.count]
                )
            else:
                logprobs.extend([None] * span.count)
            seen_items.add(span.item_id)
            produced = messages.get(span.item_id)
            if produced is not None:
                produced["token_span"] = [begin, len(ids)]
    sample.tokens = "exact"
    sample.token_ids, sample.loss_mask, sample.logprobs = ids, mask, logprobs
    sample.prompt_length = mask.index(1) if 1 in mask else len(ids)


# -- formats ------------------------------------------------------------------------------------


def _floats(values: Sequence[float | None]) -> list[float]:
    return [0.0 if value is None else value for value in values]


def _extra(sample: Sample) -> str:
    return json.dumps(
        {
            "thread_id": sample.thread_id,
            "trace_id": sample.trace.trace_id,
            "bundle": sample.bundle,
            "repetition_index": sample.repetition_index,
            "parent_thread_id": sample.trace.fork.parent_thread_id,
            "stop_reason": sample.stop_reason,
            "status": sample.status,
            "policy_version": sample.policy_version,
            "drift": sample.drift,
            "drift_events": sample.drift_events,
            "rewards": sample.rewards,
            "messages": sample.messages,
        },
        ensure_ascii=False,
        sort_keys=True,
    )


def _verl_row(s: Sample) -> dict[str, Any] | None:
    if s.tokens != "exact":
        return None
    return {
        "uid": s.group_id,
        "prompt_ids": s.token_ids[: s.prompt_length],
        "response_ids": s.token_ids[s.prompt_length :],
        "response_mask": s.loss_mask[s.prompt_length :],
        "response_logprobs": _floats(s.logprobs[s.prompt_length :]),
        "reward_score": s.reward,
        "num_turns": len(s.messages),
        "extra_info": _extra(s),
    }


def _skyrl_row(s: Sample) -> dict[str, Any] | None:
    if s.tokens != "exact":
        return None
    return {
        "prompt_token_ids": s.token_ids[: s.prompt_length],
        "response_ids": s.token_ids[s.prompt_length :],
        "rewards": s.reward,
        "loss_masks": s.loss_mask[s.prompt_length :],
        "stop_reasons": s.stop_reason,
        "rollout_logprobs": _floats(s.logprobs[s.prompt_length :]),
        "trajectory_ids": {"instance_id": s.group_id, "repetition_id": s.repetition_index},
        "extra_info": _extra(s),
    }


def _choice_logprobs(call: state_pb2.InferenceCall, item_ids: set[str]) -> list[dict[str, Any]]:
    tokens = call.output_tokens
    if not tokens.logprobs:
        return []
    tops: list[int] = []
    running = 0
    for count in tokens.top_counts:
        tops.append(running)
        running += count
    content = []
    for span in tokens.spans:
        if span.item_id not in item_ids:
            continue
        for index in range(span.start, span.start + span.count):
            text = tokens.texts[index] if tokens.texts else ""
            entry: dict[str, Any] = {
                "token": text,
                "logprob": _number(tokens.logprobs[index]),
                "bytes": list(text.encode()),
                "top_logprobs": [],
            }
            if tokens.top_counts:
                first = tops[index]
                for alt in range(first, first + tokens.top_counts[index]):
                    alt_text = tokens.top_texts[alt]
                    entry["top_logprobs"].append(
                        {
                            "token": alt_text,
                            "logprob": _number(tokens.top_logprobs[alt]),
                            "bytes": list(alt_text.encode()),
                        }
                    )
            content.append(entry)
    return content


def _art_trajectory(sample: Sample) -> dict[str, Any]:
    """ART's Trajectory: plain messages for context, an OpenAI Choice (trainable) for each
    inference call's accepted output of this thread, with its logprobs."""
    trace = sample.trace
    by_call: dict[str, list[dict[str, Any]]] = {}

    def call_of(message: dict[str, Any]) -> str:
        if message["produced_by"] != "model":
            return ""
        item = trace.conversation_items[message["item_id"]]
        refs = [r.inference.inference_call_id for r in item.produced_by if r.HasField("inference")]
        return refs[0] if refs else ""

    for message in sample.messages:
        if call_of(message):
            by_call.setdefault(call_of(message), []).append(message)
    calls = {call.inference_call_id: call for call in sample.calls}
    out: list[dict[str, Any]] = []
    emitted: set[str] = set()
    for message in sample.messages:
        call_id = call_of(message)
        if call_id:
            if call_id in emitted:
                continue
            emitted.add(call_id)
            group = by_call[call_id]
            call = calls[call_id]
            texts = [m["content"] for m in group if m["kind"] == "message"]
            tool_calls = [
                {
                    "id": m["call_id"],
                    "type": "function",
                    "function": {"name": m["name"], "arguments": m["arguments"]},
                }
                for m in group
                if m["kind"] == "function_call"
            ]
            assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if tool_calls:
                assistant["tool_calls"] = tool_calls
            logprobs = _choice_logprobs(call, {m["item_id"] for m in group})
            out.append(
                {
                    "finish_reason": "tool_calls"
                    if tool_calls
                    else _FINISH.get(call.stop_reason, "stop"),
                    "index": 0,
                    "message": assistant,
                    "logprobs": {"content": logprobs} if logprobs else None,
                }
            )
        elif message["kind"] == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": message["call_id"], "content": message["content"]}
            )
        elif message["kind"] == "function_call":
            # An inherited call: context, as the assistant message that made it.
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": message["call_id"],
                            "type": "function",
                            "function": {
                                "name": message["name"],
                                "arguments": message["arguments"],
                            },
                        }
                    ],
                }
            )
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return {
        "messages_and_choices": out,
        "tools": None,
        "additional_histories": [],
        "reward": sample.reward if sample.reward is not None else 0.0,
        "metrics": {"reward_recorded": sample.reward is not None},
        "metadata": {
            "thread_id": sample.thread_id,
            "group_id": sample.group_id,
            "repetition_index": sample.repetition_index,
            "parent_thread_id": sample.trace.fork.parent_thread_id,
            "stop_reason": sample.stop_reason,
            "status": sample.status,
            "policy_version": sample.policy_version,
            "tokens": sample.tokens,
            "drift": sample.drift,
        },
        "logs": [],
    }


def _art_row(sample: Sample) -> dict[str, Any]:
    """A sample's ART trajectory, with what places it in its group."""
    return {
        "group_id": sample.group_id,
        "repetition_index": sample.repetition_index,
        "trajectory": _art_trajectory(sample),
    }


def _art_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ART's TrajectoryGroups: one per group, in the order groups first appear, each group's
    trajectories by repetition index."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
    return [
        {
            "trajectories": [
                m["trajectory"] for m in sorted(members, key=lambda m: m["repetition_index"])
            ],
            "exceptions": [],
            "metadata": {"group_id": group_id},
            "metrics": {},
            "logs": [],
        }
        for group_id, members in groups.items()
    ]


# Each format's row of one sample (None: the sample has no place in that format's file); a
# JSONL sample's row is its line, which is all of it the file needs.
_ROWS: dict[str, Callable[[Sample], Any]] = {
    "jsonl": lambda sample: _json_line(sample.to_json()),
    "art": _art_row,
    "verl": _verl_row,
    "skyrl": _skyrl_row,
}


def _columns(rows: list[dict[str, Any]], schema: Any) -> dict[str, list[Any]]:
    return {name: [row[name] for row in rows] for name in schema.names}


def _json_line(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False, sort_keys=True, allow_nan=False) + "\n").encode()


def _write_lines(path: Path, lines: Iterable[bytes]) -> None:
    def write(out: BinaryIO) -> None:
        for line in lines:
            out.write(line)

    write_aside(path, write)


def _write_parquet(path: Path, columns: dict[str, list[Any]], schema: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pydict(columns, schema=schema)
    write_aside(path, lambda out: pq.write_table(table, out))


def parquet_schema(fmt: str) -> Any:
    """The Arrow schema of a Parquet format's file (docs/training.md documents it)."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    floats = pa.list_(pa.float32())
    if fmt == "verl":
        return pa.schema(
            [
                ("uid", pa.string()),
                ("prompt_ids", ids),
                ("response_ids", ids),
                ("response_mask", ids),
                ("response_logprobs", floats),
                ("reward_score", pa.float64()),
                ("num_turns", pa.int64()),
                ("extra_info", pa.string()),
            ]
        )
    if fmt == "skyrl":
        return pa.schema(
            [
                ("prompt_token_ids", ids),
                ("response_ids", ids),
                ("rewards", pa.float64()),
                ("loss_masks", ids),
                ("stop_reasons", pa.string()),
                ("rollout_logprobs", floats),
                (
                    "trajectory_ids",
                    pa.struct([("instance_id", pa.string()), ("repetition_id", pa.int64())]),
                ),
                ("extra_info", pa.string()),
            ]
        )
    raise ValueError(f"{fmt} is not a Parquet format")


@dataclass(frozen=True)
class Exported:
    """What export_rl wrote."""

    path: Path
    samples: int
    exact: int
    skipped_threads: int
    left_out: list[str]
    warnings: list[str]
    # Samples with exact tokens whose prompts departed from the held tokens (REALIGN or FORK),
    # and how many inference calls did so: their ids stay the engine's, the departed stretch
    # masked out.
    drifted: int = 0
    drifted_calls: int = 0
    # The bundles that could not be reduced, in the order found: not in the file (the rest
    # are; the CLI exits 1, as reduce-all does).
    unreduced: list[Unreduced] = field(default_factory=list)
    # The threads forked into a group of others (see _group_prompts): not in a verl, SkyRL or
    # ART file, whose groups are their forks.
    group_prompts: list[str] = field(default_factory=list)


def _group_prompts(counts: Iterable[_Counted]) -> set[str]:
    """The threads that are the prompt of a GRPO group among these samples: no fork themselves
    (a group of one), and forked into a group they are not in. Their output is every fork's
    prompt (mask 0 there); a row of their own would be a group of one, whose GRPO advantage is
    its raw reward (verl: mean 0, std 1 for a lone sample), or nothing at all without a reward,
    so the formats that group (verl, SkyRL, ART) leave them out. A thread that is in its forks'
    group (the original of a `--replay-branch-at` branch: the group is its thread id) stays."""
    counts = list(counts)
    own = {c.thread_id: c.group_id for c in counts if not c.parent_thread_id}
    return {
        c.parent_thread_id
        for c in counts
        if c.parent_thread_id in own and c.group_id != own[c.parent_thread_id]
    }


def export_rl(
    paths: Iterable[str | os.PathLike[str]],
    *,
    fmt: str,
    out_dir: str | os.PathLike[str],
    parents: Iterable[str | os.PathLike[str]] = (),
    salvage: bool = False,
    jobs: int = 1,
    started: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Exported:
    """Write the samples of the bundles under `paths` in format `fmt` into out_dir.

    `jobs` processes reduce the bundles (the samples keep the order of the bundles either
    way); `started(total)` is called once the bundles are found and `progress(count)` as each
    `count` of them is reduced; `warn` is told of each directory under a root passed over
    (a name that is not UTF-8, one that cannot be listed) as it is found.

    A bundle that cannot be reduced (corrupt unless salvaging, contradicting records, a
    trace.binpb that cannot be read, or is a link or a FIFO under a root) is left out and
    listed in `Exported.unreduced`: one bad bundle never stops the export of the others.
    Raises BundleError for paths that hold no bundle, ExportError when the file cannot be
    written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    bundles = find_bundles(paths, warn=warn, irregular=True)
    if started is not None:
        started(len(bundles))
    schema = None
    if fmt in PARQUET_FORMATS:
        try:
            schema = parquet_schema(fmt)
        except ImportError as error:
            raise MissingExtraError(f"--format {fmt}", "training", error.name) from error
    warnings: list[str] = []
    # Each sample's count and its row (None: no place in the format's file).
    samples: list[tuple[_Counted, Any]] = []
    unreduced: list[Unreduced] = []
    skipped = 0
    for reduced in _reduce_samples(
        bundles, parents, salvage=salvage, fmt=fmt, jobs=jobs, progress=progress, warn=warn
    ):
        if reduced.unreduced is not None:
            unreduced.append(reduced.unreduced)
            continue
        if reduced.warning:
            warnings.append(reduced.warning)
        if reduced.counted is None:
            skipped += 1
            continue
        samples.append((reduced.counted, reduced.row))
    counts = [counted for counted, _ in samples]
    prompts = _group_prompts(counts) if fmt != "jsonl" else set()
    rows = [row for counted, row in samples if row is not None and counted.thread_id not in prompts]
    del samples
    target_dir = Path(out_dir)
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExportError(f"cannot create {target_dir}: {error.strerror}") from error
    target = target_dir / FILE_NAMES[fmt]
    # Only the Parquet formats need exact tokens; JSONL and ART keep every sample.
    left_out = (
        [c.thread_id for c in counts if not c.exact and c.thread_id not in prompts]
        if schema is not None
        else []
    )
    try:
        if fmt == "jsonl":
            _write_lines(target, rows)
        elif fmt == "art":
            _write_lines(target, map(_json_line, _art_groups(rows)))
        else:
            _write_parquet(target, _columns(rows, schema), schema)
    except OSError as error:
        raise ExportError(f"cannot write {target}: {error.strerror or error}") from error
    # What the summary counts is of the samples in the file's place: a group's prompt is not.
    kept = [c for c in counts if c.thread_id not in prompts]
    return Exported(
        target,
        len(counts),
        sum(c.exact for c in kept),
        skipped,
        left_out,
        warnings,
        drifted=sum(c.drifted for c in kept),
        drifted_calls=sum(c.drifted_calls for c in kept),
        unreduced=unreduced,
        group_prompts=[c.thread_id for c in counts if c.thread_id in prompts],
    )


__all__ = ["FORMATS", "BundleError", "ExportError", "Exported", "Unreduced", "export_rl"]
