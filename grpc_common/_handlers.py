"""Interceptors shared by both servers: bearer tokens and requests that do not parse."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import grpc

from ._errors import abort
from ._secret import same_secret

_HEALTH_PREFIX = "/grpc.health.v1.Health/"

# The stubs make RpcMethodHandler generic; at run time it is not subscriptable.
Continuation: TypeAlias = (
    "Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]]"
)


# The stubs make ServerInterceptor generic; at run time it is a plain class.
class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses RPCs without the expected bearer token; health checks stay open for probes."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        # An unknown method has no handler; gRPC answers it UNIMPLEMENTED itself.
        if handler is None or handler_call_details.method.startswith(_HEALTH_PREFIX):
            return handler
        given: str | bytes = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value
        # The one comparison every server's token check makes (the gateway's, the viewer's).
        if same_secret(given, self._expected):
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


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Answers a request that does not parse with INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self._prefixes = tuple(f"/{name}/" for name in service_names)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        behaviour = behaviour_of(handler)
        wrapped: Callable[..., Any]
        if handler.request_streaming:

            async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async for request in requests:
                    await _refuse_undecodable(context, request)
                    yield request

            if handler.response_streaming:

                async def wrapped(requests: AsyncIterator[Any], context: Any) -> None:
                    await stream_responses(behaviour, checked(requests, context), context)

            else:

                async def wrapped(requests: AsyncIterator[Any], context: Any) -> Any:
                    return await behaviour(checked(requests, context), context)

        elif handler.response_streaming:

            async def wrapped(request: Any, context: Any) -> None:
                await _refuse_undecodable(context, request)
                await stream_responses(behaviour, request, context)

        else:

            async def wrapped(request: Any, context: Any) -> Any:
                await _refuse_undecodable(context, request)
                return await behaviour(request, context)

        return _handler_like(handler, wrapped, _tolerant(handler.request_deserializer))


def behaviour_of(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    """The function a handler runs, whatever its streaming kind."""
    # The stubs describe the sync server; on grpc.aio these are coroutine functions.
    behaviour: Callable[..., Any] | None = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    assert behaviour is not None
    return behaviour


async def stream_responses(behaviour: Callable[..., Any], request: Any, context: Any) -> None:
    """Run a response-streaming behaviour as grpc.aio runs one: an async generator's messages
    written one by one, a coroutine (that writes, or refuses the call) awaited.

    An interceptor wraps a stream in this, a coroutine, rather than in an async generator of
    its own: a generator layer costs every message a resumption of its own, and a generator
    cannot wrap a behaviour that is a coroutine (a refusal) at all."""
    if inspect.iscoroutinefunction(behaviour):
        await behaviour(request, context)
        return
    async for response in behaviour(request, context):
        await context.write(response)


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
