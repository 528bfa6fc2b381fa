"""The Responses API client: one streamed request per attempt, parsed into provider events."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import re
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

import aiohttp
import orjson
import yarl

from agent_server.config import Secret
from agent_server.sse import SseSplitter
from grpc_common import Redactor, redact_url
from trace_reducer import canonical_json
from trace_reducer.bundle import (
    LONG_NUMBER_DIGITS,
    canonical_json_with_list,
    fast_json,
    os_error_reason,
    same_objects_prefix,
)

try:
    from agent_server import _sse_split
except ImportError:  # built where a C compiler is (setup.py); the Python way otherwise
    _sse_split = None  # type: ignore[assignment]

CALL_ID_HEADER = "x-rollout-inference-call-id"
_ERROR_BODY_LIMIT = 64 * 1024
_RETRY_AFTER_CAP = 600.0
DEFAULT_MAX_CONNECTIONS = 1024
# How long an idle provider connection is kept for the next call (httpx's default too).
_KEEPALIVE_SECONDS = 5.0
# The events that end a response: the reader stops after them and releases the response.
TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
# Real events nest a handful of levels; a deeper one is hostile, and would recurse deep in
# every layer that walks it.
MAX_EVENT_DEPTH = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class ProviderEvent(NamedTuple):
    """One SSE event; `data` is None when its JSON could not be parsed into an object.

    A named tuple: immutable, and made in one C call (one is made per event of every stream)."""

    type: str
    data: dict[str, Any] | None
    raw: str


class Decode(Protocol):
    """One stream's decoder: (SSE event name, data) → events, in order; and what a clean end
    of the stream without a terminal event amounts to (the agent and the gateway both ask)."""

    def __call__(self, sse_event: str, raw: str) -> list[ProviderEvent]: ...

    def end_of_stream(self) -> list[ProviderEvent]: ...


# A request's body: encoded (Dialect.request), or its JSON value, which canonical_json encodes.
RequestBody = bytes | dict[str, Any]


class EncodedItems:
    """A thread's history items' canonical JSON, each kept while the same item stays at its
    place in the history.

    Every request re-sends the whole history; encoding it anew each time cost ~2 ms a turn at
    1,000 turns. An item is not changed once it joins the history (the bundle records it once,
    by the same bytes), so the same object at the same place has the same encoding; from the
    first place that differs (a fork's copies, a history cut back) the rest is encoded again.
    """

    __slots__ = ("_encoded", "_items")

    def __init__(self) -> None:
        self._items: list[object] = []
        self._encoded: list[bytes] = []

    def of(self, items: Sequence[object]) -> list[bytes]:
        """canonical_json of each of items, in order."""
        kept, encoded = self._items, self._encoded
        same = same_objects_prefix(kept, items)
        del kept[same:], encoded[same:]
        for item in items[same:]:
            kept.append(item)
            encoded.append(canonical_json(item))
        return list(encoded)

    def clear(self) -> None:
        """Forget every item (the history is gone)."""
        self._items.clear()
        self._encoded.clear()


class Dialect(Protocol):
    """How one provider API is spoken: its path, its request body, its stream's events."""

    name: str
    path: str

    def envelope(self, responses_envelope: dict[str, Any]) -> dict[str, Any]:
        """The request body without the conversation, from the Responses-style one."""

    def request(
        self,
        envelope: dict[str, Any],
        instructions: str,
        items: list[dict[str, Any]],
        encoded: EncodedItems,
    ) -> bytes:
        """The whole request body, encoded (canonical_json); encoded: the items' encodings
        kept from the thread's earlier requests."""

    def decoder(self) -> Decode:
        """A fresh decoder for one stream: (SSE event name, data) → events, in order."""


class ResponsesDialect:
    """The OpenAI Responses API: the events are the dialect."""

    name = "responses"
    path = "/responses"

    def envelope(self, responses_envelope: dict[str, Any]) -> dict[str, Any]:
        return responses_envelope

    def request(
        self,
        envelope: dict[str, Any],
        instructions: str,
        items: list[dict[str, Any]],
        encoded: EncodedItems,
    ) -> bytes:
        # The body is {**envelope, "input": items}; the items go as they were encoded.
        return canonical_json_with_list(envelope, "input", encoded.of(items))

    def decoder(self) -> Decode:
        return _ResponsesDecode()


class _ResponsesDecode:
    """A Responses stream's events as they are: its end is its terminal event, nothing else."""

    def __call__(self, sse_event: str, raw: str) -> list[ProviderEvent]:
        return [parse_event(sse_event, raw)]

    def end_of_stream(self) -> list[ProviderEvent]:
        return []


RESPONSES = ResponsesDialect()

if _sse_split is not None:
    _sse_split.setup_events(
        ProviderEvent, orjson.loads, orjson.JSONDecodeError, MAX_EVENT_DEPTH, LONG_NUMBER_DIGITS
    )


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


def provider_redactor(base_url: str, api_key: Secret | None) -> Redactor:
    """What a provider's or an upstream's answers must never show: the key and everything
    its URL carries."""
    secrets = [api_key.reveal()] if api_key is not None else []
    # aiohttp sends the URL as yarl spells it (`%2F` in a query value becomes `/`).
    return Redactor(secrets, url=base_url, spellings=[str(yarl.URL(base_url))])


def _client_timeout(connect_timeout: float, sock_read: float | None) -> aiohttp.ClientTimeout:
    """The timeouts of a request: no total; a request beyond the connection limit waits for
    one as long as it would wait to connect, then fails (an agent's attempt is retried like
    any connection failure); sock_read, when given, bounds each wait for bytes."""
    return aiohttp.ClientTimeout(
        total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=sock_read
    )


def pooled_session(
    idle_timeout: float, connect_timeout: float, max_connections: int
) -> aiohttp.ClientSession:
    """The one HTTP transport of the agent's provider and of the gateway's upstream: the idle
    timeout is the socket read timeout (for the answer's headers and between body reads),
    unless a request brings its own (the agent's stream: IdleWatch). Make it in the running
    loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=_KEEPALIVE_SECONDS),
        timeout=_client_timeout(connect_timeout, idle_timeout),
        # No cookie of one call (one thread's, one gateway client's) reaches another's.
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
    )


class IdleWatch:
    """A streamed body's idle timeout, checked four times a period rather than re-armed at
    every read.

    aiohttp's sock_read stops its timer and starts a new one at each network read, which cost
    ~7 % of the stream read's CPU on uvloop (F1, docs/performance.md). The watch fails the
    body with the SocketTimeoutError sock_read raises once nothing has arrived for `idle`
    seconds while the reader had taken all that had; data waiting unread means the reader is
    busy, not that the provider went quiet. The reader adds each read's length to `consumed`.
    The gateway's upstream and the replay model's live provider keep the session's sock_read:
    the per-read timer is measured only on this stream (F1 of bench.tree_ab).
    """

    __slots__ = ("_content", "_handle", "_idle", "_loop", "_period", "_seen", "_since", "consumed")

    def __init__(self, content: aiohttp.StreamReader, idle: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._content = content
        self._idle = idle
        self._period = idle / 4
        self.consumed = 0
        self._seen = content.total_bytes
        self._since = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(self._period, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        arrived = self._content.total_bytes
        if arrived != self._seen or self.consumed < arrived:
            self._seen = arrived
            self._since = now
        elif now - self._since >= self._idle:
            self._handle = None
            self._content.set_exception(
                aiohttp.SocketTimeoutError("Timeout on reading data from socket")
            )
            return
        self._handle = self._loop.call_later(self._period, self._check)

    def cancel(self) -> None:
        """Stop watching (the body was read, or the attempt left)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _endpoint(base_url: str, route: str) -> tuple[str, str | None]:
    """`{base_url}{route}` (before any query), and the URL's user info as a Basic
    Authorization header (sent in place of any other)."""
    parts = urllib.parse.urlsplit(base_url)
    auth = None
    netloc = parts.netloc
    user = _user_info(base_url)
    if user is not None:
        netloc = netloc.rpartition("@")[2]
        auth = aiohttp.encode_basic_auth(*user)
    path = parts.path.rstrip("/") + route
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, parts.query, "")), auth


