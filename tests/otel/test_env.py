"""`export-otlp` configured by the OpenTelemetry environment alone, as the specification reads it:
real OTLP/HTTP and OTLP/gRPC receivers on loopback check the path, headers and protocol."""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra (make test installs it)")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.agent_server.conftest import TRACE_REDUCER
from tests.otel.conftest import Bundles
from tests.otel.test_cli import Run, grpc_receiver, spans_of

LANGFUSE_PUBLIC = "pk-lf-1234"
LANGFUSE_SECRET = "sk-lf-SECRET-5678"


@dataclass
class HttpReceived:
    """What an OTLP/HTTP receiver was sent: each request's path, headers and spans."""

    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    spans: list[tuple[str, str]] = field(default_factory=list)


@asynccontextmanager
async def http_receiver() -> AsyncIterator[tuple[str, HttpReceived]]:
    """An OTLP/HTTP receiver on aiohttp's server: takes protobuf bodies at any path."""
    received = HttpReceived()

    async def export(request: web.Request) -> web.Response:
        received.paths.append(request.path)
        received.headers.append({key.lower(): value for key, value in request.headers.items()})
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # still gzip-compressed, whatever the server did with it
            body = gzip.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        parsed = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        received.spans.extend(spans_of(parsed))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/{path:.*}", export)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        await runner.cleanup()


async def export_with_env(*args: str, **env: str) -> Run:
    """`trace-reducer export-otlp ARGS` with only these OTEL_ variables set."""
    clean = {
        key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "ROLLOUT_"))
    }
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        "export-otlp",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**clean, **env},
    )
    stdout, stderr = await process.communicate()
    return Run(process.returncode, stdout.decode(), stderr.decode())


async def test_langfuse_recipe_from_the_environment_alone(bundles: Bundles) -> None:
    # Langfuse's documented setting: a base endpoint, HTTP/protobuf, a Basic auth header.
    auth = base64.b64encode(f"{LANGFUSE_PUBLIC}:{LANGFUSE_SECRET}".encode()).decode()
    async with http_receiver() as (url, received):
        run = await export_with_env(
            str(bundles.retried),
            OTEL_EXPORTER_OTLP_ENDPOINT=f"{url}/api/public/otel",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_HEADERS=f"Authorization=Basic%20{auth}",
        )
    assert (run.code, run.stderr) == (0, "")
    assert received.paths == ["/api/public/otel/v1/traces"]
    assert received.headers[0]["authorization"] == f"Basic {auth}"
    assert received.headers[0]["content-type"] == "application/x-protobuf"
    assert sorted(name for _, name in received.spans) == [
        "chat test-model",
        "chat test-model",
        "invoke_agent",
        "turn",
    ]
    assert LANGFUSE_SECRET not in run.stdout + run.stderr
    assert auth not in run.stdout + run.stderr


async def test_the_traces_endpoint_is_used_as_it_is(bundles: Bundles) -> None:
    async with http_receiver() as (url, received):
        run = await export_with_env(
            str(bundles.retried),
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{url}/custom/ingest",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"{url}/not/this/one",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_TRACES_HEADERS="x-tenant=a,x-extra=b%3Dc",
            OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
        )
    assert (run.code, run.stderr) == (0, "")
    assert received.paths == ["/custom/ingest"]
    headers = received.headers[0]
    assert (headers["x-tenant"], headers["x-extra"]) == ("a", "b=c")
    assert headers["content-encoding"] == "gzip"
    assert len(received.spans) == 4


async def test_phoenix_style_grpc_from_the_environment(bundles: Bundles) -> None:
    async with grpc_receiver() as (endpoint, received):
        run = await export_with_env(
            str(bundles.retried),
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_HEADERS="api_key=phoenix-key",
            OTEL_EXPORTER_OTLP_TIMEOUT="5000",
        )
    assert (run.code, run.stderr) == (0, "")
    assert len(received.spans()) == 4
    assert received.headers[0]["api_key"] == "phoenix-key"


async def test_flags_win_over_the_environment(bundles: Bundles) -> None:
    async with http_receiver() as (url, received):
        run = await export_with_env(
            str(bundles.retried),
            "--endpoint",
            url,
            "--protocol",
            "http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9/nowhere",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        )
    assert (run.code, run.stderr) == (0, "")
    assert received.paths == ["/v1/traces"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL must be one of grpc, http/protobuf: 'http/json'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "soon"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT must be a number of milliseconds: 'soon'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector"},
            "OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL: 'ftp://collector'",
        ),
        # A malformed headers entry is named, never quoted (it may be the key itself).
        (
            {"OTEL_EXPORTER_OTLP_HEADERS": "S3CRETHDRONLY"},
            "OTEL_EXPORTER_OTLP_HEADERS must be KEY=VALUE with KEY an HTTP field name "
            "(got '…' without =)",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-api-key=ok,bad key=S3CRETV"},
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS must be KEY=VALUE with KEY an HTTP field name "
            "(got '…')",
        ),
    ],
)
async def test_bad_environment_is_one_line_exit_2(
    bundles: Bundles, env: dict[str, str], message: str
) -> None:
    run = await export_with_env(str(bundles.retried), **env)
    assert run.code == 2
    assert run.error_lines == [f"trace-reducer: {message}"]


async def test_each_bundle_is_reported_as_it_goes_out(bundles: Bundles) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trace_reducer import export_otlp

    exporter = InMemorySpanExporter()
    sent_before: list[int] = []

    def progress(one: object) -> None:
        sent_before.append(len(exporter.get_finished_spans()))

    exported = await asyncio.to_thread(
        export_otlp,
        [bundles.conversation, bundles.retried],
        exporter=exporter,
        progress=progress,
    )
    # Called once per bundle, right after its own spans were sent and before the next's.
    assert sent_before == [exported[0].spans, exported[0].spans + exported[1].spans]
