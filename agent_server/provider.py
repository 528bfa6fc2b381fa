"""The Responses API client: one streamed request per attempt, parsed into provider events."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import re
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_sse import SSEError, aconnect_sse

from agent_server.config import Secret
from trace_reducer import canonical_json

CALL_ID_HEADER = "x-rollout-inference-call-id"
_ERROR_BODY_LIMIT = 64 * 1024
_RETRY_AFTER_CAP = 600.0
DEFAULT_MAX_CONNECTIONS = 1024
_MAX_KEEPALIVE = 64
# The events that end a response: the reader stops after them, so the HTTP response is closed
# by the task that reads it and never by a cancellation (which httpcore's pool does not survive
# while it is releasing a connection).
TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
# Real events nest a handful of levels; a deeper one is hostile, and would recurse deep in
# every layer that walks it.
MAX_EVENT_DEPTH = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ProviderEvent:
    """One SSE event; `data` is None when its JSON could not be parsed into an object."""

    type: str
    data: dict[str, Any] | None
    raw: str


Decode = Callable[[str, str], list[ProviderEvent]]


class Dialect(Protocol):
    """How one provider API is spoken: its path, its request body, its stream's events."""

    name: str
    path: str

    def envelope(self, responses_envelope: dict[str, Any]) -> dict[str, Any]:
        """The request body without the conversation, from the Responses-style one."""

    def body(
        self, envelope: dict[str, Any], instructions: str, items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The whole request body."""

    def decoder(self) -> Decode:
        """A fresh decoder for one stream: (SSE event name, data) → events, in order."""


class ResponsesDialect:
    """The OpenAI Responses API: the events are the dialect."""

    name = "responses"
    path = "/responses"

    def envelope(self, responses_envelope: dict[str, Any]) -> dict[str, Any]:
        return responses_envelope

    def body(
        self, envelope: dict[str, Any], instructions: str, items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {**envelope, "input": items}

    def decoder(self) -> Decode:
        return lambda sse_event, raw: [parse_event(sse_event, raw)]


RESPONSES = ResponsesDialect()


class ProviderError(Exception):
    """An attempt failed before or while streaming; `retryable` follows the retry policy."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        http_status: int = 0,
        retryable: bool = False,
        retry_after: float | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        # Why the attempt ended, for the trace; the code when not given.
        self.reason = reason or code
        self.code = code
        self.message = message
        self.http_status = http_status
        self.retryable = retryable
        self.retry_after = retry_after


def redact_url(url: str) -> str:
    """url as it may be recorded or logged: no `user:password@`, no query values."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    query = "&".join(
        f"{name}=..." for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def url_secrets(base_url: str, api_key: Secret | None) -> list[str]:
    """Everything a message must never show: the key, the URL's password and query values."""
    parts = urllib.parse.urlsplit(base_url)
    return [
        secret
        for secret in (
            api_key.reveal() if api_key is not None else "",
            urllib.parse.unquote(parts.password or ""),
            *(value for _, value in urllib.parse.parse_qsl(parts.query)),
        )
        if secret
    ]


def pooled_client(
    idle_timeout: float, connect_timeout: float, max_connections: int
) -> httpx.AsyncClient:
    """The HTTP client of one provider: the idle timeout is its read timeout."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=min(max_connections, _MAX_KEEPALIVE),
    )
    return httpx.AsyncClient(
        # A turn beyond max_connections waits for a connection as long as it would wait
        # to connect, then fails its attempt (retried like any connection failure).
        timeout=httpx.Timeout(
            connect=connect_timeout,
            read=idle_timeout,
            write=connect_timeout,
            pool=connect_timeout,
        ),
        follow_redirects=False,
        limits=limits,
        trust_env=False,
        # aiohttp's C parser reads a stream for half the CPU of httpcore's (measured in
        # bench/); httpx stays the API, and httpx-sse the SSE parser.
        transport=AiohttpTransport(limits=limits, trust_env=False),
    )


def redact_httpx_log(base_url: str, safe: Callable[[str], str]) -> _RedactingFilter | None:
    """httpx logs every request's URL (at INFO): credentials in it must not reach a log. The
    filter installed, when the URL has any (remove it from the `httpx` logger when done)."""
    if redact_url(base_url) == base_url:
        return None
    log_filter = _RedactingFilter(safe)
    logging.getLogger("httpx").addFilter(log_filter)
    return log_filter


def _endpoint(base_url: str, route: str) -> tuple[str, httpx.BasicAuth | None]:
    """`{base_url}{route}` (before any query), and the URL's user info as Basic auth."""
    parts = urllib.parse.urlsplit(base_url)
    auth = None
    netloc = parts.netloc
    if "@" in netloc:
        netloc = netloc.rpartition("@")[2]
        auth = httpx.BasicAuth(
            urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")
        )
    path = parts.path.rstrip("/") + route
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, parts.query, "")), auth


