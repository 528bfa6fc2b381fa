"""`trace-reducer export-otlp` as users run it: real OTLP receivers on loopback, bad input."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra (make test installs it)")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer
from bench.synthetic import Shape, write_conversation
from tests.agent_server.conftest import TRACE_REDUCER, clean_env
from tests.otel.conftest import Bundles, damage_inside, free_port, truncate_inside
from trace_reducer import replay_bundle

SECRET = "sk-otel-header-SECRET-never-echoed"


@dataclass
class Run:
    code: int | None
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return self.stderr.splitlines()


async def export_cli(*args: str, **env: str) -> Run:
    process = await asyncio.create_subprocess_exec(
        TRACE_REDUCER,
        "export-otlp",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(**env),
    )
    stdout, stderr = await process.communicate()
    return Run(process.returncode, stdout.decode(), stderr.decode())


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[tuple[str, str]]:
    """(trace id, span name) of every span in an OTLP request."""
    return [
        (span.trace_id.hex(), span.name)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


@dataclass
class Received:
    requests: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def spans(self) -> list[tuple[str, str]]:
        return [span for request in self.requests for span in spans_of(request)]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received, token: str | None = None) -> None:
        self.received = received
        self.token = token

    async def Export(  # noqa: N802 - the generated servicer's name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[
            trace_service_pb2.ExportTraceServiceRequest,
            trace_service_pb2.ExportTraceServiceResponse,
        ],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        metadata = context.invocation_metadata() or ()
        headers = {str(key): str(value) for key, value in metadata}
        self.received.headers.append(headers)
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
        self.received.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@asynccontextmanager
async def grpc_receiver(token: str | None = None) -> AsyncIterator[tuple[str, Received]]:
    """A real OTLP/gRPC trace receiver on loopback that keeps what it is sent (with `token`,
    only what comes with `authorization: Bearer <token>`)."""
    received = Received()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        _TraceService(received, token), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        await server.stop(None)


@asynccontextmanager
async def http_receiver(token: str) -> AsyncIterator[tuple[str, Received]]:
    """A real OTLP/HTTP receiver on loopback that wants `authorization: Bearer <token>`."""
    received = Received()

    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        received.headers.append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {token}":
            await response.send(401, b"unauthorized")
            return
        if request.path != "/v1/traces":
            await response.send(404, b"not found")
            return
        received.requests.append(
            trace_service_pb2.ExportTraceServiceRequest.FromString(request.body)
        )
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        await response.send(200, body, headers={"Content-Type": "application/x-protobuf"})

    server = await LoopbackHttpServer.start(handle)
    try:
        yield server.url, received
    finally:
        await server.stop()


async def test_grpc_receiver_gets_every_span_and_the_headers(bundles: Bundles) -> None:
    trace_id = replay_bundle(bundles.conversation).trace_id
    async with grpc_receiver() as (endpoint, received):
        run = await export_cli(
            str(bundles.conversation),
            str(bundles.retried),
            "--endpoint",
            endpoint,
            "--header",
            f"X-Api-Key={SECRET}",
            "--header",
            "x-team = blue",
        )
    assert (run.code, run.stderr) == (0, "")
    assert run.stdout.splitlines() == [
        f"exported 5 spans of {bundles.conversation} as trace {trace_id}",
        f"exported 4 spans of {bundles.retried} as trace {replay_bundle(bundles.retried).trace_id}",
    ]
    assert sorted(name for tid, name in received.spans() if tid == trace_id) == [
        "chat test-model",
        "chat test-model",
        "invoke_agent",
        "turn",
        "turn",
    ]
    assert len(received.spans()) == 9
    for headers in received.headers:
        assert headers["x-api-key"] == SECRET
        assert headers["x-team"] == "blue"


async def test_http_receiver_gets_the_spans_at_v1_traces(bundles: Bundles) -> None:
    async with http_receiver("t0ken") as (url, received):
        run = await export_cli(
            str(bundles.retried),
            "--protocol",
            "http/protobuf",
            "--endpoint",
            url,
            "--header",
            "Authorization=Bearer t0ken",
            "--include-content",
        )
    assert (run.code, run.stderr) == (0, "")
    names = sorted(name for _, name in received.spans())
    assert names == ["chat test-model", "chat test-model", "invoke_agent", "turn"]
    [request] = received.requests
    [resource_spans] = request.resource_spans
    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert attributes["service.name"] == "rollout-trace agent-server"


async def test_a_refusing_receiver_is_one_line_and_exit_1(bundles: Bundles) -> None:
    async with http_receiver("right") as (url, received):
        run = await export_cli(
            str(bundles.retried),
            "--protocol",
            "http/protobuf",
            "--endpoint",
            url,
            "--header",
            f"Authorization=Bearer {SECRET}",
        )
    assert run.code == 1
    [line] = run.error_lines
    assert (
        line == f"trace-reducer: could not export spans to {url}/v1/traces: HTTP 401 Unauthorized"
    )
    assert SECRET not in run.stderr + run.stdout
    assert received.requests == []
    assert len(received.headers) == 1


async def test_a_refusing_grpc_receiver_is_its_code_and_details(bundles: Bundles) -> None:
    # Was: `Failed to export traces to 127.0.0.1:…, error code: StatusCode.UNAUTHENTICATED,
    # error details: wrong token`, the address said twice.
    async with grpc_receiver("right") as (endpoint, received):
        run = await export_cli(
            str(bundles.retried),
            "--endpoint",
            endpoint,
            "--header",
            f"authorization=Bearer {SECRET}",
        )
    assert run.code == 1
    assert run.error_lines == [
        f"trace-reducer: could not export spans to {endpoint}: UNAUTHENTICATED: wrong token"
    ]
    assert SECRET not in run.stderr + run.stdout
    assert received.requests == []


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_an_unreachable_receiver_is_one_line_and_exit_1(
    bundles: Bundles, protocol: str
) -> None:
    closed = free_port()
    run = await export_cli(
        str(bundles.retried),
        "--protocol",
        protocol,
        "--endpoint",
        # A query value is a secret too: the endpoint is shown without it.
        f"http://127.0.0.1:{closed}/v1/traces?api-key={SECRET}",
        "--timeout",
        "1",
        "--header",
        f"authorization=Bearer {SECRET}",
    )
    assert run.code == 1
    [line] = run.error_lines
    shown = f"http://127.0.0.1:{closed}/v1/traces?api-key=..."
    # The same words either way: gRPC's were `StatusCode.UNAVAILABLE encountered while
    # exporting traces to 127.0.0.1:…. Error details: failed to connect to all addresses; …`.
    assert line == f"trace-reducer: could not export spans to {shown}: connection refused", line
    assert SECRET not in run.stderr + run.stdout
    assert run.stdout == ""


async def test_a_truncated_bundle_is_exported_with_a_warning(
    bundles: Bundles, tmp_path: Path
) -> None:
    bundle = truncate_inside(bundles.retried, "turn_ended", tmp_path / "cut")
    async with grpc_receiver() as (endpoint, received):
        run = await export_cli(str(bundle), "--endpoint", endpoint)
    assert run.code == 0
    assert run.error_lines == [
        f"trace-reducer: warning: truncated bundle {bundle}: exported what it holds"
    ]
    assert len(received.spans()) == 4


async def test_long_conversations_fit_the_receivers_message_limit(tmp_path: Path) -> None:
    # With content every chat span carries the history it was sent: 200 turns make ~25 MB of
    # spans, far over the 4 MiB a gRPC receiver takes in one message by default.
    bundle = write_conversation(
        tmp_path, Shape(turns=200, deltas_per_turn=60, words_per_delta=2), thread_id="long"
    )
    async with grpc_receiver() as (endpoint, received):
        run = await export_cli(str(bundle), "--endpoint", endpoint, "--include-content")
    assert (run.code, run.stderr) == (0, "")
    sizes = [request.ByteSize() for request in received.requests]
    assert sum(sizes) > 5 * 4 * 1024 * 1024
    assert max(sizes) < 4 * 1024 * 1024
    assert len(received.spans()) == 1 + 200 * 2


async def test_a_span_larger_than_any_request_goes_without_its_content(tmp_path: Path) -> None:
    # Two turns of 2.6 MB replies: the second chat span carries the first reply as its history
    # and its own as output, 5.3 MB, more than a receiver takes in one request.
    bundle = write_conversation(
        tmp_path, Shape(turns=2, deltas_per_turn=2500, words_per_delta=100), thread_id="wide"
    )
    async with grpc_receiver() as (endpoint, received):
        run = await export_cli(str(bundle), "--endpoint", endpoint, "--include-content")
    # Was: exit 1, `RESOURCE_EXHAUSTED: … Received message larger than max (… vs. 4194304)`,
    # the spans before it sent and none after.
    assert (run.code, run.stderr) == (0, "")
    assert max(request.ByteSize() for request in received.requests) < 4 * 1024 * 1024
    chats = [
        {attribute.key: attribute.value for attribute in span.attributes}
        for request in received.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name.startswith("chat ")
    ]
    [first, second] = sorted(
        chats, key=lambda attributes: "gen_ai.input.messages" not in attributes
    )
    # The first chat span fits and keeps its content; the second says what it left out.
    assert "gen_ai.output.messages" in first
    assert "rollout.content_omitted_bytes" not in first
    assert "gen_ai.input.messages" not in second
    assert "gen_ai.output.messages" not in second
    assert second["rollout.content_omitted_bytes"].int_value > 4 * 1024 * 1024
    assert len(received.spans()) == 1 + 2 * 2


async def test_a_corrupt_bundle_needs_salvage(bundles: Bundles, tmp_path: Path) -> None:
    bundle = damage_inside(bundles.retried, "turn_ended", tmp_path / "flipped", flip=True)
    async with grpc_receiver() as (endpoint, received):
        refused = await export_cli(str(bundle), "--endpoint", endpoint)
        assert refused.code == 1
        [line] = refused.error_lines
        assert line.startswith(f"trace-reducer: corrupt bundle {bundle}: ")
        assert line.endswith("(--salvage exports the records before it)")
        assert received.requests == []
        salvaged = await export_cli(str(bundle), "--endpoint", endpoint, "--salvage")
    assert salvaged.code == 0
    assert salvaged.error_lines == [
        f"trace-reducer: warning: corrupt bundle {bundle}: exported what it holds"
    ]
    assert len(received.spans()) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "no such file or directory: {missing}"),
        (["{empty_dir}"], "not a trace bundle"),
        (["{empty_file}"], "not a trace bundle (no header record)"),
        (["{bundle}", "--header", "novalue"], "--header must be KEY=VALUE"),
        (["{bundle}", "--header", "bad key=1"], "--header must be KEY=VALUE"),
        (["{bundle}", "--header", "=value"], "--header must be KEY=VALUE"),
        (["{bundle}", "--endpoint", "ftp://127.0.0.1:1"], "--endpoint must be an http://"),
        (["{bundle}", "--endpoint", "http://127.0.0.1:notaport"], "--endpoint is not a URL"),
        (["{bundle}", "--endpoint", f"http://u:{SECRET}@[::1"], "--endpoint is not a URL (Invalid"),
        (["{bundle}", "--endpoint", "127.0.0.1:4317"], "--endpoint must be an http://"),
        (["{bundle}", "--timeout", "0"], "--timeout must be a positive number"),
        (
            ["{bundle}", "--endpoint", f"http://user:{SECRET}@127.0.0.1:1"],
            "--endpoint must not hold credentials",
        ),
        # Without a scheme urlsplit reads `user` as one: the user info is found all the same.
        (
            ["{bundle}", "--endpoint", f"user:{SECRET}@collector:4317"],
            "--endpoint must not hold credentials",
        ),
        (
            ["{bundle}", "--endpoint", f"grpc://collector/?token={SECRET}"],
            "--endpoint must be an http:// or https:// URL: 'grpc://collector/?token=...'",
        ),
    ],
)
async def test_bad_input_is_one_line_exit_2_and_sends_nothing(
    bundles: Bundles, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_file").write_bytes(b"")
    names = {
        "missing": str(tmp_path / "missing"),
        "empty_dir": str(tmp_path / "empty_dir"),
        "empty_file": str(tmp_path / "empty_file"),
        "bundle": str(bundles.retried),
    }
    argv = [arg.format(**names) for arg in args]
    async with grpc_receiver() as (endpoint, received):
        run = await export_cli(*argv, *([] if "--endpoint" in argv else ["--endpoint", endpoint]))
    assert run.code == 2
    [line] = run.error_lines
    assert line.startswith("trace-reducer: ")
    assert message.format(**names) in line
    assert SECRET not in run.stderr
    assert received.requests == []


async def test_header_values_are_never_echoed(bundles: Bundles) -> None:
    run = await export_cli(str(bundles.retried), "--header", f"bad key={SECRET}")
    assert run.code == 2
    assert SECRET not in run.stderr


async def test_the_default_receiver_not_there_says_it_was_the_default(bundles: Bundles) -> None:
    # Was `could not export spans to http://localhost:4317: connection refused`: nothing said
    # that this was a default the user never gave, nor how to give theirs.
    held = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        probe = socket.socket(family)
        try:
            probe.bind((host, 4317))  # bound, never listening: connections are refused
        except OSError:
            probe.close()
            if family == socket.AF_INET:
                pytest.skip("something else holds 127.0.0.1:4317")
            continue
        held.append(probe)
    try:
        run = await export_cli(str(bundles.retried), "--timeout", "1")
    finally:
        for probe in held:
            probe.close()
    assert run.code == 1
    assert run.error_lines == [
        "trace-reducer: could not export spans to http://localhost:4317 (the default: give the "
        "receiver's with --endpoint or OTEL_EXPORTER_OTLP_ENDPOINT): connection refused"
    ]
