"""Function tools: declaring them on a thread, offering them to the model, and their calls."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from agent_server.errors import InvalidToolError
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import nested_deeper_than

MAX_TOOLS = 128
# Every request of the thread carries the tools: their text is bounded like the instructions.
MAX_TOOLS_BYTES = 1024 * 1024
MAX_TOOL_OUTPUT_BYTES = 1024 * 1024
# How deep a tool's parameters schema may nest. json reads a schema nested about as deep as
# Python recurses, but every request records it (json.dumps) a few levels further in: a
# schema nested ~975 deep was accepted, and then each turn of the thread failed with
# `internal error: RecursionError`. Real schemas nest a few levels; the model's arguments
# are read no deeper than agent_server.provider.MAX_EVENT_DEPTH either.
MAX_PARAMETERS_DEPTH = 64
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The Responses API wants an object schema; "no parameters" is the empty one.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolCallStatus: TypeAlias = agent_pb2.ToolCallStatus.ValueType

# How each ending of a tool call shows in the trace.
TRACE_STATUS: dict[ToolCallStatus, common_pb2.ExecutionStatus.ValueType] = {
    agent_pb2.TOOL_CALL_STATUS_PENDING: common_pb2.EXECUTION_STATUS_RUNNING,
    agent_pb2.TOOL_CALL_STATUS_COMPLETED: common_pb2.EXECUTION_STATUS_COMPLETED,
    agent_pb2.TOOL_CALL_STATUS_FAILED: common_pb2.EXECUTION_STATUS_FAILED,
    agent_pb2.TOOL_CALL_STATUS_CANCELLED: common_pb2.EXECUTION_STATUS_CANCELLED,
}


@dataclass(frozen=True)
class Tool:
    """One function tool of a thread, checked."""

    name: str
    description: str
    parameters_json: str
    parameters: dict[str, Any]
    strict: bool

    def request_entry(self) -> dict[str, Any]:
        """The tool as a Responses API request lists it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }

    def to_proto(self) -> agent_pb2.FunctionTool:
        return agent_pb2.FunctionTool(
            name=self.name,
            description=self.description,
            parameters_json=self.parameters_json,
            strict=self.strict,
        )


def parse_tools(declared: Sequence[agent_pb2.FunctionTool]) -> tuple[Tool, ...]:
    """Check a thread's tools; InvalidToolError names the first bad one and why."""
    if len(declared) > MAX_TOOLS:
        raise InvalidToolError(
            f"{len(declared)} tools declared; a thread has at most {MAX_TOOLS}",
            limit=str(MAX_TOOLS),
        )
    size = sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in declared)
    if size > MAX_TOOLS_BYTES:
        raise InvalidToolError(
            f"the tools hold {size} characters; the limit is {MAX_TOOLS_BYTES}",
            limit=str(MAX_TOOLS_BYTES),
        )
    tools: list[Tool] = []
    seen: set[str] = set()
    for position, tool in enumerate(declared):

        def refuse(
            reason: str, tool: agent_pb2.FunctionTool = tool, position: int = position
        ) -> InvalidToolError:
            label = f"tool {position} ({tool.name!r})" if tool.name else f"tool {position}"
            return InvalidToolError(f"{label}: {reason}", tool=tool.name, position=str(position))

        if not _NAME.fullmatch(tool.name):
            raise refuse("a name is 1 to 64 letters, digits, '_' or '-'")
        if tool.name in seen:
            raise refuse("another tool of the thread has this name")
        seen.add(tool.name)
        parameters = _NO_PARAMETERS
        if tool.parameters_json:
            too_deep = f"parameters_json nests deeper than {MAX_PARAMETERS_DEPTH} levels"
            try:
                # NaN and Infinity are Python's, not JSON's: a provider refuses the request.
                parsed = json.loads(tool.parameters_json, parse_constant=_not_json)
            except ValueError as error:
                raise refuse(f"parameters_json is not JSON: {error}") from error
            except RecursionError as error:
                raise refuse(too_deep) from error
            if not isinstance(parsed, dict):
                raise refuse("parameters_json must be a JSON Schema object")
            if nested_deeper_than(parsed, MAX_PARAMETERS_DEPTH):
                raise refuse(too_deep)
            parameters = parsed
        tools.append(
            Tool(tool.name, tool.description, tool.parameters_json, parameters, tool.strict)
        )
    return tuple(tools)


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON number")


@dataclass(frozen=True)
class SubmittedOutput:
    """One tool output as a client submitted it."""

    call_id: str
    output: str
    is_error: bool = False


def output_item(call_id: str, output: str) -> dict[str, Any]:
    """The `function_call_output` item a request sends back for a call."""
    return {"type": "function_call_output", "call_id": call_id, "output": output}


@dataclass
class ToolCall:
    """One function call of a turn: requested by the model, answered by a client (or not)."""

    ordinal: int
    tool_call_id: str
    call_id: str
    name: str
    item_id: str
    arguments: str
    # What the next request sends back for it, once there is something to send.
    output: dict[str, Any] | None = None
    is_error: bool = False
    # The call as clients see it, kept current as its status changes (and adopted by its
    # turn's view once it joins the turn): a turn of thousands of calls is shown without
    # building one message per call per answer.
    view: agent_pb2.TurnToolCall = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = agent_pb2.TurnToolCall(
            item_id=self.item_id,
            call_id=self.call_id,
            name=self.name,
            status=agent_pb2.TOOL_CALL_STATUS_PENDING,
        )

    @property
    def status(self) -> ToolCallStatus:
        return self.view.status

    @status.setter
    def status(self, status: ToolCallStatus) -> None:
        self.view.status = status

    @property
    def pending(self) -> bool:
        return self.view.status == agent_pb2.TOOL_CALL_STATUS_PENDING


def new_tool_call_id() -> str:
    return f"tool_{uuid.uuid4().hex}"


def tools_from_request(entries: object) -> tuple[Tool, ...]:
    """A recorded request's `tools` as the thread's tools again (its function tools, checked
    as when they were declared)."""
    declared = [
        agent_pb2.FunctionTool(
            name=str(entry.get("name", "")),
            description=str(entry.get("description") or ""),
            parameters_json=json.dumps(entry.get("parameters") or _NO_PARAMETERS),
            strict=bool(entry.get("strict")),
        )
        for entry in (entries if isinstance(entries, list) else [])
        if isinstance(entry, dict) and entry.get("type") == "function"
    ]
    return parse_tools(declared)
