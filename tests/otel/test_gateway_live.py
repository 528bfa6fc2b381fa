"""agent-server gateway --otlp-endpoint: each call's span reaches a real OTLP receiver as the
call ends, its turn's when the turn ends, and a W3C `traceparent` header at the gateway
parents the turn it starts; spans of Chat Completions calls carry the engine's model and
finish reason."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra (make test installs it)")

import httpx
import openai
from opentelemetry import trace as trace_api
from opentelemetry.proto.trace.v1 import trace_pb2

from agent_server.config import Settings
from agent_server.gateway import Gateway, GatewaySettings
from tests.otel.test_cli import Received, grpc_receiver
from trace_reducer.export._otel import bundle_spans

_WAIT = 20.0
_REMOTE_TRACE = "0af7651916cd43dd8448eb211c80319c"
_REMOTE_SPAN = "b7ad6b7169203331"
_MODEL = "smollm2"


def _sent(received: Received) -> list[trace_pb2.Span]:
    return [
        span
        for request in received.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


async def _until(received: Received, name: str, count: int = 1) -> list[trace_pb2.Span]:
    deadline = time.monotonic() + _WAIT
    while sum(span.name == name for span in _sent(received)) < count:
        assert time.monotonic() < deadline, f"no {name!r} span: {received.spans()}"
        await asyncio.sleep(0.02)
    return _sent(received)


def _attributes(span: trace_pb2.Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            values[attribute.key] = [v.string_value for v in value.array_value.values]
        else:
            values[attribute.key] = getattr(value, kind) if kind else None
    return values


async def _gateway(tmp_path: Path, endpoint: str) -> Gateway:
    agent = Settings(
        trace_root=tmp_path / "traces",
        local_word_delay=0.0,
        otlp_endpoint=endpoint,
        otlp_protocol="grpc",
    )
    return await Gateway.start(GatewaySettings(agent=agent, listen="127.0.0.1:0"))


async def test_calls_and_turns_go_out_live_under_the_callers_traceparent(tmp_path: Path) -> None:
    async with grpc_receiver() as (url, received):
        gateway = await _gateway(tmp_path, url)
        try:
            client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
            session = {"x-rollout-session": "eval-7"}
            first = await client.chat.completions.create(
                model=_MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                stream=True,
                extra_headers={
                    **session,
                    "traceparent": f"00-{_REMOTE_TRACE}-{_REMOTE_SPAN}-01",
                },
            )
            answer = "".join([c.choices[0].delta.content or "" async for c in first if c.choices])
            # The call's span goes out as the call ends; its turn is still open.
            sent = await _until(received, f"chat {_MODEL}")
            assert not any(span.name in ("turn", "invoke_agent") for span in sent), sent
            # A new user message ends the first turn: its span follows.
            await client.chat.completions.create(
                model=_MODEL,
                messages=[
                    {"role": "user", "content": "Say hello."},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Again."},
                ],
                extra_headers=session,
                max_tokens=3,
                temperature=0.5,
                seed=7,
                stop=["\n\n"],
            )
            sent = await _until(received, "turn")
            assert not any(span.name == "invoke_agent" for span in sent)
            async with httpx.AsyncClient() as http:
                closed = await http.post(
                    gateway.url.removesuffix("/v1") + "/rollout/v1/sessions/eval-7/close"
                )
            assert closed.status_code == 200, closed.text
            bundle = closed.json()["bundle_path"]
            sent = await _until(received, "invoke_agent")
        finally:
            await gateway.stop()
    turns = [span for span in sent if span.name == "turn"]
    assert len(turns) == 2
    remote = next(span for span in turns if span.trace_id.hex() == _REMOTE_TRACE)
    assert remote.parent_span_id.hex() == _REMOTE_SPAN
    joined = [span for span in sent if span.parent_span_id == remote.span_id]
    assert [span.name for span in joined] == [f"chat {_MODEL}"]
    assert joined[0].trace_id == remote.trace_id
    # The second turn came without a traceparent: it stays under the session's span.
    other = next(span for span in turns if span is not remote)
    thread_span = next(span for span in sent if span.name == "invoke_agent")
    assert other.parent_span_id == thread_span.span_id
    # A Chat Completions call: the model that answered, why it stopped, the stream's first chunk.
    streamed = _attributes(joined[0])
    assert streamed["gen_ai.operation.name"] == "chat"
    assert streamed["gen_ai.request.model"] == _MODEL
    assert streamed["gen_ai.response.model"] == _MODEL
    assert streamed["gen_ai.response.finish_reasons"] == ["stop"]
    assert streamed["gen_ai.request.stream"] is True
    assert 0 <= streamed["gen_ai.response.time_to_first_chunk"] < _WAIT
    unstreamed = _attributes(next(s for s in sent if s.parent_span_id == other.span_id))
    assert unstreamed["gen_ai.response.model"] == _MODEL
    # Cut at max_tokens: the engine's `length`, though the call completed.
    assert unstreamed["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.request.stream" not in unstreamed
    assert unstreamed["gen_ai.request.max_tokens"] == 3
    assert unstreamed["gen_ai.request.temperature"] == 0.5
    assert unstreamed["gen_ai.request.seed"] == 7
    assert unstreamed["gen_ai.request.stop_sequences"] == ["\n\n"]
    assert "gen_ai.response.time_to_first_chunk" not in unstreamed
    # No content without the opt-in.
    assert not any(key.startswith("gen_ai.input") for key in streamed)
    # Each of the spans export-otlp makes of the bundle, sent once.
    _, planned = bundle_spans(bundle)
    assert sorted(
        (trace_api.format_trace_id(span.context.trace_id), span.name)
        for span in planned
        if span.context is not None
    ) == sorted(received.spans())


async def test_the_content_opt_in_comes_from_the_conventions_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    async with grpc_receiver() as (url, received):
        gateway = await _gateway(tmp_path, url)
        try:
            client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
            await client.chat.completions.create(
                model=_MODEL, messages=[{"role": "user", "content": "Say hello."}]
            )
            sent = await _until(received, f"chat {_MODEL}")
        finally:
            await gateway.stop()
    [chat] = [span for span in sent if span.name == f"chat {_MODEL}"]
    attributes = _attributes(chat)
    assert '"Say hello."' in attributes["gen_ai.input.messages"]
    assert '"role":"assistant"' in attributes["gen_ai.output.messages"]


def test_serve_and_gateway_take_the_same_otlp_flags() -> None:
    import argparse

    from agent_server import config
    from agent_server.gateway import _settings

    flags = [
        "--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol", "grpc",
        "--otlp-header", "k=v", "--otlp-include-content",
    ]  # fmt: skip
    serve = argparse.ArgumentParser()
    config.add_serve_arguments(serve)
    gateway = argparse.ArgumentParser()
    _settings.add_arguments(gateway)
    served = config.from_args(serve.parse_args(flags), {})
    gated = _settings.from_args(gateway.parse_args([*flags, "--trace-root", "t"]), {}).agent
    for settings in (served, gated):
        assert settings.otlp_endpoint == "http://127.0.0.1:4317"
        assert settings.otlp_headers == ("k=v",)
        assert settings.otlp_include_content is True
    # Without the flag, the conventions' variable decides (None here).
    assert config.from_args(serve.parse_args([]), {}).otlp_include_content is None
