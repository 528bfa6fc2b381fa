"""The gateway's HTTP server: each upstream event recorded, then forwarded as it came."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import ssl
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from agent_server import telemetry
from agent_server.agent import MAX_MODEL_CHARS
from agent_server.chat_completions import stream_ended_message
from agent_server.config import open_listen_warning
from agent_server.gateway._dialects import (
    CHAT,
    RESPONSES,
    CallRecorder,
    Dialect,
    loads,
    starts_turn,
    tool_output,
    without_instructions,
)
from agent_server.gateway._sessions import (
    CANCELLED,
    SOURCE_HEADER,
    SOURCE_NEW,
    SOURCE_PATH,
    RunningCall,
    Session,
    SessionKey,
    Sessions,
    hint_key,
    session_key_problem,
)
from agent_server.gateway._settings import GatewaySettings
from agent_server.gateway._upstream import (
    HOP_HEADERS,
    Upstream,
    idle_failure,
    release,
    upstream_status,
)
from agent_server.local_model import LocalModel
from agent_server.provider import (
    ProviderError,
    http_error,
    may_hold_lone_surrogates,
    read_limited,
    replace_lone_surrogates,
    without_lone_surrogates,
)
from agent_server.recorder import Recorder
from agent_server.replay_model import ReplayBook, ReplayModel
from agent_server.sse import MAX_EVENT_BYTES, SseEvent, SseSplitter
from agent_server.threads import missing_reward_target
from agent_server.turn import new_call_id
from grpc_common import (
    Redactor,
    addressed_to_loopback,
    bearer_token,
    http_runner_options,
    is_loopback,
    listen_error,
    refuse_address_in_use,
    same_secret,
    split_listen,
)
from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2
from trace_reducer import (
    BundleError,
    RecordingError,
    ReductionError,
    RewardError,
    RewardInput,
    append_reward,
    check_reward,
    classify_stop,
)
from trace_reducer.bundle import BundleRoot
from trace_reducer.reduce import replay_confined

if TYPE_CHECKING:
    from multidict import CIMultiDict

log = logging.getLogger(__name__)

# The items one call may carry: each is named in the call's (and a new turn's) record by its
# payload id, and a record is at most MAX_RECORD_BYTES (4 MiB: 123,000 ids); a record past
# it stopped the session's recording for good.
MAX_CALL_ITEMS = 100_000
SESSION_HEADER = "x-rollout-session"
THREAD_HEADER = "x-rollout-thread-id"
_ERROR_BODY_LIMIT = 1024 * 1024
if TYPE_CHECKING:
    from trace_reducer.export._live import LiveExport

# Running calls get this long to finish when the gateway stops; then they are cancelled.
_STOP_GRACE = 2.0
# The end reason of a call its session's close cut off.
SESSION_CLOSED = "session_closed"
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
_RECORDING = agent_pb2.RECORDING_STATUS_ACTIVE
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Hook for a live exporter (OTLP): told of every finished call, after it is recorded.
CallObserver = Callable[[Session, str, common_pb2.ExecutionStatus.ValueType], None]


def _slow_body(timeout: float) -> web.Response:
    return error_response(
        408, "request_timeout", f"the request body did not arrive within {timeout:g} seconds"
    )


def error_response(status: int, code: str, message: str, kind: str = "") -> web.Response:
    """An OpenAI-style error body, as the SDKs parse it."""
    body = {"error": {"message": message, "type": kind or _error_type(status), "code": code}}
    return web.json_response(body, status=status)


def _redacted_error(redactor: Redactor, body: bytes) -> bytes:
    """An upstream's error answer without the secrets it may echo; bytes that are not UTF-8
    stay as they came."""
    text = body.decode("utf-8", "surrogateescape")
    safe = redactor.text(text)
    return body if safe == text else safe.encode("utf-8", "surrogateescape")


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


_NAMED = frozenset({SOURCE_HEADER, SOURCE_PATH})


# The fields of POST /rollout/v1/rewards, in the order the documentation gives them.
_REWARD_FIELDS = (
    "session",
    "name",
    "value",
    "turn_id",
    "item_id",
    "weight",
    "source",
    "metadata",
)


class _SessionKeyError(ValueError):
    """A client named a session by a key that cannot be one."""


class _ClientGoneError(Exception):
    """The client closed its connection while the answer was being forwarded."""


class _BusyError(Exception):
    """A request's body does not fit in what is left of the request body budget."""


# Seconds a client refused for the budget is told to wait: bodies are parsed and recorded in
# milliseconds to a second or so, and the SDKs wait what Retry-After says before retrying.
_BUSY_RETRY_AFTER = 1


