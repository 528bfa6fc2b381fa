"""ReducerService: reduces bundles under a root directory, or uploaded as a stream of chunks.

Status codes, each with a google.rpc.ErrorInfo (domain `rollout-trace`) whose reason is:

* INVALID_ARGUMENT / BUNDLE_PATH_INVALID: `bundle` is empty or holds a NUL byte.
* PERMISSION_DENIED / PATH_OUTSIDE_ROOT: `bundle` resolves (after `..` and symlinks) outside
  the bundle root.
* NOT_FOUND / BUNDLE_NOT_FOUND: nothing exists at that path under the root.
* INVALID_ARGUMENT / NOT_A_BUNDLE: the path exists but is not a bundle (no trace.binpb, or no
  readable header record); for ReduceRecords, an upload without a header record.
* DATA_LOSS / BUNDLE_CORRUPT: the bundle is CORRUPT and `salvage` was not set; metadata carries
  `bad_frame_offset` and `bad_frame_seq`. UNCLOSED and TRUNCATED bundles reduce normally.
* FAILED_PRECONDITION / RECORDS_CONTRADICT: the records contradict each other.
* FAILED_PRECONDITION / IO_ERROR: the bundle could not be read or state.json written.
* RESOURCE_EXHAUSTED / UPLOAD_TOO_LARGE: a ReduceRecords upload passed the service's limit
  (`max_upload_bytes`, `trace-reducer serve --max-upload-bytes`); metadata `limit_bytes`.
* INTERNAL / INTERNAL: a bug; logged on the server, the client gets no traceback.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc

from grpc_common import abort
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc

from ._errors import (
    BundleError,
    BundleNotFoundError,
    CorruptBundleError,
    NotABundleError,
    ReductionError,
    describe_os_error,
)
from ._framing import DEFAULT_MAX_UPLOAD_BYTES
from ._integrity import require_reducible
from ._layout import STATE_FILE_NAME
from ._reader import FrameDecoder, resolve_trace_file
from ._reducer import Reducer
from ._replay import replay_bundle
from ._state_json import write_state_json

SERVICE_NAME: str = reducer_pb2.DESCRIPTOR.services_by_name["ReducerService"].full_name

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
# Linux's PATH_MAX: no longer path names a file, so it is refused before touching the disk.
_MAX_PATH_BYTES = 4096
if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[object, object]
else:  # the runtime class is not generic
    _Context = grpc.aio.ServicerContext


class _RefusalError(Exception):
    """A request the service answers with an error status."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, **metadata: str):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = metadata


