"""The settings a call, a thread and a turn take, as typed keyword arguments, and the requests
they become (one place: the async client and the blocking facade both pass them through)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from rollout.agent.v1 import agent_pb2

from ._tools import Tool


class CallOptions(TypedDict, total=False):
    """`timeout`: seconds this call may take (None: no deadline); the client's when left out."""

    timeout: float | None


class ForkOptions(CallOptions, total=False):
    """ForkThread: the turn the new threads continue after (default: the thread's end) and
    the group they share (made up when empty)."""

    after_turn_id: str
    group_id: str


class RewardOptions(CallOptions, total=False):
    """RecordReward: the turn or item rewarded (neither: the whole thread), its weight, who
    gave it (`source`) and metadata."""

    turn_id: str
    item_id: str
    weight: float
    source: str
    metadata: Mapping[str, str]


# `tool_choice`: a ToolChoice message, or its mode by name ("auto", "none", "required").
ToolChoiceOption = agent_pb2.ToolChoice | Literal["auto", "none", "required"]


class TurnOptions(CallOptions, total=False):
    """A turn's sampling settings and tool choice, overriding the thread's for this turn."""

    temperature: float
    top_p: float
    max_output_tokens: int
    policy_version: str
    tool_choice: ToolChoiceOption
    parallel_tool_calls: bool


class ThreadOptions(CallOptions, total=False):
    """A thread: its model (the server's default when empty), instructions, metadata, tools
    (FunctionTool messages or `function_tool` functions) and whether the model must call them
    (`tool_choice`, `parallel_tool_calls`), the named provider its requests go to
    (`provider`), what to record for training (`capture_logprobs`, `top_logprobs`,
    `request_token_ids`, and with `optional_fields` what happens when a provider refuses
    them) and the sampling settings of every request (`temperature`, `top_p`,
    `max_output_tokens`, `policy_version`)."""

    model: str
    instructions: str
    metadata: Mapping[str, str]
    tools: Sequence[agent_pb2.FunctionTool | Tool]
    capture_logprobs: bool
    top_logprobs: int
    request_token_ids: bool
    temperature: float
    top_p: float
    max_output_tokens: int
    policy_version: str
    tool_choice: ToolChoiceOption
    parallel_tool_calls: bool
    provider: str
    optional_fields: agent_pb2.OptionalFieldPolicy.ValueType


# The request fields each option sets as it is; a new field of StartThreadRequest (tool_choice,
# say) is one more name here and in ThreadOptions.
_THREAD_FIELDS = (
    "model",
    "instructions",
    "capture_logprobs",
    "top_logprobs",
    "request_token_ids",
    "temperature",
    "top_p",
    "max_output_tokens",
    "policy_version",
    "parallel_tool_calls",
    "provider",
    "optional_fields",
)
_TURN_FIELDS = (
    "temperature",
    "top_p",
    "max_output_tokens",
    "policy_version",
    "parallel_tool_calls",
)
_TOOL_CHOICE_MODES = {
    "auto": agent_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": agent_pb2.TOOL_CHOICE_MODE_NONE,
    "required": agent_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _tool_choice(fields: dict[str, Any], options: ThreadOptions | TurnOptions) -> None:
    choice = options.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise ValueError(
                f"tool_choice must be one of {sorted(_TOOL_CHOICE_MODES)} or a ToolChoice"
            )
        choice = agent_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    fields["tool_choice"] = choice


def start_thread_request(options: ThreadOptions) -> agent_pb2.StartThreadRequest:
    fields: dict[str, Any] = {name: options[name] for name in _THREAD_FIELDS if name in options}  # type: ignore[literal-required]
    _tool_choice(fields, options)
    tools = [
        tool.definition if isinstance(tool, Tool) else tool for tool in options.get("tools", ())
    ]
    return agent_pb2.StartThreadRequest(
        metadata=dict(options.get("metadata") or {}), tools=tools, **fields
    )


def start_turn_request(
    thread_id: str, texts: Sequence[str], options: TurnOptions
) -> agent_pb2.StartTurnRequest:
    fields: dict[str, Any] = {name: options[name] for name in _TURN_FIELDS if name in options}  # type: ignore[literal-required]
    _tool_choice(fields, options)
    return agent_pb2.StartTurnRequest(
        thread_id=thread_id, input=[agent_pb2.UserInput(text=text) for text in texts], **fields
    )


def fork_thread_request(
    thread_id: str, count: int, options: ForkOptions
) -> agent_pb2.ForkThreadRequest:
    return agent_pb2.ForkThreadRequest(
        thread_id=thread_id,
        count=count,
        after_turn_id=options.get("after_turn_id", ""),
        group_id=options.get("group_id", ""),
    )


def record_reward_request(
    thread_id: str, name: str, value: float, options: RewardOptions
) -> agent_pb2.RecordRewardRequest:
    return agent_pb2.RecordRewardRequest(
        thread_id=thread_id,
        name=name,
        value=value,
        turn_id=options.get("turn_id", ""),
        item_id=options.get("item_id", ""),
        weight=options.get("weight", 0.0),
        source=options.get("source", ""),
        metadata=dict(options.get("metadata") or {}),
    )


def call_options(options: CallOptions) -> CallOptions:
    """Only the options of the call itself."""
    return {"timeout": options["timeout"]} if "timeout" in options else {}
