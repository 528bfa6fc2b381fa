"""The loopback HTTP server of the built-in models and test providers, on aiohttp's server:
a handler writes each response whole or as a stream of Server-Sent Events, and can stall,
break or drop it the way a misbehaving provider would."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)
# aiohttp logs a malformed request with its traceback after answering it 400; on a loopback
# port of the agent's own, that is noise in the server's log, never a fault of the server.
_SERVER_LOG = logging.getLogger(f"{__name__}.server")
_SERVER_LOG.setLevel(logging.CRITICAL)

MAX_BODY_BYTES = 64 * 1024 * 1024
# A stop ends open streams almost at once (a test provider's stalled stream would hold it;
# aiohttp reads 0 as no limit).
_STOP_GRACE = 0.05


@dataclass(frozen=True)
class HttpRequest:
    method: str
    # The path with its query string, as the request line had it.
    path: str
    # Header names are lower-cased.
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HttpResponse:
    """Writes one response: whole (send) or streamed in chunks (start, write/event, finish);
    `reset` drops the connection mid-way, as a broken provider does."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response: web.StreamResponse | None = None
        self.started = False
        self.finished = False

    async def send(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        from aiohttp import web

        response = web.StreamResponse(status=status, headers=headers)
        response.content_type = content_type
        response.content_length = len(body)
        self._response = response
        self.started = True
        await response.prepare(self._request)
        await response.write(body)
        await response.write_eof()
        self.finished = True

    async def start(
        self,
        status: int = 200,
        *,
        content_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        from aiohttp import web

        response = web.StreamResponse(status=status, headers=headers)
        response.content_type = content_type
        response.headers.setdefault("Cache-Control", "no-store")
        response.enable_chunked_encoding()
        self._response = response
        self.started = True
        await response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        assert self._response is not None, "start() first"
        await self._response.write(data)

    async def event(self, data: Mapping[str, Any] | str, *, event: str | None = None) -> None:
        """Send one SSE event; a mapping is sent as compact JSON."""
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        lines = [f"event: {event}"] if event else []
        lines.extend(f"data: {line}" for line in text.split("\n"))
        await self.write(("\n".join(lines) + "\n\n").encode())

    async def finish(self) -> None:
        if self.started and not self.finished and self._response is not None:
            self.finished = True
            await self._response.write_eof()

    async def wait_disconnected(self) -> None:
        """Return once the client has closed the connection (a stream held open until then).

        aiohttp cancels the handler of a connection that closes: the wait ends there, and the
        cancellation with it (what follows is the handler's own cleanup)."""
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()

    def reset(self) -> None:
        """Drop the connection without finishing the response (a broken stream)."""
        self.finished = True
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    def result(self) -> web.StreamResponse:
        """What the aiohttp handler returns once the handler above is done."""
        from aiohttp import web

        if self._response is None:
            # Dropped before a byte was sent: there is no response to give.
            return web.Response(status=500, text="no response")
        return self._response


Handler = Callable[[HttpRequest, HttpResponse], Awaitable[None]]


async def send_error(
    response: HttpResponse,
    status: int,
    code: str,
    message: str,
    error_type: str = "invalid_request_error",
) -> None:
    """An OpenAI-style error body: `{"error": {"code", "message", "type"}}`."""
    body = json.dumps({"error": {"code": code, "message": message, "type": error_type}})
    await response.send(status, body.encode())


async def posted_route(
    request: HttpRequest, response: HttpResponse, routes: tuple[str, ...]
) -> str | None:
    """The route of a POST to one of routes; None once a 404 has been answered instead."""
    route = request.path.split("?")[0].rstrip("/")
    if request.method != "POST" or route not in routes:
        await send_error(
            response, 404, "not_found", f"no route for {request.method} {request.path}"
        )
        return None
    return route


async def json_post(
    request: HttpRequest, response: HttpResponse, routes: tuple[str, ...]
) -> tuple[str, dict[str, Any]] | None:
    """The route and JSON object body of a POST to one of routes; None once an error (404,
    400) has been answered instead."""
    route = await posted_route(request, response, routes)
    if route is None:
        return None
    try:
        body = request.json()
    except ValueError:
        await send_error(response, 400, "invalid_json", "the request body is not valid JSON")
        return None
    if not isinstance(body, dict):
        await send_error(response, 400, "invalid_request", "the request body is not an object")
        return None
    return route, body


class LoopbackHttpServer:
    """aiohttp's HTTP/1.1 server (keep-alive, bodies up to 64 MiB) with one handler for every
    method and path. Requests are kept in `requests` only with keep_requests (a long-running
    server would keep every conversation)."""

    def __init__(self, handler: Handler, *, keep_requests: bool = False) -> None:
        self._handler = handler
        self._keep_requests = keep_requests
        self._runner: web.AppRunner | None = None
        self.requests: list[HttpRequest] = []
        self.host = "127.0.0.1"
        self.port = 0

    @classmethod
    async def start(
        cls,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keep_requests: bool = False,
    ) -> LoopbackHttpServer:
        # Imported here: a server that talks to a real provider starts none of this.
        from aiohttp import web

        server = cls(handler, keep_requests=keep_requests)
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", server._serve)
        # A client that goes away cancels its handler, as a provider stops generating.
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            logger=_SERVER_LOG,
            shutdown_timeout=_STOP_GRACE,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        server._runner = runner
        address = runner.addresses[0]
        server.host, server.port = address[0], address[1]
        return server

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening and end every open connection, streaming ones included."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _serve(self, raw: web.Request) -> web.StreamResponse:
        request = HttpRequest(
            method=raw.method,
            path=raw.path_qs,
            headers={name.lower(): value for name, value in raw.headers.items()},
            body=await raw.read(),
        )
        if self._keep_requests:
            self.requests.append(request)
        response = HttpResponse(raw)
        try:
            await self._handler(request, response)
            await response.finish()
        except (ConnectionError, asyncio.CancelledError):
            response.reset()
            raise
        except Exception:
            log.exception("loopback HTTP handler failed")
            if not response.started:
                from aiohttp import web

                # OpenAI-style, as every other answer of these servers: a client's SDK reads
                # its code instead of failing on a body it cannot parse.
                return web.json_response(
                    {
                        "error": {
                            "code": "internal_error",
                            "message": "internal error (details in the server log)",
                            "type": "server_error",
                        }
                    },
                    status=500,
                )
            response.reset()
        return response.result()


__all__ = [
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "LoopbackHttpServer",
    "json_post",
    "posted_route",
    "send_error",
]