def _user_info(url: str) -> tuple[str, str] | None:
    """The user name and password a URL carries before its host, if any."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return None
    return urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")


class ProviderClient:
    """Streams `POST {base_url}{dialect.path}`; the idle timeout bounds the wait for the
    answer's headers and each silence of its body (IdleWatch)."""

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
        # The URL's user info is sent as Basic auth, in place of the key's Bearer.
        self._url, self._basic_auth = _endpoint(self.base_url, dialect.path)
        self._api_key = api_key
        self._client_limit = max_connections
        self._idle_timeout = idle_timeout
        self._connect_timeout = connect_timeout
        # The stream's own timeouts: the idle one is the attempt's (_open and IdleWatch), not
        # the session's per-read timer.
        self._stream_timeout = _client_timeout(connect_timeout, None)
        self.redactor = provider_redactor(self.base_url, api_key)
        # Made in the running loop, at the first attempt.
        self._http: aiohttp.ClientSession | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    def _safe(self, text: str) -> str:
        """Provider or transport text with the API key and URL credentials taken out."""
        return self.redactor.text(text)

    def _describe(self, error: Exception) -> str:
        return self._safe(str(error) or type(error).__name__)

    @contextlib.asynccontextmanager
    async def batches(self, call_id: str, body: RequestBody) -> AsyncIterator[EventBatches]:
        """One attempt, read by the caller's task batch by batch; leaving the block closes
        its HTTP response."""
        reader = EventBatches(self, call_id, body)
        try:
            yield reader
        finally:
            reader.close()

    async def stream(self, call_id: str, body: RequestBody) -> AsyncIterator[ProviderEvent]:
        """The events of one attempt, one by one; raise ProviderError when it cannot go on."""
        async with self.batches(call_id, body) as reader:
            while batch := await reader.next():
                for event in batch:
                    yield event

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = pooled_session(
                self._idle_timeout, self._connect_timeout, self._client_limit
            )
        return self._http

    async def _open(self, call_id: str, body: RequestBody) -> aiohttp.ClientResponse:
        """The attempt's response, once its status says an event stream follows."""
        headers = {
            CALL_ID_HEADER: call_id,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Cache-Control": "no-store",
        }
        if self._basic_auth is not None:
            headers["Authorization"] = self._basic_auth
        elif self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        try:
            async with asyncio.timeout(self._idle_timeout) as waiting:
                response = await self._session().post(
                    self._url,
                    data=body if isinstance(body, bytes) else canonical_json(body),
                    headers=headers,
                    allow_redirects=False,
                    timeout=self._stream_timeout,
                )
                try:
                    await self._check_answer(response)
                except BaseException:
                    response.close()
                    raise
        except TimeoutError:
            if not waiting.expired():
                raise  # aiohttp's own (connecting), a ClientError the caller maps
            raise _idle_failure() from None
        return response

    async def _check_answer(self, response: aiohttp.ClientResponse) -> None:
        """Raise the ProviderError of an answer that is not an event stream."""
        if response.status >= 400:
            error = await _http_error(response, self.redactor)
            parts = urllib.parse.urlsplit(self.base_url)
            if response.status == 404 and not parts.path and not parts.query:
                # `vllm serve` (and most OpenAI-compatible servers) say http://HOST:8000 and
                # serve under /v1: their 404, `Not Found`, says nothing of the missing path.
                error.message = (
                    f"{error.message}; the provider URL {self.display_url} has no path, and an "
                    f"OpenAI-compatible server serves under /v1: give {self.display_url}/v1"
                )
                error.args = (error.message,)
            raise error
        if response.status != 200:
            raise ProviderError(
                "unexpected_status",
                f"provider answered HTTP {response.status}",
                http_status=response.status,
            )
        content_type = response.headers.get("Content-Type", "").partition(";")[0]
        if "text/event-stream" not in content_type:
            raise ProviderError(
                "unexpected_content_type",
                "the provider answered Content-Type "
                f"{self._safe(content_type)!r}, not 'text/event-stream'",
            )

    def _failure(self, error: Exception) -> ProviderError:
        """The ProviderError of what aiohttp raised while connecting, sending or reading."""
        if isinstance(error, aiohttp.SocketTimeoutError):
            return _idle_failure()
        if isinstance(error, aiohttp.ClientConnectorError):
            return ProviderError(
                "connection_error",
                f"provider connection failed: {_connect_failure(error)}",
                retryable=True,
            )
        if isinstance(error, aiohttp.ServerTimeoutError):
            return ProviderError(
                "connection_error",
                f"timed out talking to the provider: {self._describe(error)}",
                retryable=True,
            )
        if isinstance(error, aiohttp.ClientError):
            return ProviderError(
                "connection_error",
                f"provider connection failed: {self._describe(error)}",
                retryable=True,
            )
        # aiohttp refuses a request it cannot send, quoting the header or URL at fault (the
        # key, perhaps): say what happened, never its text.
        return ProviderError(
            "request_not_sent",
            "the request could not be sent: a header or the URL is not valid HTTP",
        )


