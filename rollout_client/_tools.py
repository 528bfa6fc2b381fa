"""Function tools on the client side: declaring them, and answering a turn's calls with handlers."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout.agent.v1 import agent_pb2

from ._errors import RpcError

# A tool's implementation: called with the call's arguments (the JSON object the model wrote),
# it returns the output the model is shown (a string as it is, anything else as JSON). A plain
# function runs on the event loop; make it a coroutine function if it waits for anything.
ToolHandler = Callable[[dict[str, Any]], Awaitable[object] | object]
# Sends one output: (call_id, output, is_error).
Submit = Callable[[str, str, bool], Awaitable[object]]


def function_tool(
    name: str,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
) -> agent_pb2.FunctionTool:
    """A FunctionTool for start_thread(tools=[...]); parameters is a JSON Schema object."""
    return agent_pb2.FunctionTool(
        name=name,
        description=description,
        parameters_json=json.dumps(parameters) if parameters is not None else "",
        strict=strict,
    )


class ToolCalls:
    """Answers the tool_call_requested events of one turn with its handlers, each call in a
    task of its own; every output is submitted as soon as it is ready."""

    def __init__(self, handlers: Mapping[str, ToolHandler], submit: Submit) -> None:
        self._handlers = dict(handlers)
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
