"""Function tools on the client side: declaring them, and answering a turn's calls with handlers."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import inspect
import json
import types
import typing
from collections import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, overload

from rollout.agent.v1 import agent_pb2

from ._errors import RpcError

# A tool's implementation: called with the call's arguments (the JSON object the model wrote),
# it returns the output the model is shown (a string as it is, anything else as JSON). A plain
# function runs on the event loop; make it a coroutine function if it waits for anything.
ToolHandler = Callable[[dict[str, Any]], Awaitable[object] | object]
# Sends one output: (call_id, output, is_error).
Submit = Callable[[str, str, bool], Awaitable[object]]
# What run_turn(tools=...) takes: handlers by tool name, or `function_tool` functions.
ToolHandlers = Mapping[str, ToolHandler] | Sequence["Tool"]


class Tool:
    """A Python function offered to the model as a function tool (made by `function_tool`).

    Pass it in `start_thread(tools=[...])` for its definition and in `run_turn(tools=[...])` to
    answer the model's calls with it; it is still callable as the function it wraps.
    """

    def __init__(self, function: Callable[..., Any], definition: agent_pb2.FunctionTool) -> None:
        self.function = function
        self.definition = definition
        functools.update_wrapper(self, function)

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema of the arguments."""
        schema: dict[str, Any] = json.loads(self.definition.parameters_json)
        return schema

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    async def handle(self, arguments: dict[str, Any]) -> object:
        """Answer one call: the function called with the model's arguments by name."""
        result = self.function(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result

    def __repr__(self) -> str:
        return f"<Tool {self.name}>"


@overload
def function_tool(
    name: str,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
) -> agent_pb2.FunctionTool: ...
@overload
def function_tool(name: Callable[..., Any], /) -> Tool: ...
@overload
def function_tool(*, strict: bool = False) -> Callable[[Callable[..., Any]], Tool]: ...
def function_tool(
    name: str | Callable[..., Any] | None = None,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
) -> agent_pb2.FunctionTool | Tool | Callable[[Callable[..., Any]], Tool]:
    """A function tool, two ways.

    `function_tool(name, description, parameters)` is the FunctionTool message for
    start_thread(tools=[...]), parameters a JSON Schema object. As a decorator (`@function_tool`
    or `@function_tool(strict=True)`) on a function whose parameters are all annotated, it makes
    a Tool named after the function, described by its docstring's first part, with the JSON
    Schema of its parameters (each described by its entry under `Args:`); parameters without
    a default are required (with strict, every one is, as OpenAI's strict mode demands).
    """
    if callable(name):
        return _tool(name, strict=strict)
    if name is None:
        return functools.partial(_tool, strict=strict)
    return agent_pb2.FunctionTool(
        name=name,
        description=description,
        parameters_json=json.dumps(parameters) if parameters is not None else "",
        strict=strict,
    )


def _tool(function: Callable[..., Any], *, strict: bool) -> Tool:
    summary, documented = _docstring(inspect.getdoc(function) or "")
    hints = typing.get_type_hints(function, include_extras=True)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        where = f"function_tool {function.__name__}: parameter {parameter.name!r}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"{where}: *args and **kwargs cannot be described to a model")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise TypeError(f"{where}: the model passes arguments by name")
        if parameter.name not in hints:
            raise TypeError(f"{where} has no type annotation")
        schema = _schema(hints[parameter.name], where)
        if parameter.name in documented:
            schema.setdefault("description", documented[parameter.name])
        if parameter.default is not parameter.empty:
            with contextlib.suppress(TypeError, ValueError):
                json.dumps(parameter.default)
                schema.setdefault("default", parameter.default)
        properties[parameter.name] = schema
        if strict or parameter.default is parameter.empty:
            required.append(parameter.name)
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    definition = function_tool(function.__name__, summary, schema, strict=strict)
    return Tool(function, definition)


_JSON_TYPES: dict[object, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _schema(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON Schema of a type annotation."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if annotation is Any:
        return {}
    if origin is typing.Annotated:
        schema = _schema(arguments[0], where)
        notes = [note for note in arguments[1:] if isinstance(note, str)]
        if notes:
            schema["description"] = " ".join(notes)
        return schema
    if origin is typing.Literal:
        return {"enum": list(arguments)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [member.value for member in annotation]}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(argument, where) for argument in arguments]}
    if origin in (list, set, frozenset, abc.Sequence, abc.Set) or annotation in (list, set):
        items = _schema(arguments[0], where) if arguments else {}
        return {"type": "array", "items": items}
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return {"type": "array", "items": _schema(arguments[0], where)}
        return {
            "type": "array",
            "prefixItems": [_schema(argument, where) for argument in arguments],
            "minItems": len(arguments),
            "maxItems": len(arguments),
        }
    if origin in (dict, abc.Mapping) or annotation is dict:
        values = _schema(arguments[1], where) if len(arguments) == 2 else {}
        return {"type": "object", "additionalProperties": values}
    raise TypeError(f"{where}: {annotation!r} has no JSON Schema here")


_SECTIONS = ("args:", "arguments:", "parameters:", "returns:", "raises:", "yields:", "example:")


def _docstring(text: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's description (what comes before its first section) and the
    description of each parameter under `Args:`."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section = ""
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.lower() in _SECTIONS:
            section = stripped.lower()
            continue
        if not section:
            summary.append(line)
        elif section in ("args:", "arguments:", "parameters:") and stripped:
            head, colon, rest = stripped.partition(":")
            parameter = head.split(" ", 1)[0]
            if colon and not line.startswith((" " * 8, "\t\t")) and parameter.isidentifier():
                current = parameter
                described[current] = rest.strip()
            elif current:
                described[current] = f"{described[current]} {stripped}".strip()
    return "\n".join(summary).strip(), described


class ToolCalls:
    """Answers the tool_call_requested events of one turn with its handlers, each call in a
    task of its own; every output is submitted as soon as it is ready."""

    def __init__(self, handlers: ToolHandlers, submit: Submit) -> None:
        self._handlers = handlers_by_name(handlers)
        self._submit = submit
        self._arguments: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The first submission that failed for a reason other than the turn moving on.
        self.error: RpcError | None = None

    def observe(self, event: agent_pb2.ThreadEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "tool_call_arguments_delta":
            delta = event.tool_call_arguments_delta
            self._arguments.setdefault(delta.call_id, []).append(delta.delta)
        elif kind == "tool_call_requested":
            call = event.tool_call_requested
            streamed = "".join(self._arguments.pop(call.call_id, []))
            arguments = streamed if call.arguments_in_deltas else call.arguments
            task = asyncio.create_task(self._answer(call.call_id, call.name, arguments))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, call_id: str, name: str, arguments: str) -> None:
        output, is_error = await self._run(name, arguments)
        try:
            await self._submit(call_id, output, is_error)
        except RpcError as error:
            # The turn went on without this output (interrupted, timed out, closed): nothing
            # is waiting for it any more.
            if error.reason != "TURN_NOT_AWAITING_TOOL_OUTPUTS" and self.error is None:
                self.error = error

    async def _run(self, name: str, arguments: str) -> tuple[str, bool]:
        handler = self._handlers.get(name)
        if handler is None:
            return f"this client has no handler for the tool {name!r}", True
        try:
            parsed = json.loads(arguments or "{}")
        except ValueError as error:
            return f"the arguments are not valid JSON: {error}", True
        if not isinstance(parsed, dict):
            return "the arguments are not a JSON object", True
        try:
            result = handler(parsed)
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:  # noqa: BLE001 - a tool's failure is an output for the model
            return f"{type(error).__name__}: {error}", True
        if isinstance(result, str):
            return result, False
        try:
            return json.dumps(result), False
        except (TypeError, ValueError) as error:
            return f"the tool's result is not JSON: {error}", True

    async def aclose(self) -> None:
        """Cancel the handlers still running (the turn is over) and wait for them."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)


def handlers_by_name(tools: ToolHandlers) -> dict[str, ToolHandler]:
    if isinstance(tools, Mapping):
        return dict(tools)
    return {tool.name: tool.handle for tool in tools}
