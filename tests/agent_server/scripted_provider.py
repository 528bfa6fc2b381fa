"""A scripted Responses API provider for tests, on the product's own loopback HTTP server."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer


class Reset:
    """A script step: drop the connection mid-response."""


RESET = Reset()


@dataclass
class UntilClosed:
    """A script step: send nothing more until the client closes the connection; then
    `closed` is set (the upstream saw its request end)."""

    closed: asyncio.Event = field(default_factory=asyncio.Event)


Step = str | asyncio.Event | Reset | UntilClosed


@dataclass
class Reply:
    """One scripted answer: an HTTP error, or a 200 SSE stream made of steps."""

    steps: list[Step] = field(default_factory=list)
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def sse(*events: dict[str, Any]) -> str:
    """SSE as in the reference: `data:` lines only, the type inside the JSON."""
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events)


def message(text: str, item_id: str | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }
    if item_id is not None:
        item["id"] = item_id
    return item


def created(response_id: str = "resp-1") -> dict[str, Any]:
    return {"type": "response.created", "response": {"id": response_id}}


def item_added(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.added", "item": {**item, "content": []}}


def text_delta(delta: str, item_id: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "response.output_text.delta", "delta": delta}
    if item_id is not None:
        event["item_id"] = item_id
    return event


def item_done(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.done", "item": item}


def completed(response_id: str = "resp-1", usage: dict[str, int] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"id": response_id}
    if usage is not None:
        response["usage"] = usage
    return {"type": "response.completed", "response": response}


def failed(response_id: str = "resp-1") -> dict[str, Any]:
    return {
        "type": "response.failed",
        "response": {
            "id": response_id,
            "error": {"code": "server_error", "message": "stream failed"},
        },
    }


def answer(text: str, item_id: str | None = "msg-1", response_id: str = "resp-1") -> str:
    """A whole successful response streaming `text` as one assistant message."""
    item = message(text, item_id)
    words = text.split(" ")
    deltas = [text_delta(w if i == 0 else " " + w, item_id) for i, w in enumerate(words)]
    return sse(
        created(response_id),
        item_added(item),
        *deltas,
        item_done(item),
        completed(response_id, {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}),
    )


class ScriptedProvider:
    """Answers each POST /responses with the next queued Reply; keeps every request."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self._http: LoopbackHttpServer | None = None

    async def start(self) -> ScriptedProvider:
        self._http = await LoopbackHttpServer.start(self._handle, keep_requests=True)
        return self

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()

    @property
    def url(self) -> str:
        assert self._http is not None
        return self._http.url

    @property
    def requests(self) -> list[HttpRequest]:
        assert self._http is not None
        return self._http.requests

    def queue(self, *steps: Step) -> None:
        self.replies.append(Reply(steps=list(steps)))

    def queue_error(
        self, status: int, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(body or {"error": {"message": "boom", "code": "server_error"}})
        self.replies.append(Reply(status=status, body=payload.encode(), headers=headers or {}))

    def queue_json(self, body: dict[str, Any]) -> None:
        """A 200 with a JSON body: a whole (not streamed) answer."""
        self.replies.append(Reply(body=json.dumps(body).encode()))

    async def _handle(self, request: HttpRequest, response: HttpResponse) -> None:
        if not self.replies:
            await response.send(500, b'{"error":{"message":"no scripted reply left"}}')
            return
        reply = self.replies.popleft()
        if reply.status != 200 or reply.body:
            await response.send(reply.status, reply.body, headers=reply.headers)
            return
        await response.start()
        for step in reply.steps:
            if isinstance(step, asyncio.Event):
                await step.wait()
            elif isinstance(step, Reset):
                response.reset()
                return
            elif isinstance(step, UntilClosed):
                await response.wait_disconnected()
                step.closed.set()
                response.reset()
                return
            else:
                await response.write(step.encode())