class ProviderClient:
    """Streams `POST {base_url}{dialect.path}`; the idle timeout is the HTTP read timeout."""

    def __init__(
        self,
        base_url: str,
        api_key: Secret | None,
        idle_timeout: float,
        *,
        connect_timeout: float = 30.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        dialect: Dialect = RESPONSES,
        name: str = "",
        unsupported: frozenset[str] = frozenset(),
    ) -> None:
        self.dialect = dialect
        # The provider's name in the config ('' for the default one), and the optional
        # request fields it is known not to take (left out of best-effort requests).
        self.name = name
        self.unsupported = unsupported
        self.base_url = base_url.rstrip("/")
        # What the trace and the logs show: the URL without credentials.
        self.display_url = redact_url(self.base_url)
        self._endpoint, self._auth = _endpoint(self.base_url, dialect.path)
        self._api_key = api_key
        self._client_limit = max_connections
        self._secrets = url_secrets(self.base_url, api_key)
        self._client = pooled_client(idle_timeout, connect_timeout, max_connections)
        self._log_filter = redact_httpx_log(self.base_url, self._safe)

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._log_filter is not None:
            logging.getLogger("httpx").removeFilter(self._log_filter)

    def _safe(self, text: str) -> str:
        """Provider or transport text with the API key and URL credentials taken out."""
        if self.base_url != self.display_url:
            text = text.replace(self.base_url, self.display_url)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _describe(self, error: Exception) -> str:
        if isinstance(error, httpx.LocalProtocolError):
            # Its text quotes the offending request line or header: the key, perhaps.
            return "the request could not be sent (a header or the body is not valid HTTP)"
        return self._safe(str(error) or type(error).__name__)

    @contextlib.asynccontextmanager
    async def batches(self, call_id: str, body: dict[str, Any]) -> AsyncIterator[EventBatches]:
        """One attempt, read in the background; leaving the block closes its HTTP stream."""
        reader = EventBatches()
        reader.start(self.stream(call_id, body, opened=reader.opened))
        try:
            yield reader
        finally:
            await reader.aclose()

    async def stream(
        self,
        call_id: str,
        body: dict[str, Any],
        *,
        opened: Callable[[httpx.Response], None] | None = None,
    ) -> AsyncGenerator[ProviderEvent, None]:
        """Yield the events of one attempt; raise ProviderError when it cannot go on.

        opened(response) is called once the response has started, for a caller that may
        have to close it from another task."""
        headers = {CALL_ID_HEADER: call_id, "Content-Type": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        content = canonical_json(body)
        decode = self.dialect.decoder()
        try:
            async with aconnect_sse(
                self._client,
                "POST",
                self._endpoint,
                headers=headers,
                content=content,
                auth=self._auth,
            ) as source:
                response = source.response
                if opened is not None:
                    opened(response)
                if response.status_code >= 400:
                    error = await _http_error(response)
                    error.message = self._safe(error.message)
                    raise error
                if response.status_code != 200:
                    raise ProviderError(
                        "unexpected_status",
                        f"provider answered HTTP {response.status_code}",
                        http_status=response.status_code,
                    )
                async for sse in source.aiter_sse():
                    # A block of only `id:`, `retry:` or `event:` lines carries no event (the
                    # SSE spec dispatches nothing for an empty data buffer).
                    if sse.data:
                        for event in decode(sse.event, sse.data):
                            yield event
        except SSEError as error:
            raise ProviderError("unexpected_content_type", self._safe(str(error))) from error
        except httpx.ReadTimeout as error:
            raise ProviderError(
                "stream_idle_timeout", "the provider stream was idle too long", retryable=True
            ) from error
        except httpx.PoolTimeout as error:
            raise ProviderError(
                "connection_error",
                "no free provider connection: every one of the "
                f"{self._client_limit} allowed is streaming",
                retryable=True,
            ) from error
        except httpx.TimeoutException as error:
            raise ProviderError(
                "connection_error",
                f"timed out talking to the provider: {self._describe(error)}",
                retryable=True,
            ) from error
        except httpx.TransportError as error:
            raise ProviderError(
                "connection_error",
                f"provider connection failed: {self._describe(error)}",
                retryable=True,
            ) from error
        except httpx.HTTPError as error:
            raise ProviderError(
                "bad_response", f"unreadable provider response: {self._describe(error)}"
            ) from error
        except aiohttp.ClientError as error:
            # What the transport does not translate into an httpx error.
            raise ProviderError(
                "connection_error",
                f"provider connection failed: {self._describe(error)}",
                retryable=True,
            ) from error
        except ValueError as error:
            # aiohttp refuses a request it cannot send, quoting the header or URL at fault
            # (the key, perhaps): say what happened, never its text.
            raise ProviderError(
                "request_not_sent",
                "the request could not be sent: a header or the URL is not valid HTTP",
            ) from error


class _RedactingFilter(logging.Filter):
    """Rewrites a log record whose message would show something `redact` takes out."""

    def __init__(self, redact: Callable[[str], str]) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = self._redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class EventBatches:
    """Reads an attempt's events in a background task and hands them over in batches.

    A batch is everything that was read while the turn was busy, typically the events of one
    network read: they may be recorded together without delaying any of them. The reader
    never gets ahead of the network, so the batches stay as small as the provider's pace.
    It stops by itself after a terminal event, closing the response as it goes.
    """

    def __init__(self) -> None:
        self._pending: list[ProviderEvent] = []
        self._error: Exception | None = None
        self._ended = False
        self._terminal = False
        self._arrived = asyncio.Event()
        self._response: httpx.Response | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, events: AsyncGenerator[ProviderEvent, None]) -> None:
        self._task = asyncio.create_task(self._read(events))

    def opened(self, response: httpx.Response) -> None:
        self._response = response

    async def _read(self, events: AsyncGenerator[ProviderEvent, None]) -> None:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    self._pending.append(event)
                    self._arrived.set()
                    if event.type in TERMINAL_EVENTS:
                        self._terminal = True
                        break
        except Exception as error:  # noqa: BLE001 - handed to the turn, which reports it
            self._error = error
        finally:
            self._ended = True
            self._arrived.set()

    async def next(self) -> list[ProviderEvent]:
        """The events read since the last call, waiting for one; [] once the stream ended.

        Raises the attempt's error only after every event read before it was handed over."""
        while not self._pending and not self._ended:
            self._arrived.clear()
            await self._arrived.wait()
        return self.ready()

    def ready(self) -> list[ProviderEvent]:
        """The events already read, without waiting (raising as next() does once they are
        all handed over and the stream failed)."""
        if self._pending:
            batch, self._pending = self._pending, []
            return batch
        if self._ended and self._error is not None:
            raise self._error
        return []

    async def aclose(self) -> None:
        """Stop reading and close the HTTP response; return once it is closed.

        The reader is never cancelled once the response has started: httpcore does not
        survive a cancellation while it releases a connection (which the reader may be doing
        at the end of the stream), and leaks the socket. The response is closed from here
        instead, which ends a pending read."""
        task = self._task
        if task is None:
            return
        if not task.done() and not self._terminal:
            if self._response is None:
                task.cancel()  # still connecting or sending: no response to release yet
            else:
                await asyncio.shield(self._response.aclose())
        # wait() never cancels the reader, even when this caller is cancelled meanwhile.
        await asyncio.wait([task])


