"""Errors as clients of any language decode them: a status code with a google.rpc.ErrorInfo."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "rollout-trace"
_log = logging.getLogger("grpc_common.errors")

# Status messages travel in HTTP/2 trailers, which clients cap (16 KiB by default); a message
# echoing a client's 100 KB argument would turn a clear error into RESOURCE_EXHAUSTED.
_MAX_MESSAGE_CHARS = 1024
_MAX_METADATA_VALUE_CHARS = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} chars)"


def error_status(
    code: grpc.StatusCode, reason: str, message: str, **metadata: str
) -> status_pb2.Status:
    """A google.rpc.Status carrying an ErrorInfo(reason, metadata) in the project's domain."""
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
    status = rpc_status.to_status(error_status(code, reason, message, **metadata))
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


# The reason of a failure that is the server's own (a bug); its traceback stays in the log.
INTERNAL_REASON = "INTERNAL"

_Metadata = Callable[[BaseException], Mapping[str, str]]


class RpcStatusError(Exception):
    """An error that ends an RPC with its own status: subclasses name `code` and `reason`."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.FAILED_PRECONDITION
    reason: ClassVar[str] = "FAILED_PRECONDITION"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata


@dataclass(frozen=True)
class StatusRule:
    """Exceptions of `kind` end an RPC with `code` and the ErrorInfo `reason`."""

    kind: type[BaseException]
    code: grpc.StatusCode
    reason: str
    metadata: _Metadata | None = None
    describe: Callable[[BaseException], str] = str


class ErrorMapping:
    """The one translation of exceptions into statuses a server answers with.

    `RpcStatusError`s carry their own status; anything else takes the first rule whose kind it is
    (so list subclasses before their bases); what no rule names is INTERNAL, logged with its
    traceback while the client learns only the kind of failure."""

    def __init__(self, rules: Sequence[StatusRule] = (), *, log: logging.Logger = _log) -> None:
        self._rules = tuple(rules)
        self._log = log

    def status(
        self, error: BaseException, rpc: str
    ) -> tuple[grpc.StatusCode, str, str, dict[str, str]]:
        """(code, reason, message, metadata) for error; INTERNAL's reason for the unknown."""
        if isinstance(error, RpcStatusError):
            return error.code, error.reason, error.message, dict(error.metadata)
        for rule in self._rules:
            if isinstance(error, rule.kind):
                metadata = dict(rule.metadata(error)) if rule.metadata else {}
                return rule.code, rule.reason, rule.describe(error), metadata
        return (
            grpc.StatusCode.INTERNAL,
            INTERNAL_REASON,
            f"{rpc} failed with an internal error ({type(error).__name__}); "
            "the server log has the details",
            {},
        )

    async def refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], rpc: str, error: BaseException
    ) -> NoReturn:
        """End the RPC with the status that fits error (an unknown one logged first)."""
        code, reason, message, metadata = self.status(error, rpc)
        if reason == INTERNAL_REASON and code == grpc.StatusCode.INTERNAL:
            self._log.error("%s failed unexpectedly", rpc, exc_info=error)
        await abort(context, code, reason, message, **metadata)

    def translated(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str) -> _Translated:
        """`async with mapping.translated(context, "Rpc"):` — an exception leaving the block
        ends the RPC with its status; a client's cancel and an abort pass through as they are."""
        return _Translated(self, context, rpc)


class _Translated:
    # Its __aexit__ never swallows an exception (it returns None): each RPC's `async with`
    # block ends in its return, and nothing after it is reachable.

    def __init__(
        self, mapping: ErrorMapping, context: grpc.aio.ServicerContext[Any, Any], rpc: str
    ) -> None:
        self._mapping = mapping
        self._context = context
        self._rpc = rpc

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # A client that goes away arrives as CancelledError, which is no Exception.
        if isinstance(error, Exception) and not isinstance(error, grpc.aio.AbortError):
            await self._mapping.refuse(self._context, self._rpc, error)
