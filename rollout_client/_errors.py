"""The client's exceptions: one hierarchy, RPC failures decoded with their google.rpc.ErrorInfo."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class RolloutError(Exception):
    """Everything the client raises on purpose derives from this."""


class StreamEndedError(RolloutError):
    """The server ended a turn's event stream before the turn completed."""


class RpcError(RolloutError):
    """An RPC failed: its status code, message, and the ErrorInfo the server attached.

    `reason` is the ErrorInfo's UPPER_SNAKE reason ("" when the status carried none, as for a
    transport failure), `metadata` its key/value details.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}" + (f" ({reason})" if reason else ""))
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgumentError(RpcError):
    pass


class NotFoundError(RpcError):
    pass


class FailedPreconditionError(RpcError):
    pass


class OutOfRangeError(RpcError):
    pass


class UnauthenticatedError(RpcError):
    pass


class PermissionDeniedError(RpcError):
    pass


class UnavailableError(RpcError):
    """The server could not be reached or is shutting down (reason SHUTTING_DOWN)."""


class DeadlineExceededError(RpcError):
    pass


class ResourceExhaustedError(RpcError):
    pass


class InternalError(RpcError):
    pass


class DataLossError(RpcError):
    pass


class UnimplementedError(RpcError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[RpcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def error_from_rpc(error: grpc.aio.AioRpcError) -> RpcError:
    """The RpcError subclass for a failed call, with the ErrorInfo of its status details."""
    code = error.code()
    info = _error_info(error.trailing_metadata())
    cls = _BY_CODE.get(code, RpcError)
    return cls(
        code,
        error.details() or "",
        reason=info.reason if info else "",
        domain=info.domain if info else "",
        metadata=info.metadata if info else None,
    )


def _error_info(trailing: Iterable[Any] | None) -> error_details_pb2.ErrorInfo | None:
    # The stubs type aio metadata as the sync API's; at run time it is (key, value) pairs.
    for key, value in trailing or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return None