class BodyBudget:
    """The request body bytes being read, parsed and recorded at once, across all requests
    (GatewaySettings.request_body_budget). Parsed, a body of many small messages takes 16
    times its bytes: without a bound, a few clients' bodies took the gateway's memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self) -> BodyCharge:
        return BodyCharge(self)


class BodyCharge:
    """What one request holds of the budget: its body's bytes as they are read, until its
    call is recorded (then only the body's bytes stay, on their way upstream) or refused."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held = 0

    def fits(self, size: int) -> bool:
        return self._budget.used + size <= self._budget.limit

    def add(self, size: int) -> None:
        """Hold size more bytes; _BusyError when they do not fit."""
        if not self.fits(size):
            raise _BusyError()
        self._budget.used += size
        self.held += size

    def release(self) -> None:
        self._budget.used -= self.held
        self.held = 0


class Gateway:
    """`await Gateway.start(settings)`, then `.url`, then `await .stop()`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.sessions = Sessions(settings.trace_root, settings.session_idle_timeout)
        self.body_budget = BodyBudget(settings.request_body_budget)
        self._upstream: Upstream | None = None
        self._local_model: LocalModel | None = None
        # --replay-from: the recorded upstream answers (and passes what diverges on, if asked).
        self._replay: ReplayModel | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._token = settings.agent.access.token
        # Bound to loopback without a token, only loopback's names are answered: a web page
        # reaching it by its own name through DNS rebinding could spend the upstream's key
        # and read every session.
        self._loopback_names_only = self._token is None and is_loopback(
            split_listen(settings.listen)[0]
        )
        self._scheme = "http"
        self.port = 0
        self.host = ""
        self._stopping: asyncio.Task[None] | None = None
        # The requests being handled: on stop they get the grace, then are cancelled.
        self._handling: set[asyncio.Task[Any]] = set()
        self.observers: list[CallObserver] = []
        self._live_export: LiveExport | None = None

    # -- life ----------------------------------------------------------------------------------

    @classmethod
    async def start(cls, settings: GatewaySettings) -> Gateway:
        gateway = cls(settings)
        await gateway._start()
        return gateway

    async def _start(self) -> None:
        # An address in use is said first, before the model starts and logs.
        refuse_address_in_use(*split_listen(self.settings.listen), self.settings.listen)
        agent = self.settings.agent
        open_to = open_listen_warning(
            "--listen", self.settings.listen, agent.access, "sends requests upstream"
        )
        if open_to is not None:
            log.warning("%s", open_to)
        base_url = agent.provider_url
        if agent.replay_from is not None:
            self._replay = await ReplayModel.from_settings(agent)
            base_url = self._replay.url
            log.info("replaying %s at %s", agent.replay_from, base_url)
        elif base_url is None:
            self._local_model = await LocalModel.start(agent.local_word_delay, full_protocol=True)
            base_url = self._local_model.url
            log.info("no --upstream given: using the built-in local model at %s", base_url)
        self._upstream = Upstream(
            base_url,
            agent.api_key,
            agent.stream_idle_timeout,
            max_connections=agent.provider_max_connections,
        )
        app = web.Application(
            client_max_size=self.settings.max_request_bytes, middlewares=[self._guard]
        )
        for prefix in ("", "/s/{session}"):
            app.router.add_post(f"{prefix}/v1/responses", self._responses_call)
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat_call)
            app.router.add_get(f"{prefix}/v1/models", self._models)
        app.router.add_post("/rollout/v1/sessions/{session}/close", self._close_session)
        app.router.add_get("/rollout/v1/sessions", self._list_sessions)
        app.router.add_post("/rollout/v1/rewards", self._reward)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        # A client that goes away cancels its handler, and so its upstream request; one that
        # sends no request head within the read timeout loses its connection, as one that
        # trickles its body gets a 408.
        self._runner = web.AppRunner(
            app,
            **http_runner_options(f"{__name__}.http", self.settings.request_read_timeout),
            shutdown_timeout=_STOP_GRACE,
        )
        await self._runner.setup()
        host, port = split_listen(self.settings.listen)
        self._site = web.TCPSite(self._runner, host, port, ssl_context=self._ssl_context())
        try:
            # Before the first request can come; stopped with the rest if the start fails.
            self._live_export = telemetry.start_live_export(agent)
            try:
                await self._site.start()
            except OSError as error:
                # `cannot listen on HOST:PORT: address already in use`, as every server says.
                raise listen_error(self.settings.listen, error) from error
        except BaseException:
            await self._close_parts()
            raise
        server = self._site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.host, self.port = host, sockets[0].getsockname()[1] if sockets else port
        self.sessions.start()

    def _ssl_context(self) -> ssl.SSLContext | None:
        access = self.settings.agent.access
        if access.tls_cert is None or access.tls_key is None:
            return None
        self._scheme = "https"
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        # The ssl module loads a chain only from files: written private, read, removed.
        with tempfile.TemporaryDirectory(prefix="rollout-gateway-tls-") as folder:
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            for path, data in ((cert, access.tls_cert), (key, access.tls_key)):
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "wb") as file:
                    file.write(data)
            context.load_cert_chain(cert, key)
        return context

    @property
    def url(self) -> str:
        """The base URL clients use (`OPENAI_BASE_URL`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self._scheme}://{host}:{self.port}/v1"

    @property
    def replay(self) -> ReplayBook | None:
        """What the replay answered so far (with --replay-from)."""
        return self._replay.book if self._replay is not None else None

    @property
    def upstream_url(self) -> str:
        assert self._upstream is not None
        return self._upstream.display_url

    async def stop(self) -> None:
        """Stop taking requests, cancel the running ones (recorded CANCELLED), finish every
        session's bundle. Every caller waits for the same one."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        try:
            if self._site is not None:
                await self._site.stop()
            if self._runner is not None and self._runner.server is not None:
                # Idle keep-alive connections close now; busy ones after their answer.
                self._runner.server.pre_shutdown()
            await self._finish_handling()
            if self._runner is not None:
                await self._runner.cleanup()
        finally:
            await self.sessions.close_all("shutdown")
            await self._close_parts()

    async def _finish_handling(self) -> None:
        """Give the running requests _STOP_GRACE, then cancel the rest (a call records itself
        CANCELLED, reason `shutdown`, as it unwinds).

        Not left to aiohttp's own shutdown: it waits its timeout for the handlers, then only
        fails their request bodies and waits the timeout again before it cancels them, so a
        call got twice the grace, and one that finished within that was never cancelled."""
        running = set(self._handling)
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=_STOP_GRACE)
        for task in late:
            task.cancel()
        if late:
            # A cancelled call only records its end and releases its upstream answer.
            await asyncio.wait(late, timeout=_STOP_GRACE)

    async def _close_parts(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._local_model is not None:
            await self._local_model.stop()
        if self._replay is not None:
            await self._replay.stop()
        # After the sessions' bundles are finished: what is queued goes out.
        live, self._live_export = self._live_export, None
        await telemetry.stop_live_export(live, _STOP_GRACE)

    # -- plumbing ------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """The body's declared size, the clients' bearer token; no exception reaches a client
        as a traceback."""
        declared = request.content_length
        if declared is not None and declared > self.settings.max_request_bytes:
            # Refused on what the client declares, before reading any of it: waiting for a
            # body that may never come held the connection until the read timeout.
            return await _refuse_unread_body(request, self._too_large())
        if self._loopback_names_only and not addressed_to_loopback(request.headers.get("Host")):
            return error_response(
                403,
                "forbidden_host",
                "this gateway answers only requests to localhost, 127.0.0.1 or [::1] (it has "
                "no token); serve it with --auth-token-env to reach it by another name",
            )
        if self._token is not None:
            # Any bytes a client sends are compared, never encoded as they came: a header
            # that is not UTF-8 was a 500 (aiohttp decodes it to lone surrogates).
            token = bearer_token(request.headers.get("Authorization", ""))
            if token is None or not same_secret(token, self._token):
                # An OpenAI SDK sends its API key as the bearer token: the key (OPENAI_API_KEY)
                # is where a client of this gateway puts the gateway's token.
                return error_response(
                    401,
                    "invalid_api_key",
                    "the gateway needs `Authorization: Bearer <token>`: an OpenAI client sends "
                    "its API key (OPENAI_API_KEY) as the token, so set it to the gateway's",
                )
        task = asyncio.current_task()
        if task is not None:
            self._handling.add(task)
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status == 413:
                return self._too_large()
            raise
        except (ConnectionResetError, _ClientGoneError):
            raise
        except Exception:  # logged; the client gets a clean 500 (no traceback)
            log.exception("gateway request %s %s failed", request.method, request.path)
            return error_response(500, "internal_error", "internal gateway error")
        finally:
            self._handling.discard(task)

    def _busy(self) -> web.Response:
        response = error_response(
            503,
            "gateway_busy",
            "the gateway is reading and recording as many request bodies as its "
            f"--request-body-budget ({self.settings.request_body_budget} bytes) allows; "
            f"retry after {_BUSY_RETRY_AFTER} s",
        )
        response.headers["Retry-After"] = str(_BUSY_RETRY_AFTER)
        return response

    def _too_large(self) -> web.Response:
        return error_response(
            413,
            "request_too_large",
            f"the request body is over {self.settings.max_request_bytes} bytes",
        )

    async def _not_found(self, request: web.Request) -> web.Response:
        message = f"the gateway serves no {request.method} {request.path}"
        if not request.path.startswith("/rollout/"):
            # An SDK given the gateway's address without /v1 (OPENAI_BASE_URL=http://HOST:PORT)
            # posts /chat/completions: the answer says which base URL it needs.
            message += (
                f": an OpenAI client's base URL (OPENAI_BASE_URL) is {self.url}, where it serves "
                "POST /v1/responses, POST /v1/chat/completions and GET /v1/models"
            )
        return error_response(404, "not_found", message)

    # -- upstream calls ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        upstream = self._upstream
        assert upstream is not None
        # The client's Authorization goes upstream only when it is not the gateway's own token.
        authorization = request.headers.get("Authorization") if self._token is None else None
        headers = upstream.headers_for(request.headers, "", authorization)
        headers.pop("x-rollout-inference-call-id", None)
        redactor = upstream.redactor_for(authorization)
        try:
            answer = await upstream.open("GET", "/models", headers, None)
        except ProviderError as error:
            return error_response(upstream_status(error), error.code, error.message)
        try:
            # Bounded as every answer the gateway reads whole: an upstream that sends without
            # end was read into memory to its end.
            body = await read_limited(answer, MAX_EVENT_BYTES + 1, errors=True)
        except aiohttp.SocketTimeoutError:
            silent = idle_failure("inside its answer")
            return error_response(upstream_status(silent), silent.code, silent.message)
        except aiohttp.ClientError as error:
            return error_response(502, "upstream_unreachable", redactor.text(upstream_text(error)))
        finally:
            release(answer)
        if len(body) > MAX_EVENT_BYTES:
            return error_response(
                502, "response_too_large", f"the upstream's answer is over {MAX_EVENT_BYTES} bytes"
            )
        body = _redacted_error(redactor, body) if answer.status >= 400 else redactor.data(body)
        return web.Response(status=answer.status, body=body, headers=_client_headers(answer))

    async def _responses_call(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, RESPONSES)

    async def _chat_call(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, CHAT)

    async def _read_body(self, request: web.Request, charge: BodyCharge) -> bytes:
        """The request's body, read within the request read timeout (TimeoutError past it),
        each piece charged to the body budget as it arrives (_BusyError when it does not fit:
        a body its Content-Length says will not fit is refused before any of it is read)."""
        declared = request.content_length
        if declared is not None and not charge.fits(declared):
            raise _BusyError()
        limit = self.settings.max_request_bytes
        pieces: list[bytes] = []
        async with asyncio.timeout(self.settings.request_read_timeout):
            # Read here, not with request.read(), which keeps the body for the request's life.
            while piece := await request.content.readany():
                if charge.held + len(piece) > limit:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limit, actual_size=charge.held + len(piece)
                    )
                charge.add(len(piece))
                pieces.append(piece)
        return b"".join(pieces)

    async def _read_or_refuse(
        self, request: web.Request, charge: BodyCharge
    ) -> bytes | web.Response:
        """The body, or the answer to a request whose body is too slow or over the budget."""
        try:
            return await self._read_body(request, charge)
        except TimeoutError:
            return _slow_body(self.settings.request_read_timeout)
        except _BusyError:
            # At once; aiohttp then reads what is left of the body and drops it (for up to its
            # lingering time), holding none of it, so that a client which sends its whole body
            # before it reads (the SDKs' HTTP clients) gets the 503, not a broken connection.
            return self._busy()

    async def _call(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        charge = self.body_budget.charge()
        try:
            return await self._charged_call(request, dialect, charge)
        finally:
            charge.release()

    async def _charged_call(
        self, request: web.Request, dialect: Dialect, charge: BodyCharge
    ) -> web.StreamResponse:
        raw = await self._read_or_refuse(request, charge)
        if isinstance(raw, web.Response):
            return raw
        body = loads(raw)
        if not isinstance(body, dict):
            return error_response(400, "invalid_json", "the request body must be a JSON object")
        entries = dialect.entries(body)
        if len(entries) > MAX_CALL_ITEMS:
            # Before its items are made: each a copy of its entry, 165 MiB more for 900,000
            # small messages, only to be refused.
            return _too_many_items(len(entries))
        items = dialect.items(entries)
        refused = _unrecordable(body, items)
        if refused is not None:
            # Before a session is chosen: a record the bundle cannot hold stopped the
            # session's recording for good (every later call of it 503, its bundle UNCLOSED).
            return refused
        model = _model(body)
        try:
            session = await self._session_for(request, dialect, body, entries, model)
        except _SessionKeyError as error:
            return error_response(400, "invalid_session", str(error))
        except RecordingError as error:
            return error_response(
                503, "recording_unavailable", f"failed to start rollout recording: {error}"
            )
        if session.closed:
            # Closed while its bundle was being created: nothing of this call was recorded.
            return _session_closed(session.key)
        session.calls_running += 1
        session.last_used = time.monotonic()
        try:
            forward = self._record_and_forward(
                request, dialect, session, body, raw, entries, items, charge
            )
            # The call drops the parsed request once it is recorded: nothing here keeps it.
            del body, raw, entries, items
            return await forward
        finally:
            session.calls_running -= 1
            session.last_used = time.monotonic()
            self.sessions.calls_ended(session)

    async def _session_for(
        self,
        request: web.Request,
        dialect: Dialect,
        body: dict[str, Any],
        entries: list[dict[str, Any]],
        model: str,
    ) -> Session:
        """The session a request belongs to (see docs/gateway.md for the rule)."""
        named = request.headers.get(SESSION_HEADER, "").strip()
        if named:
            key, reason = (
                SessionKey(named, SOURCE_HEADER),
                f"new key in the {SESSION_HEADER} header",
            )
        elif request.match_info.get("session"):
            key = SessionKey(request.match_info["session"], SOURCE_PATH)
            reason = "new key in the /s/{session}/ path prefix"
        else:
            hinted = _header_hint(request) or dialect.hint(body, self.sessions)
            continued = None
            if hinted is None:
                fingerprints = [dialect.fingerprint(entry) for entry in entries]
                continued = self.sessions.continuing(
                    fingerprints,
                    without_instructions(entries, fingerprints),
                    retry=_is_retry(request),
                )
            if hinted is not None:
                key = hinted
                reason = f"new key in the request's {hinted.source.partition(':')[2]}"
            elif continued is not None:
                return continued
            else:
                key = SessionKey(f"auto-{uuid.uuid4().hex}", SOURCE_NEW)
                reason = (
                    "no session header, path prefix or hint, and the input extends no open "
                    "session's last request and response"
                )
        # Hints are made into keys that are always usable; a key a client names must be one.
        problem = session_key_problem(key.key) if key.source in _NAMED else ""
        if problem:
            raise _SessionKeyError(f"the session key in the {key.source}: {problem}")
        session, _ = await self.sessions.get_or_create(key, model=model, reason=reason)
        return session

    def _place(
        self,
        dialect: Dialect,
        session: Session,
        entries: list[dict[str, Any]],
        fingerprints: tuple[str, ...],
        traceparent: str = "",
    ) -> int:
        """Start or continue the session's turn for a request; its turn's ordinal.
        fingerprints: the request's, its instructions as `without_instructions` has them.

        New entries are those past what the request shares with the last exchange (its
        instructions aside: a handoff changes them, and goes on with the turn): a user message
        among them starts a turn; tool outputs continue the current one."""
        # The longest of the last exchange and its other choices (n > 1) the request shares:
        # a client going on with choice 1 sends it back, and it is no new input of the turn.
        shared = 0
        exchanges = [(session.masked or session.exchange)]
        exchanges += [masked or exact for exact, masked in session.other_choices]
        for exchange in exchanges:
            common = 0
            for mine, theirs in zip(exchange, fingerprints, strict=False):
                if mine != theirs:
                    break
                common += 1
            shared = max(shared, common)
        new = dialect.items(entries[shared:])
        for item in new:
            call_id = tool_output(item)
            if call_id is not None:
                session.tool_output(call_id, item)
        if session.turn is None or any(starts_turn(item) for item in new):
            opening = [item for item in new if not tool_output(item)] or new
            session.begin_turn(opening, traceparent)
        assert session.turn is not None
        return session.turn.ordinal

    async def _record_and_forward(
        self,
        request: web.Request,
        dialect: Dialect,
        session: Session,
        body: dict[str, Any],
        raw: bytes,
        entries: list[dict[str, Any]],
        items: list[dict[str, Any]],
        charge: BodyCharge,
    ) -> web.StreamResponse:
        upstream = self._upstream
        assert upstream is not None
        recorder = session.recorder
        # The caller's W3C trace context becomes the parent of the turn this request starts.
        traceparent = request.headers.get("traceparent", "").strip()
        fingerprints = tuple(dialect.fingerprint(entry) for entry in entries)
        masked = without_instructions(entries, fingerprints)
        turn_ordinal = self._place(dialect, session, entries, masked or fingerprints, traceparent)
        # With --token-ids a Chat upstream is asked for the engine's ids; a client that did
        # not ask for them never sees them.
        strip = False
        if self.settings.token_ids and dialect is CHAT and body.get("return_token_ids") is None:
            body = {**body, "return_token_ids": True}
            raw = json.dumps(body).encode()
            strip = True
        assert session.turn is not None
        call_id = new_call_id()
        ordinal = recorder.inference_started(
            turn_ordinal,
            call_id=call_id,
            attempt=1,
            model=_model(body, any_value=True),
            provider_base_url=upstream.display_url,
            envelope=dialect.envelope(body),
            input_items=items,
            provider_api=dialect.provider_api,
            input_as_string=dialect.input_as_string(body),
        )
        # Recorded: the parsed request goes (a body of small messages takes many times its
        # bytes), and with it the call's charge to the body budget; the body's own bytes stay
        # until the upstream has them.
        del body, entries, items
        charge.release()
        if recorder.status != _RECORDING:
            return _recording_failed(_stopped(recorder))
        authorization = request.headers.get("Authorization") if self._token is None else None
        call = CallRecorder(
            dialect, session, ordinal, session.turn.id, upstream.redactor_for(authorization)
        )
        session.call_started(call.turn_id)
        task = asyncio.current_task()
        assert task is not None
        # From here to the first await nothing yields: a close finds the call registered.
        running = session.running[ordinal] = RunningCall(task)
        outcome = _Outcome(call, running)
        outcome.strip = strip
        headers = upstream.headers_for(request.headers, call_id, authorization)
        answer: aiohttp.ClientResponse | None = None
        try:
            try:
                answer = await upstream.open("POST", dialect.path, headers, raw)
            except ProviderError as error:
                outcome.fail(error)
                self._end(session, call, ordinal, outcome)
                return error_response(upstream_status(error), error.code, error.message)
            if answer.status >= 400:
                return await self._forward_error(session, call, ordinal, outcome, answer)
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._forward_stream(request, session, call, ordinal, outcome, answer)
            return await self._forward_body(session, call, ordinal, outcome, answer)
        except asyncio.CancelledError:
            # The client went away, the gateway is stopping, or the session was closed (before
            # the upstream answered): the upstream request ends too.
            if not _cut_by_close(running):
                outcome.cancel(self._cancel_reason())
                self._end(session, call, ordinal, outcome)
                raise
            outcome.cancel(SESSION_CLOSED)
            self._end(session, call, ordinal, outcome)
            return _session_closed(session.key)
        finally:
            del session.running[ordinal]
            running.end()
            if answer is not None:
                release(answer)
            outputs = tuple(call.output_fingerprints())
            # A client may go on with any choice of an answer of n > 1 (choice 0 is the
            # recorded output): each is an exchange the next request may extend.
            others = [tuple(other) for other in call.other_choice_fingerprints()]
            self.sessions.exchanged(
                session,
                fingerprints + outputs,
                None if masked is None else masked + outputs,
                call.response_id,
                [(fingerprints + o, None if masked is None else masked + o) for o in others],
            )
            if session.calls_running == 1:
                # The accepted items were wanted for this exchange only: a long session must
                # not hold its whole conversation (the client holds it, and the bundle).
                session.thread.history.clear()

    async def _forward_error(
        self,
        session: Session,
        call: CallRecorder,
        ordinal: int,
        outcome: _Outcome,
        answer: aiohttp.ClientResponse,
    ) -> web.StreamResponse:
        # What the upstream echoes of the key or the URL's credentials is taken out of what is
        # recorded and of what the client gets.
        body = _redacted_error(call.redactor, await read_limited(answer, _ERROR_BODY_LIMIT))
        error = http_error(
            answer.status,
            body,
            call.redactor,
            answer.reason or "",
            answer.headers.get("retry-after"),
        )
        session.recorder.provider_event(ordinal, "http_error", body.decode("utf-8", "replace"))
        outcome.fail(error)
        self._end(session, call, ordinal, outcome)
        if session.recorder.status != _RECORDING:
            return _recording_failed(_stopped(session.recorder))
        return self._answer(session, answer, body)

    async def _forward_body(
        self,
        session: Session,
        call: CallRecorder,
        ordinal: int,
        outcome: _Outcome,
        answer: aiohttp.ClientResponse,
    ) -> web.StreamResponse:
        try:
            body = call.redactor.data(await read_limited(answer, MAX_EVENT_BYTES + 1, errors=True))
        except aiohttp.SocketTimeoutError:
            failure = idle_failure("inside its answer")
            outcome.fail(failure)
            self._end(session, call, ordinal, outcome)
            return error_response(upstream_status(failure), failure.code, failure.message)
        except aiohttp.ClientError as error:
            outcome.fail(ProviderError("connection_error", f"upstream body lost: {error}"))
            self._end(session, call, ordinal, outcome)
            return error_response(502, "upstream_unreachable", "the upstream answer broke off")
        if len(body) > MAX_EVENT_BYTES:
            message = f"the upstream's answer is over {MAX_EVENT_BYTES} bytes"
            outcome.fail(ProviderError("response_too_large", message))
            self._end(session, call, ordinal, outcome)
            return error_response(502, "response_too_large", message)
        text = body.decode("utf-8", "replace")
        parsed = loads(body)
        if isinstance(parsed, dict) and may_hold_lone_surrogates(body):
            # As a streamed event's data is read (parse_event): U+FFFD for each lone surrogate
            # (was: UnicodeEncodeError recording an id or text, a 500 for the upstream's 200);
            # None, read as no object, when nested past MAX_EVENT_DEPTH.
            parsed = without_lone_surrogates(parsed)
        try:
            call.on_body(parsed, text)
            outcome.complete()
        except ProviderError as error:
            outcome.fail(error)
        self._end(session, call, ordinal, outcome)
        if session.recorder.status != _RECORDING:
            return _recording_failed(_stopped(session.recorder))
        if outcome.strip:
            parsed = loads(body)
            if isinstance(parsed, dict):
                body = json.dumps(_strip_ids(parsed)).encode()
        return self._answer(session, answer, body)

    def _answer(
        self, session: Session, answer: aiohttp.ClientResponse, body: bytes
    ) -> web.Response:
        headers = _client_headers(answer)
        _tag(headers, session)
        return web.Response(status=answer.status, body=body, headers=headers)

    async def _forward_stream(
        self,
        request: web.Request,
        session: Session,
        call: CallRecorder,
        ordinal: int,
        outcome: _Outcome,
        answer: aiohttp.ClientResponse,
    ) -> web.StreamResponse:
        headers = _client_headers(answer)
        _tag(headers, session)
        response = web.StreamResponse(status=answer.status, headers=headers)
        recorder = session.recorder
        splitter = SseSplitter()
        terminal = False
        try:
            await response.prepare(request)
            # An event that echoes the key (an `error` quoting the request) is recorded and
            # passed on without it, even when the key came in two reads; what the redactor held
            # back at the end comes last, before the splitter's rest.
            async for chunk in call.redactor.chunks(answer.content.iter_any()):
                ready, events = splitter.feed(chunk)
                if splitter.held > MAX_EVENT_BYTES:
                    # One event without end: nothing of it went out, and no more is read.
                    outcome.fail(
                        ProviderError(
                            "event_too_large",
                            f"an upstream event is over {MAX_EVENT_BYTES} bytes",
                            reason="event_too_large",
                        )
                    )
                    _drop_connection(request)
                    return response
                if events and not outcome.over:
                    try:
                        terminal = call.on_events(events) or terminal
                        if terminal:
                            outcome.complete()
                    except ProviderError as error:
                        outcome.fail(error)
                if recorder.status != _RECORDING:
                    # Nothing unrecorded goes out: the client is told why, and the call ends.
                    await _write(response, _recording_failed_event(_stopped(recorder)))
                    outcome.fail(ProviderError("recording_failed", _stopped(recorder)))
                    return response
                if ready:
                    await _write(response, _without_ids(events) if outcome.strip else ready)
            rest = splitter.rest()
            if rest:
                await _write(response, rest)
            if not outcome.over:
                try:
                    # A Chat stream may end without `[DONE]` once its choices all finished: the
                    # SDK takes it whole (was: recorded FAILED though the client had its answer).
                    if call.on_end_of_stream():
                        outcome.complete()
                except ProviderError as error:
                    outcome.fail(error)
            if not outcome.over:
                outcome.fail(
                    ProviderError(
                        "stream_ended",
                        stream_ended_message("upstream"),
                        reason="stream_ended",
                    )
                )
            await response.write_eof()
        except _ClientGoneError:
            outcome.cancel("client_disconnected")
        except asyncio.CancelledError:
            if not _cut_by_close(outcome.running):
                outcome.cancel(self._cancel_reason())
                raise
            return await self._cut_off(request, response, session, call, ordinal, outcome)
        except aiohttp.ServerTimeoutError:
            outcome.fail(idle_failure("inside its stream"))
            _drop_connection(request)
        except aiohttp.ClientError as error:
            outcome.fail(
                ProviderError(
                    "connection_error", f"the upstream stream broke: {upstream_text(error)}"
                )
            )
            _drop_connection(request)
        finally:
            if not outcome.ended:
                self._end(session, call, ordinal, outcome)
        return response

    async def _cut_off(
        self,
        request: web.Request,
        response: web.StreamResponse,
        session: Session,
        call: CallRecorder,
        ordinal: int,
        outcome: _Outcome,
    ) -> web.StreamResponse:
        """The session was closed while the call streamed: the call is recorded CANCELLED with
        what had arrived (its end first: the close waits for that, not for the client), then
        the client's stream ends cleanly with a `session_closed` error event after the events
        it had. A call whose answer had ended just gets the end of its stream."""
        cut = not outcome.over
        outcome.cancel(SESSION_CLOSED)
        self._end(session, call, ordinal, outcome)
        if not response.prepared:
            return _session_closed(session.key)
        try:
            if cut:
                await _write(response, _error_event(SESSION_CLOSED, _closed_message(session.key)))
            await response.write_eof()
        except (_ClientGoneError, ConnectionResetError):
            _drop_connection(request)
        return response

    def _cancel_reason(self) -> str:
        return "client_disconnected" if self._stopping is None else "shutdown"

    def _end(self, session: Session, call: CallRecorder, ordinal: int, outcome: _Outcome) -> None:
        """Record the call's inference_ended (once), then tell the observers."""
        if outcome.ended:
            return
        outcome.ended = True
        # A close waiting for the call can go on once this end is recorded.
        outcome.running.end()
        status = outcome.status
        error = outcome.error
        trace_error = None
        if error is not None:
            trace_error = common_pb2.TraceError(
                code=error.code, message=error.message, http_status=error.http_status
            )
        stop = classify_stop(
            status,
            reason=call.incomplete_reason or outcome.reason,
            error_code=error.code if error is not None else "",
            http_status=error.http_status if error is not None else 0,
        )
        session.recorder.inference_ended(
            ordinal,
            status,
            reason=outcome.reason,
            response_id=call.response_id,
            usage=call.usage,
            error=trace_error,
            stop_reason=stop,
        )
        session.call_ended(call.turn_id, status)
        # The call's span can go out (a live OTLP export); its turn's waits for the turn.
        telemetry.bundle_advanced(session.recorder.bundle_path)
        for observer in self.observers:
            observer(session, call.response_id, status)

    # -- the gateway's own endpoints -----------------------------------------------------------

    async def _close_session(self, request: web.Request) -> web.Response:
        key = request.match_info["session"]
        # A close under way is waited for, as a second close of a session is answered.
        session = self.sessions.find(key) or self.sessions.closing(key)
        if session is None:
            closed = self.sessions.closed(key)
            if closed is None:
                return error_response(404, "session_not_found", f"no session {key!r}")
        else:
            closed = await self.sessions.close(session, "closed by client")
        return web.json_response(
            {
                "session": closed.key,
                "thread_id": closed.thread_id,
                "bundle_path": closed.bundle_path,
                "status": "closed",
            }
        )

    async def _list_sessions(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "sessions": [
                    {
                        "session": session.key,
                        "thread_id": session.thread.id,
                        "bundle_path": session.recorder.bundle_path,
                        "turns": session.turn_count,
                        "calls_running": session.calls_running,
                    }
                    for session in self.sessions.open
                ]
            }
        )

    async def _reward(self, request: web.Request) -> web.Response:
        """POST {session, name, value, turn_id?, item_id?, weight?, source?, metadata?}: one
        reward beside the session's bundle (the RecordReward sidecar); a closed session's
        turn and item are checked against its reduced bundle, as RecordReward checks them."""
        charge = self.body_budget.charge()
        try:
            raw = await self._read_or_refuse(request, charge)
            if isinstance(raw, web.Response):
                return raw
            return await self._record_reward(loads(raw))
        finally:
            charge.release()

    async def _record_reward(self, body: Any) -> web.Response:
        if not isinstance(body, dict):
            return error_response(400, "invalid_json", "the request body must be a JSON object")
        unknown = sorted(name for name in body if name not in _REWARD_FIELDS)
        if unknown:
            # A misspelt target (`turn` for `turn_id`) would otherwise put the reward on the
            # whole thread without a word.
            return error_response(
                400,
                "invalid_reward",
                f"unknown field {unknown[0]!r}: a reward takes {', '.join(_REWARD_FIELDS)}",
            )
        key = body.get("session")
        if not isinstance(key, str) or not key:
            return error_response(400, "invalid_session", "session is required, as a string")
        found = self.sessions.find(key)
        closed = self.sessions.closed(key) if found is None else None
        if found is not None:
            thread_id = found.thread.id
            bundle, trace_id = found.recorder.bundle_path, found.recorder.trace_id
        elif closed is not None:
            thread_id, bundle, trace_id = closed.thread_id, closed.bundle_path, closed.trace_id
        else:
            return error_response(404, "session_not_found", f"no session {key!r}")
        try:
            reward = RewardInput(
                thread_id=thread_id,
                name=_field(body, "name", str, ""),
                value=_number(body, "value", float("nan")),
                turn_id=_field(body, "turn_id", str, ""),
                item_id=_field(body, "item_id", str, ""),
                weight=_number(body, "weight", 0.0),
                source=_field(body, "source", str, ""),
                metadata={
                    _text(k, "metadata"): _text(
                        v if isinstance(v, str) else json.dumps(v), "metadata"
                    )
                    for k, v in _field(body, "metadata", dict, {}).items()
                },
                recorded_by="gateway",
            )
            check_reward(reward)
            if found is not None and reward.turn_id and reward.turn_id not in found.thread.turns:
                return error_response(404, "turn_not_found", f"no turn {reward.turn_id!r}")
            if (
                found is not None
                and reward.item_id
                and reward.item_id not in found.thread.accepted_items
            ):
                return error_response(404, "item_not_found", f"no item {reward.item_id!r}")
            checked = closed is not None and bool(reward.turn_id or reward.item_id)
            answer = await asyncio.to_thread(
                self._append_reward, Path(bundle).name, reward, trace_id, checked=checked
            )
            if isinstance(answer, web.Response):
                return answer
            seq = answer
        except RewardError as error:
            return error_response(400, error.reason.lower(), str(error))
        except TypeError as error:
            return error_response(400, "invalid_reward", str(error))
        return web.json_response({"thread_id": thread_id, "bundle_path": bundle, "seq": seq})

    def _append_reward(
        self, name: str, reward: RewardInput, trace_id: str, *, checked: bool
    ) -> int | web.Response:
        """Append the reward beside the session's bundle, `name` under the trace root, opened
        from the root through descriptors that follow no link and written through its
        directory's (a directory swapped for a symbolic link leads nowhere outside the root);
        `checked`: the turn or item it names looked for in the bundle first."""
        try:
            bundle = BundleRoot(self.settings.trace_root).open(name)
        except BundleError as error:
            return error_response(409, "bundle_unreadable", str(error))
        with bundle:
            if checked:
                try:
                    trace = replay_confined(bundle)
                except (BundleError, ReductionError) as error:
                    return error_response(409, "bundle_unreadable", str(error))
                missing = missing_reward_target(trace, reward.turn_id, reward.item_id)
                if missing is not None:
                    named = reward.turn_id if missing == "turn" else reward.item_id
                    return error_response(404, f"{missing}_not_found", f"no {missing} {named!r}")
            bundle_dir = Path(bundle.display_dir)
            return append_reward(bundle_dir, reward, trace_id=trace_id, dir_fd=bundle.dir_fd)