def parse_event(sse_event: str, raw: str) -> ProviderEvent:
    """The event in one SSE block; data None when it is not a usable JSON object.

    Strings come out fit for every layer after this one: a lone surrogate (which JSON's
    `\\udXXX` escapes can produce and UTF-8 cannot carry) becomes U+FFFD, so the client, the
    recorded payloads and the reduced state all hold the same text. `raw` stays verbatim.
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return ProviderEvent(sse_event, None, raw)
    if not isinstance(data, dict):
        return ProviderEvent(sse_event, None, raw)
    # Cheap tests first: nearly every event is a small, flat, clean delta.
    suspicious_escape = "\\ud" in raw or "\\uD" in raw
    if suspicious_escape or raw.count("{") + raw.count("[") > MAX_EVENT_DEPTH:
        cleaned = _cleaned(data)
        if cleaned is None:
            return ProviderEvent(sse_event, None, raw)
        data = cleaned
    event_type = data.get("type")
    return ProviderEvent(event_type if isinstance(event_type, str) else sse_event, data, raw)


def _cleaned(data: dict[str, Any]) -> dict[str, Any] | None:
    """data with lone surrogates replaced in every key and string; None when nested deeper
    than MAX_EVENT_DEPTH. Walks with an explicit stack, never recursion."""
    root: dict[str, Any] = {}
    stack: list[tuple[Any, Any, int]] = [(data, root, 1)]
    while stack:
        source, target, depth = stack.pop()
        if depth > MAX_EVENT_DEPTH:
            return None
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            if isinstance(key, str):
                key = _LONE_SURROGATE.sub("\ufffd", key)
            if isinstance(value, str):
                value = _LONE_SURROGATE.sub("\ufffd", value)
            elif isinstance(value, dict | list):
                copy: dict[str, Any] | list[Any] = (
                    {} if isinstance(value, dict) else [None] * len(value)
                )
                stack.append((value, copy, depth + 1))
                value = copy
            target[key] = value
    return root


async def _http_error(response: httpx.Response) -> ProviderError:
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= _ERROR_BODY_LIMIT:
            break
    return http_error(
        response.status_code, body, response.reason_phrase, response.headers.get("retry-after")
    )


def http_error(
    status: int, body: bytes, reason_phrase: str = "", retry_after: str | None = None
) -> ProviderError:
    """The ProviderError of an HTTP error answer: its code and message from an OpenAI-style
    error body when there is one."""
    code, message = f"http_{status}", body[:2000].decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code") or error.get("type") or code)
        message = str(error.get("message") or message)
    return ProviderError(
        code,
        f"provider answered HTTP {status}: {message or reason_phrase}",
        http_status=status,
        retryable=status == 429 or status >= 500,
        retry_after=_retry_after(retry_after),
    )


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP-date (RFC 9110)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = max(0.0, (when - datetime.now(UTC)).total_seconds())
    if seconds != seconds or seconds < 0:
        return None
    return min(seconds, _RETRY_AFTER_CAP)
