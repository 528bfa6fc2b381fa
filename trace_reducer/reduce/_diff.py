"""Two recorded runs compared call by call: requests, accepted items, tool calls, tokens."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rollout.trace.v1 import common_pb2, state_pb2

from ..bundle._errors import BundleError
from ..bundle._integrity import integrity_name
from ..bundle._names import counted
from ._recorded import RecordedCall, RecordedThread, read_recorded_thread

# What a replay and `diff` set aside when comparing request bodies: fields a run may vary
# without the model seeing anything else (the model's name, so a run can be replayed or
# branched onto another model; the caller's bookkeeping) ...
REPLAY_IGNORED_FIELDS = ("model", "metadata", "user", "prompt_cache_key", "safety_identifier")
# ... and each input item's `id`, which providers and dialects assign afresh.
REPLAY_IGNORED_ITEM_FIELDS = ("id",)


def comparable_request(body: dict[str, Any]) -> dict[str, Any]:
    """A request body without the fields a replay sets aside (REPLAY_IGNORED_FIELDS), and with
    a string `input` as the one user message it stands for (the Responses API's short form:
    `"s"` and `[{"role": "user", "content": "s"}]` are one request)."""
    kept = {key: value for key, value in body.items() if key not in REPLAY_IGNORED_FIELDS}
    items = kept.get("input")
    if isinstance(items, str):
        kept["input"] = [{"content": items, "role": "user"}]
    elif isinstance(items, list):
        kept["input"] = [
            {k: v for k, v in item.items() if k not in REPLAY_IGNORED_ITEM_FIELDS}
            if isinstance(item, dict)
            else item
            for item in items
        ]
    return kept


def _clip(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def request_difference(recorded: Any, other: Any, path: str = "", *, whole: str = "body") -> str:
    """The first place two JSON values differ, in one line: `input[3].output: "a" vs "b"`.

    whole: what the values are called when they differ as a whole (a request `body`); ""
    says just how (`3 entries vs 4`), for a caller that has named them already."""
    if isinstance(recorded, dict) and isinstance(other, dict):
        for key in sorted(set(recorded) | set(other)):
            where = f"{path}.{key}" if path else key
            if key not in other:
                return f"{where}: {_clip(recorded[key])} vs absent"
            if key not in recorded:
                return f"{where}: absent vs {_clip(other[key])}"
            if recorded[key] != other[key]:
                return request_difference(recorded[key], other[key], where)
        return "identical"
    label = path or whole
    named = f"{label}: " if label else ""
    if isinstance(recorded, list) and isinstance(other, list):
        for index, (mine, theirs) in enumerate(zip(recorded, other, strict=False)):
            if mine != theirs:
                return request_difference(mine, theirs, f"{path}[{index}]")
        if len(recorded) != len(other):
            return f"{named}{counted(len(recorded), 'entry', 'entries')} vs {len(other)}"
        return "identical"
    if recorded == other:
        return "identical"
    return f"{named}{_clip(recorded)} vs {_clip(other)}"


def body_diff(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """A unified diff of two request bodies, pretty-printed with sorted keys."""
    import difflib  # only a differing pair needs it: not on every start-up of the CLI

    def lines(body: dict[str, Any]) -> list[str]:
        return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False).splitlines()

    return list(
        difflib.unified_diff(lines(a), lines(b), fromfile=names[0], tofile=names[1], lineterm="")
    )


def _status(value: int) -> str:
    return common_pb2.ExecutionStatus.Name(value).removeprefix("EXECUTION_STATUS_")  # type: ignore[arg-type]


def _item_view(item: state_pb2.ConversationItem) -> dict[str, Any]:
    """What a person compares in an accepted item: never its ids or times."""
    view: dict[str, Any] = {
        "kind": state_pb2.ItemKind.Name(item.kind),
        "role": state_pb2.ConversationRole.Name(item.role),
        "text": "".join(part.text for part in item.content),
    }
    for name in ("name", "arguments", "output"):
        if getattr(item, name):
            view[name] = getattr(item, name)
    return view


@dataclass
class CallView:
    """One call as the comparison sees it."""

    call: RecordedCall
    status: str
    accepted: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    tokens: dict[str, Any]


def _call_views(thread: RecordedThread) -> list[CallView]:
    trace = thread.trace
    tools_of: dict[str, list[state_pb2.ToolCall]] = {}
    for tool_call in trace.tool_calls.values():
        tools_of.setdefault(tool_call.requested_by_inference_call_id, []).append(tool_call)
    views = []
    for call in thread.calls:
        state = trace.inference_calls[call.inference_call_id]
        items = trace.conversation_items
        accepted = [_item_view(items[i]) for i in state.response_item_ids if i in items]
        tool_calls = []
        for tool_call in tools_of.get(call.inference_call_id, []):
            output = items.get(tool_call.output_item_id)
            tool_calls.append(
                {
                    "name": tool_call.name,
                    "status": _status(tool_call.execution.status),
                    "output": output.output if output is not None else None,
                }
            )
        tool_calls.sort(key=lambda entry: json.dumps(entry, sort_keys=True))
        out = state.output_tokens
        # None where the provider reported no usage: unknown, which 0 is not.
        reported = state.HasField("usage")
        tokens = {
            "input": state.usage.input_tokens if reported else None,
            "output": state.usage.output_tokens if reported else None,
            "prompt_ids": list(state.prompt_token_ids),
            "ids": list(out.ids),
            "logprobs": list(out.logprobs),
            "texts": list(out.texts),
            "top": [list(out.top_counts), list(out.top_texts), list(out.top_logprobs)],
        }
        views.append(
            CallView(
                call,
                _status(state.execution.status),
                accepted,
                tool_calls,
                tokens,
            )
        )
    return views


# How many forks deep a run's inherited calls are looked for (the fork resolver's own bound
# has already refused a deeper chain when it resolved the parents).
_MAX_FORK_DEPTH = 64


def _run_views(thread: RecordedThread, depth: int = 0) -> list[CallView]:
    """Every call of a run in its order: a fork's (or a replay branch's) starts with the calls
    it shares with its parent, so that call k of both is the same call of the conversation."""
    return _inherited_views(thread, depth) + _call_views(thread)


def _inherited_views(thread: RecordedThread, depth: int) -> list[CallView]:
    trace = thread.trace
    fork = trace.fork
    if not trace.HasField("fork") or not fork.resolved or not fork.after_turn_id:
        return []
    name = fork.parent_bundle
    if not name or os.sep in name or name in {".", ".."} or depth >= _MAX_FORK_DEPTH:
        raise BundleError(f"{thread.bundle}: its fork parent {name!r} cannot be compared")
    parent = read_recorded_thread(thread.bundle.parent / name)
    turn_ids = list(parent.trace.threads[parent.thread_id].turn_ids)
    if fork.after_turn_id not in turn_ids:
        return []
    # A thread's turns are its own (a fork's inherited ones are its parent's): what the parent
    # inherited comes first, then its own calls up to the turn forked after.
    shared = set(turn_ids[: turn_ids.index(fork.after_turn_id) + 1])
    own = [view for view in _call_views(parent) if view.call.turn_id in shared]
    return _inherited_views(parent, depth + 1) + own


@dataclass
class Difference:
    """The first call at which two runs differ."""

    # 1-based, in each thread's call order.
    number: int
    a: RecordedCall | None
    b: RecordedCall | None
    # What differs there: "request", "status", "accepted items", "tool calls", "tokens".
    aspects: list[str]
    # The first differing place of the request bodies, in one line ("identical" when equal).
    request: str
    request_diff: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)


@dataclass
class RunDiff:
    calls_a: int
    calls_b: int
    same_calls: int
    first: Difference | None
    # How each run's bundle ends when it is damaged: the comparison stops at the damage.
    damage_a: str = ""
    damage_b: str = ""


def diff_runs(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> RunDiff:
    """Compare two bundles' root threads call by call; the first difference, if any. A
    fork's calls start with those it shares with its parent (found beside it).

    Raises BundleError when either is not a readable bundle."""
    run_a, run_b = read_recorded_thread(a), read_recorded_thread(b)
    result = _compare(_run_views(run_a), _run_views(run_b))
    result.damage_a = _damage(run_a.trace.integrity)
    result.damage_b = _damage(run_b.trace.integrity)
    return result


def _damage(integrity: state_pb2.Integrity) -> str:
    if integrity.status not in (
        state_pb2.INTEGRITY_STATUS_CORRUPT,
        state_pb2.INTEGRITY_STATUS_TRUNCATED,
    ):
        return ""
    return (
        f"{integrity_name(integrity.status).lower()}: {integrity.detail}; only its "
        f"{integrity.records_read} records before the damage are compared"
    )


def _compare(views_a: list[CallView], views_b: list[CallView]) -> RunDiff:
    same = 0
    for number, (x, y) in enumerate(zip(views_a, views_b, strict=False), start=1):
        request_a = comparable_request(x.call.request)
        request_b = comparable_request(y.call.request)
        aspects, details = [], []
        if request_a != request_b:
            aspects.append("request")
        for aspect, left, right in (
            ("status", x.status, y.status),
            ("accepted items", x.accepted, y.accepted),
            ("tool calls", x.tool_calls, y.tool_calls),
            ("tokens", x.tokens, y.tokens),
        ):
            if left != right:
                aspects.append(aspect)
                details.append(f"{aspect}: {request_difference(left, right, whole='')}")
        if aspects:
            return RunDiff(
                len(views_a),
                len(views_b),
                same,
                Difference(
                    number,
                    x.call,
                    y.call,
                    aspects,
                    request_difference(request_a, request_b),
                    body_diff(request_a, request_b, ("A", "B")) if "request" in aspects else [],
                    details,
                ),
            )
        same += 1
    if len(views_a) != len(views_b):
        number = same + 1
        extra_a = views_a[same].call if len(views_a) > same else None
        extra_b = views_b[same].call if len(views_b) > same else None
        return RunDiff(
            len(views_a),
            len(views_b),
            same,
            Difference(number, extra_a, extra_b, ["calls"], "only one run has this call"),
        )
    return RunDiff(len(views_a), len(views_b), same, None)


def diff_report(result: RunDiff, a: str, b: str) -> list[str]:
    """The comparison as a person reads it (`diff` prints it, `view --diff` shows it): each
    run's size, the first differing call with what differs there, and a unified diff of the
    two request bodies when they differ (its lines last, from the one starting `--- A`)."""
    lines = [
        f"A: {a} ({counted(result.calls_a, 'call')})",
        f"B: {b} ({counted(result.calls_b, 'call')})",
    ]
    lines.extend(
        f"warning: {side} is {damage}"
        for side, damage in (("A", result.damage_a), ("B", result.damage_b))
        if damage
    )
    first = result.first
    if first is None:
        lines.append(f"no difference in {counted(result.same_calls, 'call')}")
        return lines
    if result.same_calls == 1:
        lines.append("call 1 is the same")
    elif result.same_calls:
        lines.append(f"calls 1-{result.same_calls} are the same")
    ids = " / ".join(call.inference_call_id if call else "-" for call in (first.a, first.b))
    lines.append(f"first difference at call {first.number} ({ids}): {', '.join(first.aspects)}")
    lines.append(f"  request: {first.request}")
    lines.extend(f"  {detail}" for detail in first.details)
    lines.extend(first.request_diff)
    return lines