class _Outcome:
    """How a call ended, decided once: completed, failed with an error, or cancelled."""

    def __init__(self, call: CallRecorder, running: RunningCall) -> None:
        self.call = call
        self.running = running
        self.status: common_pb2.ExecutionStatus.ValueType = common_pb2.EXECUTION_STATUS_RUNNING
        self.reason = ""
        self.error: ProviderError | None = None
        self.ended = False
        # The client gets the upstream's answer without the token ids the gateway asked for.
        self.strip = False

    @property
    def over(self) -> bool:
        return self.status != common_pb2.EXECUTION_STATUS_RUNNING

    def complete(self) -> None:
        if not self.over:
            self.status, self.reason = COMPLETED, "response.completed"

    def fail(self, error: ProviderError) -> None:
        if not self.over:
            self.status, self.reason, self.error = FAILED, error.reason, error

    def cancel(self, reason: str) -> None:
        if not self.over:
            self.status, self.reason = CANCELLED, reason


def _unrecordable(body: dict[str, Any], items: list[dict[str, Any]]) -> web.Response | None:
    """The refusal of a request the bundle could not record: a model name longer than the
    agent API takes (written whole into the thread's and each call's record), or more items
    than one record can name (a call's record lists each by its payload id, 34 bytes)."""
    model = _model(body, any_value=True)
    if len(model) > MAX_MODEL_CHARS:
        return error_response(
            400,
            "invalid_model",
            f"model must be at most {MAX_MODEL_CHARS} characters, not {len(model)}",
        )
    if len(items) > MAX_CALL_ITEMS:
        return _too_many_items(len(items))
    return None


