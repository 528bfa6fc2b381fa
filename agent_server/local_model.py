"""The built-in offline Responses endpoint: deterministic replies and tool calls, streamed."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer

_Send = Callable[..., Awaitable[None]]

_QUOTE_WORDS = 12
_QUOTE_CHARS = 200
_CLOSING = (
    "This reply comes from the built-in local model, which runs offline on loopback.",
    "It streams one word at a time over the same Server-Sent Events protocol as the "
    "Responses API, so the real client code path runs.",
    "Every word you see was recorded in the trace bundle before it reached you.",
    "Interrupt the turn at any moment and the items already finished stay accepted.",
    "Close the thread to finish the recording, then reduce the bundle to see what happened.",
)


def last_user_text(input_items: Any) -> str:
    """The text of the last user message of a Responses API `input` array ('' when none)."""
    if not isinstance(input_items, list):
        return ""
    for item in reversed(input_items):
        if not isinstance(item, dict) or item.get("role") != "user":
            continue
        content = item.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return " ".join(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return ""


def tool_calls_for(tools: Any, input_items: Any) -> list[tuple[str, str]]:
    """The calls (name, JSON arguments) the local model makes: one per declared function tool
    that the last user message names, in the order named; none right after tool outputs.

    The arguments fill the tool's first string parameter with the user's text."""
    if not isinstance(tools, list) or not isinstance(input_items, list) or not input_items:
        return []
    last = input_items[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return []
    text = last_user_text(input_items)
    named: list[tuple[int, str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        name = tool.get("name")
        if not isinstance(name, str):
            continue
        match = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
        if match:
            named.append((match.start(), name, tool.get("parameters")))
    return [
        (name, json.dumps(_arguments(parameters, text))) for _, name, parameters in sorted(named)
    ]


def _arguments(parameters: Any, text: str) -> dict[str, Any]:
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if isinstance(properties, dict):
        for key, schema in properties.items():
            if isinstance(schema, dict) and schema.get("type") == "string":
                return {key: text}
    return {}


def reply_words_for(input_items: Any) -> list[str]:
    """The reply to a request: to the user's last message, or quoting the tool outputs that
    answered the calls of the previous response."""
    outputs = _trailing_tool_outputs(input_items)
    if not outputs:
        return reply_words(last_user_text(input_items))
    text = " ".join(f'The tool {name} returned: "{output}".' for name, output in outputs)
    words = text.split(" ")
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def _trailing_tool_outputs(input_items: Any) -> list[tuple[str, str]]:
    """(tool name, output) of the function_call_output items that end the input."""
    if not isinstance(input_items, list):
        return []
    names = {
        item.get("call_id"): item.get("name")
        for item in input_items
        if isinstance(item, dict) and item.get("type") == "function_call"
    }
    outputs: list[tuple[str, str]] = []
    for item in reversed(input_items):
        if not isinstance(item, dict) or item.get("type") != "function_call_output":
            break
        output = item.get("output")
        outputs.append((str(names.get(item.get("call_id"), "?")), str(output)[:_QUOTE_CHARS]))
    return outputs[::-1]


def reply_words(user_text: str) -> list[str]:
    """The deterministic reply to `user_text`, split into the deltas it is streamed as."""
    words = user_text.split()
    quote = " ".join(words[:_QUOTE_WORDS]) + (" ..." if len(words) > _QUOTE_WORDS else "")
    opening = f'You said: "{quote}".' if quote else "You said nothing."
    text_words = " ".join((opening, *_CLOSING)).split(" ")
    return [word if i == 0 else " " + word for i, word in enumerate(text_words)]


class LocalModel:
    """Serves POST /responses with `stream: true` on 127.0.0.1, like the Responses API."""

    def __init__(self, word_delay: float) -> None:
        self._word_delay = word_delay
        self._http: LoopbackHttpServer | None = None

    @classmethod
    async def start(cls, word_delay: float, port: int = 0) -> LocalModel:
        model = cls(word_delay)
        model._http = await LoopbackHttpServer.start(model._handle, port=port)
        return model

    @property
    def url(self) -> str:
        assert self._http is not None
        return self._http.url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()

    async def _handle(self, request: HttpRequest, response: HttpResponse) -> None:
        if request.method != "POST" or request.path.rstrip("/").split("?")[0] != "/responses":
            await _error(
                response, 404, "not_found", f"no route for {request.method} {request.path}"
            )
            return
        try:
            body = request.json()
        except ValueError:
            await _error(response, 400, "invalid_json", "the request body is not valid JSON")
            return
        if not isinstance(body, dict) or body.get("stream") is not True:
            await _error(response, 400, "invalid_request", "only `stream: true` is supported")
            return
        # The local model's idea of tokens: the request's words, counted on its bytes because
        # every request carries the whole history.
        await self._stream(response, body, len(request.body.split()))

    async def _stream(
        self, response: HttpResponse, body: dict[str, Any], input_tokens: int
    ) -> None:
        model = str(body.get("model", ""))
        response_id = f"resp_{uuid.uuid4().hex}"
        sequence = 0

        async def send(event_type: str, **fields: Any) -> None:
            nonlocal sequence
            sequence += 1
            await response.event(
                {"type": event_type, "sequence_number": sequence, **fields}, event=event_type
            )

        envelope = {"id": response_id, "object": "response", "model": model}
        await response.start()
        await send("response.created", response={**envelope, "status": "in_progress"})
        input_items = body.get("input")
        calls = tool_calls_for(body.get("tools"), input_items)
        if calls:
            output_tokens = await self._send_calls(send, calls)
        else:
            output_tokens = await self._send_message(send, reply_words_for(input_items))
        usage = {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        }
        # Only the events the agent needs: the real API's content_part and *.done events, and
        # the output repeated in response.completed, would each record the whole text again.
        await send(
            "response.completed", response={**envelope, "status": "completed", "usage": usage}
        )

    async def _send_message(self, send: _Send, deltas: list[str]) -> int:
        item_id = f"msg_{uuid.uuid4().hex}"
        item = {"id": item_id, "type": "message", "role": "assistant"}
        await send(
            "response.output_item.added",
            output_index=0,
            item={**item, "status": "in_progress", "content": []},
        )
        for delta in deltas:
            await send(
                "response.output_text.delta",
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=delta,
            )
            if self._word_delay:
                await asyncio.sleep(self._word_delay)
        part = {"type": "output_text", "text": "".join(deltas), "annotations": []}
        done_item = {**item, "status": "completed", "content": [part]}
        await send("response.output_item.done", output_index=0, item=done_item)
        return len(deltas)

    async def _send_calls(self, send: _Send, calls: list[tuple[str, str]]) -> int:
        """One function_call item per (name, arguments), its arguments streamed in pieces."""
        for index, (name, arguments) in enumerate(calls):
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": name,
            }
            await send(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            step = max(1, len(arguments) // 3)
            for start in range(0, len(arguments), step):
                await send(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=arguments[start : start + step],
                )
                if self._word_delay:
                    await asyncio.sleep(self._word_delay)
            await send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=arguments,
            )
            done = {**item, "arguments": arguments, "status": "completed"}
            await send("response.output_item.done", output_index=index, item=done)
        return sum(len(arguments.split()) for _, arguments in calls)


async def _error(response: HttpResponse, status: int, code: str, message: str) -> None:
    body = json.dumps(
        {"error": {"code": code, "message": message, "type": "invalid_request_error"}}
    )
    await response.send(status, body.encode())
