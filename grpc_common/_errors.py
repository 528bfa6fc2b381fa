"""Errors as clients of any language decode them: a status code with a google.rpc.ErrorInfo."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "rollout-trace"

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