def _too_many_items(count: int) -> web.Response:
    return error_response(
        413,
        "too_many_items",
        f"the request's conversation is {count} items; the gateway records at most "
        f"{MAX_CALL_ITEMS} a call",
    )


def _model(body: dict[str, Any], *, any_value: bool = False) -> str:
    """The model a request names, as a record can hold it: JSON's `\\ud800` escapes make lone
    surrogates, which no UTF-8 field carries (was: a 500, and the new session's bundle left
    UNCLOSED), so U+FFFD stands in for each, as for the rest of what the gateway records. The
    upstream still gets the body as the client sent it. A model that is no string is its
    text only with `any_value` (a call's record), else no model (the session's thread)."""
    model = body.get("model", "")
    if not isinstance(model, str):
        model = str(model) if any_value else ""
    return replace_lone_surrogates(model)


def _field(body: dict[str, Any], name: str, kind: Any, default: Any) -> Any:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} has the wrong type")
    return _text(value, name) if isinstance(value, str) else value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A JSON number as a float: an integer past float's range is infinite (refused as such
    by check_reward, like 1e400), never an OverflowError."""
    value = _field(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _text(value: str, name: str) -> str:
    """A string a record can hold: JSON's `\\udXXX` escapes can make lone surrogates, which
    no UTF-8 field carries."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TypeError(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return value


