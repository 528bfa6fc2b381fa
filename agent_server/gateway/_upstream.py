"""The upstream: one OpenAI-compatible base URL, its key, one pooled HTTP session."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

import aiohttp

from agent_server.config import Secret
from agent_server.provider import (
    CALL_ID_HEADER,
    ProviderError,
    _connect_failure,
    _endpoint,
    pooled_session,
    provider_redactor,
)
from grpc_common import Redactor, bearer_token, redact_url

# What one hop's HTTP says about its own connection, never passed on (RFC 9110 7.6.1), and
# what the gateway sets itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "host",
    }
)
# Client headers that stay at the gateway: its credentials and its own routing headers.
# A client's credentials stay with the gateway (Authorization is passed on by rule, below):
# Azure's `api-key` and the `x-api-key` other APIs take are keys the redactor does not know.
_PRIVATE_HEADERS = frozenset({"authorization", "cookie", "accept-encoding", "api-key", "x-api-key"})
_GATEWAY_PREFIX = "x-rollout-"
# Headers aiohttp would add that the client did not send: the body's type is the client's
# to say (or not), as everything else it sent.
_NO_AUTO_HEADERS = frozenset({"Content-Type"})


class Upstream:
    """Sends a client's request to `{base_url}{path}`, streamed back as it comes."""

    def __init__(
        self,
        base_url: str,
        api_key: Secret | None,
        idle_timeout: float,
        *,
        connect_timeout: float = 30.0,
        max_connections: int = 1024,
    ) -> None:
        base_url = base_url.rstrip("/")
        # The URL's user info becomes Basic auth, as for the agent's provider.
        endpoint, self._auth = _endpoint(base_url, "")
        parts = urllib.parse.urlsplit(endpoint)
        self._base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        self._query = parts.query
        self.display_url = redact_url(base_url)
        self._api_key = api_key
        self.redactor = provider_redactor(base_url, api_key)
        # The agent's provider transport (aiohttp, read directly); made in the running loop.
        self._http = pooled_session(idle_timeout, connect_timeout, max_connections)

    @property
    def has_key(self) -> bool:
        return self._api_key is not None

    async def aclose(self) -> None:
        await self._http.close()

    def redactor_for(self, client_authorization: str | None) -> Redactor:
        """What a call's answer must never show: the upstream's key and URL credentials, and
        the client's own token when it is the one passed on."""
        if self._api_key is not None or not client_authorization:
            return self.redactor
        token = bearer_token(client_authorization)
        return self.redactor.adding([token or client_authorization.strip()])

    def headers_for(
        self, client_headers: Mapping[str, str], call_id: str, client_authorization: str | None
    ) -> dict[str, str]:
        """The client's headers as the upstream gets them: hop-by-hop, credentials and the
        gateway's own headers dropped; the upstream's key (or, without one, the client's own
        Authorization when the gateway asks clients for no token of its own)."""
        headers = {
            name: value
            for name, value in client_headers.items()
            if (lower := name.lower()) not in HOP_HEADERS
            and lower not in _PRIVATE_HEADERS
            and not lower.startswith(_GATEWAY_PREFIX)
        }
        headers[CALL_ID_HEADER] = call_id
        # The gateway reads what it forwards: no compression it would have to undo.
        headers["Accept-Encoding"] = "identity"
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        elif client_authorization:
            headers["Authorization"] = client_authorization
        return headers

    async def open(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None
    ) -> aiohttp.ClientResponse:
        """The upstream's response, its body not read yet (end it with `release`). Raises
        ProviderError when the request cannot be sent or answered."""
        url = self._base + path
        if self._query:
            url = f"{url}?{self._query}"
        if self._auth is not None:
            headers = {**headers, "Authorization": self._auth}
        try:
            return await self._http.request(
                method,
                url,
                headers=headers,
                data=content,
                allow_redirects=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
            )
        except aiohttp.SocketTimeoutError as error:
            # Connected, and then silent past --stream-idle-timeout before its headers: the
            # same fact, in the same word, as a stream that goes silent later.
            raise idle_failure("before answering") from error
        except aiohttp.ServerTimeoutError as error:
            raise ProviderError(
                "upstream_timeout", f"timed out reaching the upstream: {self._describe(error)}"
            ) from error
        except aiohttp.ClientConnectorError as error:
            raise ProviderError(
                "upstream_unreachable", f"the upstream connection failed: {_connect_failure(error)}"
            ) from error
        except aiohttp.InvalidURL as error:
            raise _not_sent() from error
        except aiohttp.ClientError as error:
            raise ProviderError(
                "upstream_unreachable", f"the upstream connection failed: {self._describe(error)}"
            ) from error
        except ValueError as error:
            # aiohttp refuses a header it cannot send, quoting it (a key, perhaps): never its text.
            raise _not_sent() from error

    def _describe(self, error: Exception) -> str:
        return self.redactor.text(str(error) or type(error).__name__)


def idle_failure(when: str) -> ProviderError:
    """The upstream sent nothing for --stream-idle-timeout: before its answer's headers, inside
    a body, or inside a stream."""
    return ProviderError("stream_idle_timeout", f"the upstream was idle too long {when}")


def upstream_status(error: ProviderError) -> int:
    """The HTTP status a client gets for a call that failed before anything was forwarded:
    504 when the upstream ran out of time, else 502."""
    return 504 if error.code in {"stream_idle_timeout", "upstream_timeout"} else 502


def release(answer: aiohttp.ClientResponse) -> None:
    """Done with an upstream answer: its connection goes back to the pool when the body was
    read to its end, and is closed otherwise (a stalled or abandoned stream)."""
    if answer.content.at_eof():
        answer.release()
    else:
        answer.close()


def _not_sent() -> ProviderError:
    return ProviderError(
        "request_not_sent",
        "the request could not be sent upstream: a header or the URL is not valid HTTP",
    )
