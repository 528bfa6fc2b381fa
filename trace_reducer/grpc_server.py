"""Shared gRPC plumbing for both servers: rich errors, health, reflection, binding, signals."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

ERROR_DOMAIN = "rollout-trace"
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


# Status messages travel in HTTP/2 trailers, which clients cap (16 KiB by default); a message
# echoing a client's 100 KB argument would turn a clear error into RESOURCE_EXHAUSTED.
_MAX_MESSAGE_CHARS = 1024
_MAX_METADATA_VALUE_CHARS = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} chars)"


def error_status(
    code: grpc.StatusCode, reason: str, message: str, **metadata: str
) -> status_pb2.Status:
    """A google.rpc.Status carrying an ErrorInfo, as clients of any language decode it."""
    clipped = {key: _clip(value, _MAX_METADATA_VALUE_CHARS) for key, value in metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=clipped)
    status = status_pb2.Status(code=code.value[0], message=_clip(message, _MAX_MESSAGE_CHARS))
    status.details.add().Pack(info)
    return status


async def abort(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    reason: str,
    message: str,
    **metadata: str,
) -> NoReturn:
    """End the RPC with code, message and an ErrorInfo(reason) in the status details."""
    status = error_status(code, reason, message, **metadata)
    await context.abort(
        code,
        status.message,
        trailing_metadata=((_STATUS_DETAILS_KEY, status.SerializeToString()),),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def split_listen(listen: str) -> tuple[str, int]:
    """Parse HOST:PORT (IPv6 hosts in brackets); raise ValueError with a clear message."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


_HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class AccessControl:
    """Optional bearer-token authentication and TLS, shared by both servers."""

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> AccessControl:
        """Read the token from the variable named by --auth-token-env and the TLS files.

        Raises ValueError with a message fit for the user; never one that shows the token.
        """
        env = os.environ if environ is None else environ
        token = None
        if args.auth_token_env:
            token = env.get(args.auth_token_env, "")
            if not token:
                raise ValueError(
                    f"--auth-token-env names {args.auth_token_env}, which is unset or empty"
                )
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        cert = key = None
        if args.tls_cert is not None and args.tls_key is not None:
            cert = _read_file(args.tls_cert, "--tls-cert")
            key = _read_file(args.tls_key, "--tls-key")
        return cls(token=token, tls_cert=cert, tls_key=key)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor[Any, Any]]:
        return [_BearerTokenInterceptor(self.token)] if self.token else []

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that configure AccessControl, identical on both servers."""
    parser.add_argument(
        "--auth-token-env",
        metavar="NAME",
        help="require `authorization: Bearer <token>` on every RPC but health checks; "
        "the token is read from the environment variable NAME",
    )
    parser.add_argument("--tls-cert", type=Path, metavar="PATH", help="PEM certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="PATH", help="PEM private key")


def _read_file(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror or error}") from error


# The stubs make ServerInterceptor generic; at run time it is a plain class.
class _BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses RPCs without the expected bearer token; health checks stay open for probes."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        # An unknown method has no handler; gRPC answers it UNIMPLEMENTED itself.
        if handler is None or handler_call_details.method.startswith(_HEALTH_PREFIX):
            return handler
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(given, self._expected):
            return handler
        reason, message = (
            ("INVALID_TOKEN", "the bearer token is not valid")
            if given
            else ("MISSING_TOKEN", "this server requires `authorization: Bearer <token>`")
        )

        async def refuse(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, reason, message)

        return _handler_like(handler, refuse)


class _Undecodable:
    """Stands in for a request message that did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data) if deserializer else data
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's
            return _Undecodable(str(error) or type(error).__name__)

    return decode


async def _refuse_undecodable(context: grpc.aio.ServicerContext[Any, Any], request: Any) -> None:
    if isinstance(request, _Undecodable):
        await abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "MALFORMED_REQUEST",
            f"the request message does not parse: {request.error}",
        )


class _MalformedRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Answers a request that does not parse with INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self._prefixes = tuple(f"/{name}/" for name in service_names)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        # The stubs describe the sync server; on grpc.aio these are coroutine functions.
        behaviour: Callable[..., Any] | None = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        assert behaviour is not None
        wrapped: Callable[..., Any]
        if handler.request_streaming:

            async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async for request in requests:
                    await _refuse_undecodable(context, request)
                    yield request

            if handler.response_streaming:

                async def wrapped(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                    async for response in behaviour(checked(requests, context), context):
                        yield response

            else:

                async def wrapped(requests: AsyncIterator[Any], context: Any) -> Any:
                    return await behaviour(checked(requests, context), context)

        elif handler.response_streaming:

            async def wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
                await _refuse_undecodable(context, request)
                async for response in behaviour(request, context):
                    yield response

        else:

            async def wrapped(request: Any, context: Any) -> Any:
                await _refuse_undecodable(context, request)
                return await behaviour(request, context)

        return _handler_like(handler, wrapped, _tolerant(handler.request_deserializer))


def _handler_like(
    handler: grpc.RpcMethodHandler[Any, Any],
    behaviour: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming kind and codecs as handler, running behaviour."""
    codecs = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **codecs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **codecs)


class GrpcServer:
    """A grpc.aio server with health and reflection, bound to one loopback or host address."""

    def __init__(self, server: grpc.aio.Server, host: str, port: int, health: HealthServicer):
        self.server = server
        self.host = host
        self.port = port
        self.health = health

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    async def start(
        cls,
        listen: str,
        register: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str],
        access: AccessControl | None = None,
    ) -> GrpcServer:
        """Register the services, add health and reflection, bind and start.

        Raises ValueError for a malformed address and OSError when it cannot be bound.
        """
        access = access or AccessControl()
        host, port = split_listen(listen)
        # Without this, a second server asking for a port in use silently shares it.
        server = grpc.aio.server(
            interceptors=[*access.interceptors(), _MalformedRequestInterceptor(service_names)],
            options=[("grpc.so_reuseport", 0)],
        )
        register(server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            [
                *service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        credentials = access.credentials()
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {listen}: {error}") from error
        if bound == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        for name in service_names:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(server, host, bound, health)

    async def set_not_serving(self) -> None:
        """Tell health checkers to go elsewhere; it stays so until the process ends."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        """Refuse new RPCs, give running ones `grace` seconds, then cancel them."""
        await self.set_not_serving()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def install_signal_handlers(on_first_signal: Callable[[], None]) -> None:
    """SIGTERM/SIGINT call on_first_signal once; a second signal exits the process at once."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def handle(signum: int) -> None:
        if received:
            print("second signal: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        received.append(signum)
        on_first_signal()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)