def _strip_ids(data: dict[str, Any]) -> dict[str, Any]:
    """A chunk or completion without the engine's token ids (vLLM's `return_token_ids`)."""
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
    return data


def _without_ids(events: list[SseEvent]) -> bytes:
    """The events again, their token ids taken out (the only bytes the gateway rewrites)."""
    out = []
    for event in events:
        data = loads(event.data.encode())
        text = json.dumps(_strip_ids(data)) if isinstance(data, dict) else event.data
        head = f"event: {event.event}\n" if event.event else ""
        out.append(f"{head}data: {text}\n\n")
    return "".join(out).encode()


def _client_headers(answer: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The upstream's headers as the client gets them, a repeated one repeated (hop-by-hop
    ones are the gateway's)."""
    headers = answer.headers.copy()
    for name in HOP_HEADERS:
        headers.popall(name, None)
    return headers


def _tag(headers: CIMultiDict[str], session: Session) -> None:
    headers[SESSION_HEADER] = session.key
    headers[THREAD_HEADER] = session.thread.id


# Headers coding agents send with every request of one conversation (Codex: both, the same id).
_HINT_HEADERS = ("session_id", "conversation_id")


# The openai SDKs (Python, Node, Go, ...: Stainless-made) number each attempt of a request in
# this header, 0 for the first: with their default of two retries, every 408, 409, 429, 5xx or
# timeout sent the same conversation again, and the retry started a session of its own.
_RETRY_HEADER = "x-stainless-retry-count"


def _is_retry(request: web.Request) -> bool:
    count = request.headers.get(_RETRY_HEADER, "").strip()
    # Not int(): a header of 5,000 digits is past what int() converts.
    return count.isascii() and count.isdigit() and count.strip("0") != ""


def _header_hint(request: web.Request) -> SessionKey | None:
    for name in _HINT_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return hint_key(name, value)
    return None


def _stopped(recorder: Recorder) -> str:
    """Why a session's recording takes no more records: its failure, or its close."""
    return recorder.error or "the session was closed while the call ran"


def _recording_failed(cause: str) -> web.Response:
    return error_response(
        503,
        "recording_failed",
        f"the gateway could not record this call, so it forwards nothing: {cause}",
    )


def _recording_failed_event(cause: str) -> bytes:
    return _error_event(
        "recording_failed",
        f"the gateway could not record the rest of this call: {cause}",
        f"recording failed: {cause}",
    )


def _error_event(code: str, message: str, short: str = "") -> bytes:
    """An SSE `error` event, in the Responses API's shape (`code`, `message`) and with the
    `error` object the SDKs raise from a stream."""
    data = {
        "type": "error",
        "code": code,
        "message": message,
        "error": {"code": code, "message": short or message},
    }
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def _closed_message(key: str) -> str:
    return (
        f"session {key!r} was closed while this call ran: the call was cancelled and its "
        "upstream request closed"
    )


def _session_closed(key: str) -> web.Response:
    """The answer to a call its session's close cut off before anything was forwarded: 409,
    and no retry (the SDKs retry a 409 unless told not to; a retry would start a new
    session of the same key, though its client closed it)."""
    response = error_response(409, SESSION_CLOSED, _closed_message(key))
    response.headers["x-should-retry"] = "false"
    return response


def _cut_by_close(running: RunningCall) -> bool:
    """Whether the cancellation being handled is the session's close cutting the call off
    (taken back then: the call answers its client itself), rather than its client going away
    or the gateway stopping, which it stays. Asked once per cut."""
    if not running.cut:
        return False
    running.cut = False
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, RuntimeError) as error:
        raise _ClientGoneError() from error


async def _refuse_unread_body(request: web.Request, response: web.Response) -> web.Response:
    """Send response, then close the connection: the body it refuses is never read (aiohttp
    would otherwise read and drop it for up to its lingering time before the next request)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    _drop_connection(request)
    return response


def _drop_connection(request: web.Request) -> None:
    """End the client's connection without a clean end of stream: the answer broke off."""
    transport = request.transport
    if transport is not None:
        transport.close()


def upstream_text(error: Exception) -> str:
    return str(error) or type(error).__name__
