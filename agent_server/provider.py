"""The Responses API client: one streamed request per attempt, parsed into provider events."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

from agent_server.config import Secret
from trace_reducer import canonical_json

CALL_ID_HEADER = "x-rollout-inference-call-id"
_ERROR_BODY_LIMIT = 64 * 1024
_RETRY_AFTER_CAP = 600.0


@dataclass(frozen=True)
class ProviderEvent:
    """One SSE event; `data` is None when its JSON could not be parsed into an object."""

    type: str
    data: dict[str, Any] | None
    raw: str


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


class ProviderClient:
    """Streams `POST {base_url}/responses`; the idle timeout is the HTTP read timeout."""

    def __init__(
        self,
        base_url: str,
        api_key: Secret | None,
        idle_timeout: float,
        *,
        connect_timeout: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=connect_timeout, read=idle_timeout, write=connect_timeout, pool=None
            ),
            follow_redirects=False,
            # One streaming connection per running turn: a pool cap would make the turns
            # beyond it wait for a free connection.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    @contextlib.asynccontextmanager
    async def batches(self, call_id: str, body: dict[str, Any]) -> AsyncIterator[EventBatches]:
        """One attempt, read in the background; leaving the block closes its HTTP stream."""
        reader = EventBatches(self.stream(call_id, body))
        try:
            yield reader
        finally:
            await reader.aclose()

    async def stream(
        self, call_id: str, body: dict[str, Any]
    ) -> AsyncGenerator[ProviderEvent, None]:
        """Yield the events of one attempt; raise ProviderError when it cannot go on."""
        headers = {CALL_ID_HEADER: call_id, "Content-Type": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        content = canonical_json(body)
        try:
            async with aconnect_sse(
                self._client, "POST", f"{self.base_url}/responses", headers=headers, content=content
            ) as source:
                response = source.response
                if response.status_code >= 400:
                    raise await _http_error(response)
                if response.status_code != 200:
                    raise ProviderError(
                        "unexpected_status",
                        f"provider answered HTTP {response.status_code}",
                        http_status=response.status_code,
                    )
                async for sse in source.aiter_sse():
                    yield _parse(sse.event, sse.data)
        except SSEError as error:
            raise ProviderError("unexpected_content_type", str(error)) from error
        except httpx.ReadTimeout as error:
            raise ProviderError(
                "stream_idle_timeout", "the provider stream was idle too long", retryable=True
            ) from error
        except httpx.TimeoutException as error:
            raise ProviderError(
                "connection_error",
                f"timed out talking to the provider: {_describe(error)}",
                retryable=True,
            ) from error
        except httpx.TransportError as error:
            raise ProviderError(
                "connection_error",
                f"provider connection failed: {_describe(error)}",
                retryable=True,
            ) from error
        except httpx.HTTPError as error:
            raise ProviderError(
                "bad_response", f"unreadable provider response: {_describe(error)}"
            ) from error


class EventBatches:
    """Reads an attempt's events in a background task and hands them over in batches.

    A batch is everything that was read while the turn was busy, typically the events of one
    network read: they may be recorded together without delaying any of them. The reader
    never gets ahead of the network, so the batches stay as small as the provider's pace.
    """

    def __init__(self, events: AsyncGenerator[ProviderEvent, None]) -> None:
        self._pending: list[ProviderEvent] = []
        self._error: Exception | None = None
        self._ended = False
        self._arrived = asyncio.Event()
        self._task = asyncio.create_task(self._read(events))

    async def _read(self, events: AsyncGenerator[ProviderEvent, None]) -> None:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    self._pending.append(event)
                    self._arrived.set()
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
        if self._pending:
            batch, self._pending = self._pending, []
            return batch
        if self._error is not None:
            raise self._error
        return []

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__


def _parse(sse_event: str, raw: str) -> ProviderEvent:
    try:
        data = json.loads(raw)
    except ValueError:
        return ProviderEvent(sse_event, None, raw)
    if not isinstance(data, dict):
        return ProviderEvent(sse_event, None, raw)
    event_type = data.get("type")
    return ProviderEvent(event_type if isinstance(event_type, str) else sse_event, data, raw)


async def _http_error(response: httpx.Response) -> ProviderError:
    status = response.status_code
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= _ERROR_BODY_LIMIT:
            break
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
        f"provider answered HTTP {status}: {message or response.reason_phrase}",
        http_status=status,
        retryable=status == 429 or status >= 500,
        retry_after=_retry_after(response.headers.get("retry-after")),
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
