"""A provider that echoes what it was sent (its key, the URL's credentials) in its errors: the
echo reaches no bundle, log line, client event or reduced state."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agent_server.config import Secret
from agent_server.logs import JsonFormatter
from rollout.agent.v1 import agent_pb2
from tests.agent_server.conftest import Harness, StartAgent, reduce_with_cli
from tests.agent_server.test_hostile_provider import _bundle_files, one_turn

KEY = "sk-S3CRETKEY-0123456789"
PASSWORD = "S3CRETPW-pass"
QUERY = "S3CRETQ+1/x"  # as it reads decoded; in the URL percent-encoded
TOKEN_USER = "S3CRETUSERTOKEN"
# Each piece, as it would show if it leaked.
PIECES = ("S3CRET", "UzNDUkVU")  # the second: the start of base64("S3CRET...")

MODES = ("json-message", "json-code", "long-text", "sse-error", "sse-failed")


def _echo(request: web.Request) -> str:
    return f"{request.headers.get('Authorization', '')} {request.path_qs}"


class EchoProvider:
    """Answers every POST by repeating its Authorization header and path with query, in the
    way `mode` says."""

    def __init__(self) -> None:
        self.mode = MODES[0]
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> EchoProvider:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        echo = _echo(request)
        if self.mode == "json-message":
            return web.json_response({"error": {"message": f"bad key: {echo}"}}, status=401)
        if self.mode == "json-code":
            return web.json_response({"error": {"code": f"bad:{echo}"}}, status=401)
        if self.mode == "long-text":
            # The echo straddles the 2,000 characters a plain-text error is cut to.
            return web.Response(text="x" * 1990 + echo, status=500)
        event = (
            {"type": "error", "code": "denied", "message": f"bad key: {echo}"}
            if self.mode == "sse-error"
            else {
                "type": "response.failed",
                "response": {"id": "r", "error": {"code": echo, "message": f"no: {echo}"}},
            }
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await response.write_eof()
        return response


@pytest.fixture
async def echo() -> AsyncIterator[EchoProvider]:
    provider = await EchoProvider().start()
    yield provider
    await provider.stop()


def _leaks(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return [piece for piece in PIECES if piece in text]


def _server_log(caplog: pytest.LogCaptureFixture) -> str:
    """The product's log lines as the server writes them, structured fields included (the
    test's own provider logs what it was sent)."""
    formatter = JsonFormatter()
    return "\n".join(
        formatter.format(record)
        for record in caplog.records
        if record.name.startswith(("agent_server", "grpc_common"))
    )


async def _turn_leaks(agent: Harness, caplog: pytest.LogCaptureFixture) -> dict[str, list[str]]:
    with caplog.at_level(logging.DEBUG):
        final, events, thread = await one_turn(agent)
        await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread.id))
    assert final.status == agent_pb2.TURN_STATUS_FAILED, final
    state = await reduce_with_cli(Path(thread.bundle_path))
    files = await asyncio.to_thread(_bundle_files, Path(thread.bundle_path))
    return {
        "turn": _leaks(str(final)),
        "events": _leaks("".join(str(event) for event in events)),
        "log": _leaks(_server_log(caplog)),
        "bundle": [piece for data in files for piece in _leaks(data)],
        "state": _leaks(str(state)),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("auth", ["key", "password", "user-token"])
async def test_what_a_provider_echoes_of_its_credentials_is_never_kept_or_shown(
    start_agent: StartAgent,
    echo: EchoProvider,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    auth: str,
) -> None:
    echo.mode = mode
    query = "?api-key=S3CRETQ%2B1%2Fx&bare-S3CRET-token"
    if auth == "key":
        agent = await start_agent(provider_url=f"http://{echo.url}{query}", api_key=Secret(KEY))
    elif auth == "password":
        agent = await start_agent(provider_url=f"http://alice:{PASSWORD}@{echo.url}{query}")
    else:
        agent = await start_agent(provider_url=f"http://{TOKEN_USER}@{echo.url}{query}")
    leaks = await _turn_leaks(agent, caplog)
    assert leaks == {name: [] for name in leaks}
