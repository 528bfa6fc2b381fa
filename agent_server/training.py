"""What a thread asks for when its rollouts feed a trainer: tokens, sampling, policy version."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from agent_server.errors import InvalidSamplingError, unknown_enum
from rollout.agent.v1 import agent_pb2
from trace_reducer import LOGPROBS_INCLUDE

MAX_TOP_LOGPROBS = 20
# Request fields for token data that a provider may not know: asked for as the thread's
# policy says (`OptionalFieldPolicy`), never at the cost of a turn by surprise.
OPTIONAL_FIELDS = ("return_token_ids", "top_logprobs", "logprobs", "include")
MAX_POLICY_VERSION_CHARS = 256


@dataclass(frozen=True)
class Sampling:
    """Sampling settings and the policy version of a thread's requests (None: unset)."""

    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    policy_version: str = ""
    # `tool_choice` as the Responses API spells it ("auto", "none", "required", or
    # {"type": "function", "name": N}); None: the provider's default.
    tool_choice: str | dict[str, str] | None = None
    parallel_tool_calls: bool | None = None

    def overridden(self, other: Sampling) -> Sampling:
        """These settings with whatever `other` sets in their place (a turn's overrides)."""
        return replace(
            self,
            temperature=self.temperature if other.temperature is None else other.temperature,
            top_p=self.top_p if other.top_p is None else other.top_p,
            max_output_tokens=self.max_output_tokens
            if other.max_output_tokens is None
            else other.max_output_tokens,
            policy_version=other.policy_version or self.policy_version,
            tool_choice=self.tool_choice if other.tool_choice is None else other.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls
            if other.parallel_tool_calls is None
            else other.parallel_tool_calls,
        )


@dataclass(frozen=True)
class TokenCapture:
    """Which token data the thread's requests ask the provider for."""

    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: bool = False
    # A provider's refusal of one of these fails the turn (else the field is dropped).
    required: bool = False

    def without(self, refused: frozenset[str]) -> TokenCapture:
        """The capture once the provider refused the named request fields."""
        return replace(
            self,
            logprobs=self.logprobs and not refused & {"logprobs", "include"},
            top_logprobs=0
            if refused & {"top_logprobs", "logprobs", "include"}
            else self.top_logprobs,
            token_ids=self.token_ids and "return_token_ids" not in refused,
        )

    def request_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.logprobs or self.top_logprobs:
            fields["include"] = [LOGPROBS_INCLUDE]
        if self.top_logprobs:
            fields["top_logprobs"] = self.top_logprobs
        if self.token_ids:
            fields["return_token_ids"] = True
        return fields


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def sampling_from(
    request: agent_pb2.StartThreadRequest | agent_pb2.StartTurnRequest,
) -> Sampling:
    """The sampling settings a request sets; InvalidSamplingError names a bad one."""
    temperature = _optional(request, "temperature")
    top_p = _optional(request, "top_p")
    limit = _optional(request, "max_output_tokens")
    if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise InvalidSamplingError("temperature must be between 0 and 2", field="temperature")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidSamplingError("top_p must be above 0 and at most 1", field="top_p")
    if limit is not None and limit < 1:
        raise InvalidSamplingError(
            "max_output_tokens must be at least 1", field="max_output_tokens"
        )
    version = request.policy_version
    if len(version) > MAX_POLICY_VERSION_CHARS or not version.isprintable():
        raise InvalidSamplingError(
            f"policy_version must be at most {MAX_POLICY_VERSION_CHARS} printable characters",
            field="policy_version",
        )
    choice = _tool_choice(request.tool_choice) if request.HasField("tool_choice") else None
    parallel = _optional(request, "parallel_tool_calls")
    return Sampling(temperature, top_p, limit, version, choice, parallel)