class ReducerService(reducer_pb2_grpc.ReducerServiceServicer):
    """Replays bundles found under bundle_root, never reading outside it."""

    def __init__(
        self,
        bundle_root: str | os.PathLike[str],
        *,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    ) -> None:
        self._root = os.path.realpath(bundle_root)
        self._max_upload_bytes = max_upload_bytes

    @property
    def bundle_root(self) -> str:
        return self._root

    async def ReduceBundle(  # noqa: N802 - the name is the RPC's
        self, request: reducer_pb2.ReduceBundleRequest, context: _Context
    ) -> reducer_pb2.ReduceBundleResponse:
        return await self._answer(context, "ReduceBundle", self._reduce_bundle(request))

    async def ReduceRecords(  # noqa: N802 - the name is the RPC's
        self,
        request_iterator: AsyncIterator[reducer_pb2.ReduceRecordsRequest],
        context: _Context,
    ) -> reducer_pb2.ReduceRecordsResponse:
        return await self._answer(context, "ReduceRecords", self._reduce_records(request_iterator))

    async def _answer(self, context: _Context, rpc: str, work: Awaitable[_T]) -> _T:
        try:
            return await work
        except _RefusalError as refusal:
            await abort(context, refusal.code, refusal.reason, refusal.message, **refusal.metadata)
        except CorruptBundleError as error:
            await abort(
                context,
                grpc.StatusCode.DATA_LOSS,
                "BUNDLE_CORRUPT",
                str(error),
                bad_frame_offset=str(error.integrity.bad_frame_offset),
                bad_frame_seq=str(error.integrity.bad_frame_seq),
            )
        except ReductionError as error:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "RECORDS_CONTRADICT", str(error)
            )
        except BundleNotFoundError as error:  # removed after it was resolved
            await abort(context, grpc.StatusCode.NOT_FOUND, "BUNDLE_NOT_FOUND", str(error))
        except NotABundleError as error:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "NOT_A_BUNDLE", str(error))
        except BundleError as error:  # the file exists but cannot be opened
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "IO_ERROR", str(error))
        except OSError as error:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "IO_ERROR", describe_os_error(error)
            )
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - the edge: nothing may end UNKNOWN
            # The traceback stays in the server log; the client learns only what kind of failure.
            _log.exception("%s failed", rpc)
            await abort(
                context,
                grpc.StatusCode.INTERNAL,
                "INTERNAL",
                f"internal error in {rpc}: {type(error).__name__}",
            )

    def _resolve(self, bundle: str) -> Path:
        """The trace file of `bundle` under the root; _RefusalError when it may not be read."""
        problem = ""
        if not bundle:
            problem = "is empty"
        elif "\0" in bundle:
            problem = "contains a NUL byte"
        elif len(bundle.encode()) > _MAX_PATH_BYTES:
            problem = f"is longer than {_MAX_PATH_BYTES} bytes"
        if problem:
            raise _RefusalError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "BUNDLE_PATH_INVALID",
                f"bundle path {problem}",
            )
        # realpath follows every symlink, so the containment check sees where reads would land.
        candidate = os.path.realpath(os.path.join(self._root, bundle))
        self._require_inside(candidate, bundle)
        try:
            trace_file = resolve_trace_file(candidate)
        except OSError as error:
            if error.errno != errno.ENAMETOOLONG:
                raise
            raise _RefusalError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "BUNDLE_PATH_INVALID",
                "bundle path has a name longer than the file system allows",
            ) from error
        except BundleNotFoundError as error:
            raise _RefusalError(
                grpc.StatusCode.NOT_FOUND, "BUNDLE_NOT_FOUND", f"no bundle at {bundle!r}"
            ) from error
        except NotABundleError as error:
            raise _RefusalError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "NOT_A_BUNDLE",
                f"not a trace bundle (no trace.binpb): {bundle!r}",
            ) from error
        real_file = os.path.realpath(trace_file)
        self._require_inside(real_file, bundle)
        return Path(real_file)

    def _require_inside(self, path: str, bundle: str) -> None:
        if os.path.commonpath([self._root, path]) != self._root:
            raise _RefusalError(
                grpc.StatusCode.PERMISSION_DENIED,
                "PATH_OUTSIDE_ROOT",
                f"bundle path {bundle!r} is outside the bundle root",
            )

    async def _reduce_bundle(
        self, request: reducer_pb2.ReduceBundleRequest
    ) -> reducer_pb2.ReduceBundleResponse:
        trace_file = self._resolve(request.bundle)
        return await asyncio.to_thread(self._reduce_file, trace_file, request)

    def _reduce_file(
        self, trace_file: Path, request: reducer_pb2.ReduceBundleRequest
    ) -> reducer_pb2.ReduceBundleResponse:
        trace = replay_bundle(trace_file)
        require_reducible(trace.integrity, salvage=request.salvage, source=repr(request.bundle))
        response = reducer_pb2.ReduceBundleResponse(trace=trace)
        if request.write_state:
            response.state_path = str(write_state_json(trace, trace_file.parent / STATE_FILE_NAME))
        return response

    async def _reduce_records(
        self, requests: AsyncIterator[reducer_pb2.ReduceRecordsRequest]
    ) -> reducer_pb2.ReduceRecordsResponse:
        decoder = FrameDecoder()
        reducer = Reducer()
        salvage: bool | None = None

        def feed(chunk: bytes) -> None:
            reducer.apply_many(decoder.feed(chunk))

        received = 0
        async for request in requests:
            if salvage is None:
                salvage = request.salvage
            received += len(request.chunk)
            if received > self._max_upload_bytes:
                raise _RefusalError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "UPLOAD_TOO_LARGE",
                    f"the upload exceeds the {self._max_upload_bytes}-byte limit "
                    "(trace-reducer serve --max-upload-bytes)",
                    limit_bytes=str(self._max_upload_bytes),
                )
            if request.chunk:
                # Off the event loop: a large chunk holds many records.
                await asyncio.to_thread(feed, request.chunk)
            if decoder.stopped:
                # Nothing after the first bad frame counts: answer now, read no further.
                break
        reducer.set_integrity(decoder.finish())
        trace = reducer.state()
        require_reducible(trace.integrity, salvage=bool(salvage), source="upload")
        return reducer_pb2.ReduceRecordsResponse(trace=trace)


def add_to_server(service: ReducerService, server: grpc.aio.Server) -> None:
    """Register the service on a grpc.aio server."""
    reducer_pb2_grpc.add_ReducerServiceServicer_to_server(service, server)