def _idle_failure() -> ProviderError:
    return ProviderError(
        "stream_idle_timeout", "the provider stream was idle too long", retryable=True
    )


def _connect_failure(error: aiohttp.ClientConnectorError) -> str:
    """Why a connection could not be made (refused, no route, no such host, a TLS failure)."""
    reason = error.os_error
    detail = os_error_reason(reason) if isinstance(reason, OSError) else str(reason)
    if isinstance(reason, ConnectionRefusedError):
        detail = "connection refused"
    return f"cannot connect to {error.host}:{error.port}: {detail}"


class EventBatches:
    """One attempt's events, read by the task that handles them, a network read at a time.

    A batch is everything that arrived while the turn was busy (aiohttp keeps receiving into
    its buffer meanwhile), typically the events of one network read: they may be recorded
    together without delaying any of them, and no second task hands them over. Reading stops
    after a terminal event, and the response is closed then or when the attempt is left.
    """

    def __init__(self, client: ProviderClient, call_id: str, body: RequestBody) -> None:
        self._client = client
        self._call_id = call_id
        self._body = body
        self._decode = client.dialect.decoder()
        # A whole read's Responses events in one C call (_sse_split.c), where it is built: the
        # split and each event's parse_event, or None for a read it leaves to the steps below.
        self._whole_read = (
            _sse_split.responses_events
            if _sse_split is not None and client.dialect is RESPONSES
            else None
        )
        self._splitter = SseSplitter()
        self._response: aiohttp.ClientResponse | None = None
        self._watch: IdleWatch | None = None
        self._error: ProviderError | None = None
        self._ended = False

    async def next(self) -> list[ProviderEvent]:
        """The events that arrived since the last call, waiting for one; [] once the stream
        ended. Raises the attempt's error (again at every later call) once it failed."""
        if self._error is not None:
            raise self._error
        while not self._ended:
            try:
                if self._response is None:
                    self._response = await self._client._open(self._call_id, self._body)
                    self._watch = IdleWatch(self._response.content, self._client._idle_timeout)
                watch = self._watch
                assert watch is not None
                chunk = await self._response.content.readany()
                watch.consumed += len(chunk)
            except ProviderError as error:
                self._fail(error)
                raise
            except (aiohttp.ClientError, ValueError) as error:
                failure = self._client._failure(error)
                self._fail(failure)
                raise failure from error
            if not chunk:
                # A clean end: what the dialect makes of it (a Chat stream whose choices all
                # finished is whole without `[DONE]`, as the gateway records it; was: the
                # turn failed with stream_ended though the answer was all there), else [].
                self.close()
                return self._decode.end_of_stream()
            events = (
                self._whole_read(chunk)
                if self._whole_read is not None and self._splitter.whole(chunk)
                else None
            )
            if events is None:
                events = self._decoded(chunk)
            for position, event in enumerate(events):
                if event.type in TERMINAL_EVENTS:
                    self.close()
                    return events[: position + 1]
            if events:
                return events
        return []

    def _decoded(self, chunk: bytes) -> list[ProviderEvent]:
        """The events of what chunk completes, the dialect's decoder taking each SSE event, up
        to a terminal one."""
        _, blocks = self._splitter.feed(chunk)
        events: list[ProviderEvent] = []
        for block in blocks:
            if not block.data:
                # `data:` lines with nothing in them carry no event to decode.
                continue
            for event in self._decode(block.event, block.data):
                events.append(event)
                if event.type in TERMINAL_EVENTS:
                    # Nothing after the end is decoded.
                    return events
        return events

    def _fail(self, error: ProviderError) -> None:
        self._error = error
        self.close()

    def close(self) -> None:
        """Stop reading: the connection goes back to the pool when the body was read to its
        end, and is closed otherwise."""
        self._ended = True
        if self._watch is not None:
            self._watch.cancel()
        if self._response is not None:
            self._response.release()


