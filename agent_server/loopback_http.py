"""A minimal asyncio HTTP/1.1 server on loopback that streams Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class HttpProtocolError(Exception):
    """The client sent something this server does not speak."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    # Header names are lower-cased.
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HttpResponse:
    """Writes one response: whole (send) or streamed in chunks (start, write/event, finish)."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        *,
        keep_alive: bool = False,
        reader: asyncio.StreamReader | None = None,
    ) -> None:
        self._writer = writer
        self._reader = reader
        self.keep_alive = keep_alive
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
        all_headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        all_headers.update(headers or {})
        self._writer.write(self._head(status, all_headers) + body)
        self.started = self.finished = True
        await self._writer.drain()

    async def start(
        self,
        status: int = 200,
        *,
        content_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        all_headers = {
            "Content-Type": content_type,
            "Transfer-Encoding": "chunked",
            "Cache-Control": "no-store",
        }
        all_headers.update(headers or {})
        self._writer.write(self._head(status, all_headers))
        self.started = True
        await self._writer.drain()

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self._writer.drain()

    async def event(self, data: Mapping[str, Any] | str, *, event: str | None = None) -> None:
        """Send one SSE event; a mapping is sent as compact JSON."""
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        lines = [f"event: {event}"] if event else []
        lines.extend(f"data: {line}" for line in text.split("\n"))
        await self.write(("\n".join(lines) + "\n\n").encode())

    async def finish(self) -> None:
        if self.started and not self.finished:
            self.finished = True
            self._writer.write(b"0\r\n\r\n")
            await self._writer.drain()

    async def wait_disconnected(self) -> None:
        """Return once the client has closed the connection (a stream held open until then).

        Whatever it sends meanwhile is dropped: no client sends a request before the
        response it waits for."""
        if self._reader is None:
            await self._writer.wait_closed()
            return
        with contextlib.suppress(ConnectionError):
            while await self._reader.read(65536):
                pass

    def reset(self) -> None:
        """Drop the connection without finishing the response (a broken stream)."""
        self.finished = True
        self.keep_alive = False
        self._writer.transport.abort()

    def _head(self, status: int, headers: Mapping[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        if not self.keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


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
    """HTTP/1.1 with keep-alive; the handler writes each response. Requests are kept in
    `requests` only with keep_requests (a long-running server would keep every conversation)."""

    def __init__(self, handler: Handler, *, keep_requests: bool = False) -> None:
        self._handler = handler
        self._keep_requests = keep_requests
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
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
        server = cls(handler, keep_requests=keep_requests)
        server._server = await asyncio.start_server(server._on_connection, host, port, backlog=1024)
        server.host, server.port = server._server.sockets[0].getsockname()[:2]
        return server

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening and end every open connection, streaming ones included."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests on one connection, one after the other, while both sides keep it."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
        except asyncio.CancelledError:
            # stop() ends open streams this way; asyncio's stream callback would log a
            # cancelled connection task as an error.
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its response; True when the connection may carry another."""
        response = HttpResponse(writer, reader=reader)
        try:
            request = await _read_request(reader)
            response.keep_alive = request.headers.get("connection", "").lower() != "close"
            if self._keep_requests:
                self.requests.append(request)
            await self._handler(request, response)
            await response.finish()
            return response.keep_alive and response.finished
        except HttpProtocolError as exc:
            if not response.started:
                response.keep_alive = False
                await response.send(exc.status, str(exc).encode(), content_type="text/plain")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("loopback HTTP handler failed")
            if not response.started:
                response.keep_alive = False
                with contextlib.suppress(ConnectionError):
                    await response.send(500, b"internal error", content_type="text/plain")
        return False


async def _read_request(reader: asyncio.StreamReader) -> HttpRequest:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise HttpProtocolError(400, "request head too large") from exc
    if len(head) > MAX_HEADER_BYTES:
        raise HttpProtocolError(400, "request head too large")
    request_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpProtocolError(400, "malformed request line")
    method, path, _ = parts
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpProtocolError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpProtocolError(411, "chunked request bodies are not supported")
    length_text = headers.get("content-length", "0")
    if not length_text.isdigit():
        raise HttpProtocolError(400, "bad Content-Length")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise HttpProtocolError(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    return HttpRequest(method=method, path=path, headers=headers, body=body)
