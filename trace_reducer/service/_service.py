"""ReducerService: reduces bundles under a root directory, or uploaded as a stream of chunks.

Status codes, each with a google.rpc.ErrorInfo (domain `rollout-trace`) whose reason is:

* INVALID_ARGUMENT / BUNDLE_PATH_INVALID: `bundle` is empty or holds a NUL byte.
* PERMISSION_DENIED / PATH_OUTSIDE_ROOT: `bundle` leads outside the bundle root, or through a
  symbolic link below it (never followed: where it points can change after any check).
* NOT_FOUND / BUNDLE_NOT_FOUND: nothing exists at that path under the root.
* INVALID_ARGUMENT / NOT_A_BUNDLE: the path exists but is not a bundle (no trace.binpb, or no
  readable header record); for ReduceRecords, an upload without a header record.
* DATA_LOSS / BUNDLE_CORRUPT: the bundle is CORRUPT and `salvage` was not set; metadata carries
  `bad_frame_offset` and `bad_frame_seq`. UNCLOSED and TRUNCATED bundles reduce normally.
* FAILED_PRECONDITION / RECORDS_CONTRADICT: the records contradict each other.
* FAILED_PRECONDITION / RECORD_OUT_OF_RANGE: a record's time is outside the years 1-9999.
* FAILED_PRECONDITION / IO_ERROR: the bundle could not be read or state.json written.
* RESOURCE_EXHAUSTED / UPLOAD_TOO_LARGE: a ReduceRecords upload passed the service's limit
  (`max_upload_bytes`, `trace-reducer serve --max-upload-bytes`); metadata `limit_bytes`.
* INTERNAL / INTERNAL: a bug; logged on the server, the client gets no traceback.

WatchBundle resolves and answers as ReduceBundle (without salvage); a bundle found damaged
while it is followed ends the stream with DATA_LOSS after the states before the damage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc

from grpc_common import ErrorMapping, RpcStatusError, StatusRule
from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc

from ..bundle._confine import BundleRoot
from ..bundle._errors import (
    BundleError,
    BundleNotFoundError,
    BundlePathError,
    CorruptBundleError,
    NotABundleError,
    OutsideRootError,
    RecordOutOfRangeError,
    ReductionError,
    describe_os_error,
)
from ..bundle._framing import DEFAULT_MAX_UPLOAD_BYTES
from ..bundle._integrity import require_reducible
from ..bundle._layout import STATE_FILE_NAME
from ..bundle._reader import FrameDecoder
from ..reduce._forks import BundleForkResolver
from ..reduce._reducer import Reducer
from ..reduce._replay import replay_confined
from ..reduce._state_json import write_state_json_at
from ..view._watch import follow_bundle

SERVICE_NAME: str = reducer_pb2.DESCRIPTOR.services_by_name["ReducerService"].full_name

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[object, object]
else:  # the runtime class is not generic
    _Context = grpc.aio.ServicerContext


class _UploadTooLargeError(RpcStatusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "UPLOAD_TOO_LARGE"


def _bad_frame(error: BaseException) -> dict[str, str]:
    assert isinstance(error, CorruptBundleError)
    return {
        "bad_frame_offset": str(error.integrity.bad_frame_offset),
        "bad_frame_seq": str(error.integrity.bad_frame_seq),
    }


def _os_error(error: BaseException) -> str:
    assert isinstance(error, OSError)
    return describe_os_error(error)


_Code = grpc.StatusCode
# The statuses the docstring lists, subclasses before their bases.
ERRORS = ErrorMapping(
    [
        StatusRule(BundlePathError, _Code.INVALID_ARGUMENT, "BUNDLE_PATH_INVALID"),
        StatusRule(OutsideRootError, _Code.PERMISSION_DENIED, "PATH_OUTSIDE_ROOT"),
        StatusRule(CorruptBundleError, _Code.DATA_LOSS, "BUNDLE_CORRUPT", metadata=_bad_frame),
        StatusRule(RecordOutOfRangeError, _Code.FAILED_PRECONDITION, "RECORD_OUT_OF_RANGE"),
        StatusRule(ReductionError, _Code.FAILED_PRECONDITION, "RECORDS_CONTRADICT"),
        # Removed after it was resolved, too.
        StatusRule(BundleNotFoundError, _Code.NOT_FOUND, "BUNDLE_NOT_FOUND"),
        StatusRule(NotABundleError, _Code.INVALID_ARGUMENT, "NOT_A_BUNDLE"),
        # The file exists but cannot be opened, or state.json cannot be written.
        StatusRule(BundleError, _Code.FAILED_PRECONDITION, "IO_ERROR"),
        StatusRule(OSError, _Code.FAILED_PRECONDITION, "IO_ERROR", describe=_os_error),
    ],
    log=_log,
)


class ReducerService(reducer_pb2_grpc.ReducerServiceServicer):
    """Replays bundles found under bundle_root, never reading outside it."""

    def __init__(
        self,
        bundle_root: str | os.PathLike[str],
        *,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    ) -> None:
        self._root = BundleRoot(bundle_root)
        self._max_upload_bytes = max_upload_bytes

    @property
    def bundle_root(self) -> str:
        return self._root.path

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

    async def WatchBundle(  # noqa: N802 - the name is the RPC's
        self, request: reducer_pb2.WatchBundleRequest, context: _Context
    ) -> AsyncIterator[reducer_pb2.WatchBundleResponse]:
        try:
            # Opened once under the root, as for ReduceBundle; the follower reads that file.
            bundle = self._root.open(request.bundle)
            try:
                follow = follow_bundle(
                    bundle.trace,
                    Path(bundle.display_dir),
                    rewards_dir_fd=bundle.dir_fd,
                    forks=BundleForkResolver.beside(bundle),
                )
                async with contextlib.aclosing(follow) as updates:
                    async for update in updates:
                        # The state up to the damage first, then DATA_LOSS: also for a bundle
                        # already damaged when the watch starts (its first update is final).
                        # What holds no record at all is no bundle: no state, its error.
                        if update.records_read or not update.final:
                            yield reducer_pb2.WatchBundleResponse(
                                trace=update.trace, records_read=update.records_read
                            )
                        if update.final:
                            require_reducible(
                                update.trace.integrity, salvage=False, source=repr(request.bundle)
                            )
            finally:
                # The trace file is the follower's to close, once no worker reads it.
                bundle.release_directory()
        except Exception as error:  # noqa: BLE001 - mapped to its status
            # A client that goes away arrives as CancelledError, which is no Exception: the
            # follower's own cleanup closes the file.
            await ERRORS.refuse(context, "WatchBundle", error)

    async def _answer(self, context: _Context, rpc: str, work: Awaitable[_T]) -> _T:
        async with ERRORS.translated(context, rpc):
            return await work

    async def _reduce_bundle(
        self, request: reducer_pb2.ReduceBundleRequest
    ) -> reducer_pb2.ReduceBundleResponse:
        return await asyncio.to_thread(self._reduce_confined, request)

    def _reduce_confined(
        self, request: reducer_pb2.ReduceBundleRequest
    ) -> reducer_pb2.ReduceBundleResponse:
        # Read and written through the descriptors opened here: swapping a directory on the
        # way for a symlink changes nothing about where the bytes come from or go.
        with self._root.open(request.bundle) as bundle:
            # A fork's parent is looked for beside the bundle, from the root again.
            trace = replay_confined(bundle)
            require_reducible(trace.integrity, salvage=request.salvage, source=repr(request.bundle))
            response = reducer_pb2.ReduceBundleResponse(trace=trace)
            if request.write_state:
                state_path = os.path.join(bundle.display_dir, STATE_FILE_NAME)
                write_state_json_at(trace, bundle.dir_fd, STATE_FILE_NAME, display=state_path)
                response.state_path = state_path
            return response

    async def _reduce_records(
        self, requests: AsyncIterator[reducer_pb2.ReduceRecordsRequest]
    ) -> reducer_pb2.ReduceRecordsResponse:
        decoder = FrameDecoder()
        reducer = Reducer()
        salvage: bool | None = None

        def feed(chunk: bytes) -> None:
            reducer.apply_many(decoder.feed_batch(chunk))

        received = 0
        async for request in requests:
            if salvage is None:
                salvage = request.salvage
            received += len(request.chunk)
            if received > self._max_upload_bytes:
                raise _UploadTooLargeError(
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
        trace = reducer.final_state()
        require_reducible(trace.integrity, salvage=bool(salvage), source="upload")
        return reducer_pb2.ReduceRecordsResponse(trace=trace)


def add_to_server(service: ReducerService, server: grpc.aio.Server) -> None:
    """Register the service on a grpc.aio server."""
    reducer_pb2_grpc.add_ReducerServiceServicer_to_server(service, server)