_MODES = {
    agent_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    agent_pb2.TOOL_CHOICE_MODE_NONE: "none",
    agent_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


def _tool_choice(choice: agent_pb2.ToolChoice) -> str | dict[str, str] | None:
    problem = unknown_enum(agent_pb2.ToolChoiceMode.DESCRIPTOR, choice.mode, "tool_choice.mode")
    if problem:
        # Was: taken as unset, so the turn ran with the provider's default and no word.
        raise InvalidSamplingError(problem, field="tool_choice")
    if choice.mode == agent_pb2.TOOL_CHOICE_MODE_FUNCTION:
        if not choice.function_name:
            raise InvalidSamplingError(
                "tool_choice FUNCTION needs a function_name", field="tool_choice"
            )
        return {"type": "function", "name": choice.function_name}
    if choice.function_name:
        raise InvalidSamplingError(
            "tool_choice.function_name goes with mode FUNCTION only", field="tool_choice"
        )
    return _MODES.get(choice.mode)


def tool_choice_proto(choice: str | dict[str, str] | None) -> agent_pb2.ToolChoice | None:
    """A Responses `tool_choice` as GetThread shows it."""
    if choice is None:
        return None
    if isinstance(choice, dict):
        return agent_pb2.ToolChoice(
            mode=agent_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name=choice.get("name", "")
        )
    modes = {name: mode for mode, name in _MODES.items()}
    return agent_pb2.ToolChoice(mode=modes[choice])


def capture_from(request: agent_pb2.StartThreadRequest) -> TokenCapture:
    problem = unknown_enum(
        agent_pb2.OptionalFieldPolicy.DESCRIPTOR, request.optional_fields, "optional_fields"
    )
    if problem:
        # Was: best effort, whatever the client meant by the number.
        raise InvalidSamplingError(problem, field="optional_fields")
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidSamplingError(
            f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", field="top_logprobs"
        )
    return TokenCapture(
        logprobs=request.capture_logprobs or request.top_logprobs > 0,
        top_logprobs=request.top_logprobs,
        token_ids=request.request_token_ids,
        required=request.optional_fields == agent_pb2.OPTIONAL_FIELD_POLICY_REQUIRED,
    )


def request_fields(sampling: Sampling, capture: TokenCapture) -> dict[str, Any]:
    """What goes into a request body for these settings (nothing for what is unset)."""
    fields = capture.request_fields()
    if sampling.temperature is not None:
        fields["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        fields["top_p"] = sampling.top_p
    if sampling.max_output_tokens is not None:
        fields["max_output_tokens"] = sampling.max_output_tokens
    if sampling.tool_choice is not None:
        fields["tool_choice"] = sampling.tool_choice
    if sampling.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = sampling.parallel_tool_calls
    return fields


def fill_thread(thread: agent_pb2.Thread, sampling: Sampling, capture: TokenCapture) -> None:
    """The settings as GetThread shows them."""
    thread.capture_logprobs = capture.logprobs
    thread.top_logprobs = capture.top_logprobs
    thread.request_token_ids = capture.token_ids
    if sampling.temperature is not None:
        thread.temperature = sampling.temperature
    if sampling.top_p is not None:
        thread.top_p = sampling.top_p
    if sampling.max_output_tokens is not None:
        thread.max_output_tokens = sampling.max_output_tokens
    thread.policy_version = sampling.policy_version
    choice = tool_choice_proto(sampling.tool_choice)
    if choice is not None:
        thread.tool_choice.CopyFrom(choice)
    if sampling.parallel_tool_calls is not None:
        thread.parallel_tool_calls = sampling.parallel_tool_calls
    thread.optional_fields = (
        agent_pb2.OPTIONAL_FIELD_POLICY_REQUIRED
        if capture.required
        else agent_pb2.OPTIONAL_FIELD_POLICY_BEST_EFFORT
    )


def settings_from_request(
    envelope: dict[str, Any], policy_version: str
) -> tuple[Sampling, TokenCapture]:
    """The sampling settings and token capture a recorded request asked for (request_fields
    read back), with the policy version it was recorded with."""

    def number(name: str) -> float | None:
        value = envelope.get(name)
        return (
            float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )

    limit = envelope.get("max_output_tokens")
    include = envelope.get("include")
    top = envelope.get("top_logprobs")
    top_logprobs = top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0
    sampling = Sampling(
        temperature=number("temperature"),
        top_p=number("top_p"),
        max_output_tokens=limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        policy_version=policy_version,
    )
    capture = TokenCapture(
        logprobs=isinstance(include, list) and LOGPROBS_INCLUDE in include,
        top_logprobs=min(top_logprobs, MAX_TOP_LOGPROBS),
        token_ids=envelope.get("return_token_ids") is True,
    )
    return sampling, capture
