"""What the run page shows beyond the transcript: rewards, the fork tree, sampling settings,
policy version, stop reasons, drift, token logprobs and each call's place in time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import timestamp_pb2

from rollout.trace.v1 import common_pb2, state_pb2

__all__ = ["MAX_PAGE_TOKENS", "RunLinks", "rollout_extras"]

# Token columns of a page: beyond this many (over all calls) the logprob view stops.
MAX_PAGE_TOKENS = 50_000

# The links the page may show: hrefs chosen by whoever writes the page (the site, or None).
RunLinks = Mapping[str, Any]


def _ms(stamp: timestamp_pb2.Timestamp, base: timestamp_pb2.Timestamp) -> float | None:
    if stamp.seconds == 0 and stamp.nanos == 0:
        return None
    return (stamp.seconds - base.seconds) * 1000 + (stamp.nanos - base.nanos) / 1e6


def _sampling(call: state_pb2.InferenceCall) -> dict[str, Any]:
    settings = call.sampling
    found: dict[str, Any] = {}
    for name in ("temperature", "top_p", "max_output_tokens"):
        if settings.HasField(name):
            found[name] = getattr(settings, name)
    if settings.logprobs:
        found["logprobs"] = True
    if settings.top_logprobs:
        found["top_logprobs"] = settings.top_logprobs
    if settings.token_ids:
        found["token_ids"] = True
    return found


def _drift(call: state_pb2.InferenceCall) -> dict[str, Any] | None:
    """How the call's prompt ids continued the thread's held tokens, when it was checked."""
    if not call.token_drift:
        return None
    return {
        "check": common_pb2.TokenDrift.Name(call.token_drift).removeprefix("TOKEN_DRIFT_"),
        "position": call.drift_position,
        "held": call.held_token_count,
    }


def _stop(call: state_pb2.InferenceCall) -> str:
    if not call.stop_reason:
        return ""
    return common_pb2.StopReason.Name(call.stop_reason).removeprefix("STOP_REASON_").lower()


def _tokens(call: state_pb2.InferenceCall, budget: int) -> dict[str, Any] | None:
    tokens = call.output_tokens
    count = len(tokens.texts) or len(tokens.ids)
    if not count or not tokens.logprobs:
        return None
    shown = min(count, budget)
    return {
        "texts": list(tokens.texts[:shown]) if tokens.texts else [],
        "ids": list(tokens.ids[:shown]) if not tokens.texts else [],
        "logprobs": [round(value, 4) for value in tokens.logprobs[:shown]],
        "count": count,
        "exact": tokens.exact,
    }


def _reward(reward: state_pb2.Reward) -> dict[str, Any]:
    target = reward.target
    return {
        "name": reward.name,
        "value": reward.value,
        "weight": reward.weight,
        "source": reward.source,
        "thread": target.thread_id,
        "turn": target.turn_id,
        "item": target.item_id,
        "found": target.found,
        "recorded_by": reward.recorded_by,
        "metadata": dict(sorted(reward.metadata.items())),
    }


def _fork(trace: state_pb2.RolloutTrace) -> dict[str, Any] | None:
    if not trace.HasField("fork"):
        return None
    fork = trace.fork
    return {
        "parent_thread_id": fork.parent_thread_id,
        "parent_bundle": fork.parent_bundle,
        "after_turn_id": fork.after_turn_id,
        "group_id": fork.group_id,
        "repetition_index": fork.repetition_index,
        "resumed": fork.resumed,
        "resolved": fork.resolved,
        "shared_items": fork.shared_items,
        "ancestors": [
            {
                "thread_id": link.thread_id,
                "bundle": link.bundle,
                "parent_thread_id": link.parent_thread_id,
                "resumed": link.resumed,
                "group_id": link.group_id,
            }
            for link in fork.ancestors
        ],
    }


def rollout_extras(trace: state_pb2.RolloutTrace, links: RunLinks | None = None) -> dict[str, Any]:
    """The page data of the rollout panel; links: hrefs of related runs by thread id
    ({"runs": {thread_id: {"href", "status", "rewards", "group_id", "repetition_index",
    "parent_thread_id"}}}), as far as the writer of the page knows them."""
    base = trace.started_at
    calls: dict[str, Any] = {}
    budget = MAX_PAGE_TOKENS
    for call_id, call in trace.inference_calls.items():
        tokens = _tokens(call, budget)
        if tokens is not None:
            budget -= len(tokens["logprobs"])
        calls[call_id] = {
            "sampling": _sampling(call),
            "policy_version": call.policy_version,
            "stop_reason": _stop(call),
            "drift": _drift(call),
            "tokens": tokens,
        }
    tools = {
        tool_id: {
            "start": _ms(tool.execution.started_at, base),
            "end": _ms(tool.execution.ended_at, base),
        }
        for tool_id, tool in trace.tool_calls.items()
    }
    return {
        "rewards": [_reward(reward) for reward in trace.rewards],
        "fork": _fork(trace),
        "calls": calls,
        "tools": tools,
        "links": dict(links or {}),
    }