def parse_event(sse_event: str, raw: str) -> ProviderEvent:
    """The event in one SSE block; data None when it is not a usable JSON object.

    Strings come out fit for every layer after this one: a lone surrogate (which JSON's
    `\\udXXX` escapes can produce and UTF-8 cannot carry) becomes U+FFFD, so the client, the
    recorded payloads and the reduced state all hold the same text. `raw` stays verbatim.
    """
    if _sse_split is not None:
        # The common case in one C call (_sse_split.c), the same steps as _parse_event's; None
        # for whatever needs one of its other branches.
        event: ProviderEvent | None = _sse_split.parse_event(sse_event, raw)
        if event is not None:
            return event
    return _parse_event(sse_event, raw)


def _parse_event(sse_event: str, raw: str) -> ProviderEvent:
    """parse_event the Python way: the reference _sse_split.c follows, and every case it
    leaves."""
    try:
        data = _loads(raw)
    except (ValueError, RecursionError):
        return ProviderEvent(sse_event, None, raw)
    if not isinstance(data, dict):
        return ProviderEvent(sse_event, None, raw)
    # Cheap tests first: nearly every event is a small, flat, clean delta.
    suspicious_escape = "\\ud" in raw or "\\uD" in raw
    if suspicious_escape or raw.count("{") + raw.count("[") > MAX_EVENT_DEPTH:
        cleaned = without_lone_surrogates(data)
        if cleaned is None:
            return ProviderEvent(sse_event, None, raw)
        data = cleaned
    event_type = data.get("type")
    return ProviderEvent(event_type if isinstance(event_type, str) else sse_event, data, raw)


