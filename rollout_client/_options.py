"""The settings a call, a thread and a turn take, as typed keyword arguments, and the requests
they become (one place: the async client and the blocking facade both pass them through)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from rollout.agent.v1 import agent_pb2

from ._tools import Tool


class CallOptions(TypedDict, total=False):
    """`timeout`: seconds this call may take (None: no deadline); the client's when left out."""

    timeout: float | None


class TurnOptions(CallOptions, total=False):
    """A turn's sampling settings, overriding the thread's for this turn's requests."""

    temperature: float
    top_p: float
    max_output_tokens: int
    policy_version: str


class ThreadOptions(CallOptions, total=False):
    """A thread: its model (the server's default when empty), instructions, metadata, tools
    (FunctionTool messages or `function_tool` functions), what to record for training
    (`capture_logprobs`, `top_logprobs`, `request_token_ids`) and the sampling settings of
    every request (`temperature`, `top_p`, `max_output_tokens`, `policy_version`)."""

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
)
_TURN_FIELDS = ("temperature", "top_p", "max_output_tokens", "policy_version")


def start_thread_request(options: ThreadOptions) -> agent_pb2.StartThreadRequest:
    fields: dict[str, Any] = {name: options[name] for name in _THREAD_FIELDS if name in options}  # type: ignore[literal-required]
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
    return agent_pb2.StartTurnRequest(
        thread_id=thread_id, input=[agent_pb2.UserInput(text=text) for text in texts], **fields
    )
