"""Per-RPC metrics and request log lines of both servers (one interceptor), and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from ._handlers import Continuation, _handler_like, behaviour_of, stream_responses
from ._listen import listen_error
from ._server import split_listen

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every RPC by method and status code, times it (a stream: until it ends), and logs
    one line per finished RPC (method, code, milliseconds, peer) to `log`: at `ok_level` when
    it succeeded, INFO otherwise. The series are `<prefix>_rpcs_total` and
    `<prefix>_rpc_duration_seconds`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        log: logging.Logger,
        *,
        ok_level: int = logging.DEBUG,
    ) -> None:
        self._log = log
        self._ok_level = ok_level
        self._count = Counter(
            f"{prefix}_rpcs",
            "RPCs finished, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self._latency = Histogram(
            f"{prefix}_rpc_duration_seconds",
            "How long RPCs took, by method and status code (streams: until they ended).",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        behaviour = behaviour_of(handler)
        wrapped: Callable[..., Any]
        if handler.response_streaming:

            async def wrapped(request: Any, context: Any) -> None:
                started = time.monotonic()
                # Asked now: once the call is over its peer may be gone (reading it then can
                # crash the process).
                peer = context.peer()
                code = grpc.StatusCode.UNKNOWN
                try:
                    await stream_responses(behaviour, request, context)
                    code = _code_of(context, grpc.StatusCode.OK)
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    self._finished(method, code, started, peer)

        else:

            async def wrapped(request: Any, context: Any) -> Any:
                started = time.monotonic()
                # Asked now: once the call is over its peer may be gone (reading it then can
                # crash the process).
                peer = context.peer()
                code = grpc.StatusCode.UNKNOWN
                try:
                    response = await behaviour(request, context)
                    code = _code_of(context, grpc.StatusCode.OK)
                    return response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    self._finished(method, code, started, peer)

        return _handler_like(handler, wrapped)

    def _finished(self, method: str, code: grpc.StatusCode, started: float, peer: str) -> None:
        seconds = time.monotonic() - started
        name = code.name
        self._count.labels(method, name).inc()
        self._latency.labels(method, name).observe(seconds)
        level = self._ok_level if code is grpc.StatusCode.OK else logging.INFO
        if not self._log.isEnabledFor(level):
            return
        ms = round(seconds * 1000, 1)
        fields = {"method": method, "code": name, "ms": ms, "peer": peer}
        # The line reads alone (no formatter needed); the fields serve a JSON formatter.
        self._log.log(
            level, "rpc %s %s %.1f ms %s", method, name, ms, peer, extra={"fields": fields}
        )


def _code_of(context: Any, default: grpc.StatusCode) -> grpc.StatusCode:
    """The code the handler set (abort, set_code), else `default`."""
    code = context.code() if hasattr(context, "code") else None
    return code if isinstance(code, grpc.StatusCode) else default


class MetricsServer:
    """A Prometheus endpoint: GET http://HOST:PORT/metrics, served from a thread of its own."""

    def __init__(self, server: WSGIServer, host: str) -> None:
        self._server = server
        self.host = host
        self.port = int(server.server_port)

    @classmethod
    def start(cls, listen: str, registry: CollectorRegistry) -> MetricsServer:
        """Raises ListenError (an OSError) when the address cannot be bound, ValueError when
        it is not one."""
        host, port = split_listen(listen)
        try:
            server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise listen_error(listen, error, "serve metrics on") from error
        return cls(server, host)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