def _loads(raw: str) -> Any:
    """json.loads(raw), through orjson (four times cheaper, once per event) wherever it reads
    the same values: it refuses what json reads differently or not at all (lone surrogates,
    NaN, infinities, nesting past 1,024), and an event with a long run of digits never goes
    to it."""
    fast, value = fast_json(raw.encode("utf-8", "surrogatepass"))
    return value if fast else json.loads(raw)


# What a lone surrogate needs in a JSON body: an escape of one, or UTF-8's lead byte for
# U+D000 to U+DFFF (Hangul shares it: that body is merely walked for nothing).
_SURROGATE_SIGNS = (b"\\ud", b"\\uD", b"\xed")


def may_hold_lone_surrogates(body: bytes) -> bool:
    """Whether json.loads(body) may hold lone surrogates (then without_lone_surrogates)."""
    return any(sign in body for sign in _SURROGATE_SIGNS)


def replace_lone_surrogates(text: str) -> str:
    """text with each lone surrogate (a JSON `\\ud800` escape) as U+FFFD: what a record's
    UTF-8 can hold."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def without_lone_surrogates(data: dict[str, Any]) -> dict[str, Any] | None:
    """data with lone surrogates replaced by U+FFFD in every key and string; None when nested
    deeper than MAX_EVENT_DEPTH. Walks with an explicit stack, never recursion. (The built-in
    local model cleans the requests it is sent with it too.)"""
    root: dict[str, Any] = {}
    stack: list[tuple[Any, Any, int]] = [(data, root, 1)]
    while stack:
        source, target, depth = stack.pop()
        if depth > MAX_EVENT_DEPTH:
            return None
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            if isinstance(key, str):
                key = replace_lone_surrogates(key)
            if isinstance(value, str):
                value = replace_lone_surrogates(value)
            elif isinstance(value, dict | list):
                copy: dict[str, Any] | list[Any] = (
                    {} if isinstance(value, dict) else [None] * len(value)
                )
                stack.append((value, copy, depth + 1))
                value = copy
            target[key] = value
    return root


async def _http_error(response: aiohttp.ClientResponse, redactor: Redactor) -> ProviderError:
    body = b""
    while len(body) < _ERROR_BODY_LIMIT and (chunk := await response.content.readany()):
        body += chunk
    return http_error(
        response.status,
        body[:_ERROR_BODY_LIMIT],
        redactor,
        response.reason or "",
        response.headers.get("Retry-After"),
    )


def http_error(
    status: int,
    body: bytes,
    redactor: Redactor,
    reason_phrase: str = "",
    retry_after: str | None = None,
) -> ProviderError:
    """The ProviderError of an HTTP error answer: its code and message from an OpenAI-style
    error body when there is one, with the secrets a server may echo (the key it was sent,
    the URL's credentials) taken out of both before anything is cut short."""
    text = body.decode("utf-8", "replace")
    code, message = f"http_{status}", ""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        # Nested past the recursion limit is no error body either (was: RecursionError, the
        # turn failed `internal` and the gateway answered 500 instead of the upstream's 4xx).
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        # JSON's `\ud800` escapes (and surrogates encoded as bytes, which json reads with
        # surrogatepass) make text no error record holds (was: UnicodeEncodeError, as above).
        code = str(error.get("code") or error.get("type") or code)
        message = str(error.get("message") or "")
        code = redactor.text(replace_lone_surrogates(code))
        message = redactor.text(replace_lone_surrogates(message))
    if not message:
        message = redactor.text(text)[:2000].strip()
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


async def read_limited(
    answer: aiohttp.ClientResponse, limit: int, *, errors: bool = False
) -> bytes:
    """An answer's body up to at least limit bytes, read no further (a read ending early is
    kept as it came, unless errors: then it raises aiohttp.ClientError)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in answer.content.iter_any():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    except aiohttp.ClientError:
        if errors:
            raise
    return b"".join(chunks)
