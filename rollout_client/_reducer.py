"""ReducerClient: the reducer's gRPC API (`trace-reducer serve`) as typed async Python."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Unpack

import grpc

from rollout.reducer.v1 import reducer_pb2, reducer_pb2_grpc
from rollout.trace.v1 import state_pb2

from ._channel import HEALTH_CHECK, Connection
from ._defaults import (
    DEFAULT_REDUCER_ADDRESS,
    DEFAULT_TIMEOUT,
    REDUCER_ADDRESS_ENV,
    address_from_env,
    token_from_env,
)
from ._errors import error_from_rpc
from ._options import CallOptions

_SERVICE = "rollout.reducer.v1.ReducerService"
# Reducing a bundle again gives the same state (and writes the same state.json).
IDEMPOTENT_CALLS = ((_SERVICE, "ReduceBundle"), HEALTH_CHECK)
# The size of the chunks an upload is cut into: well under gRPC's 4 MiB message limit.
_UPLOAD_CHUNK = 1 << 20


class ReducerClient(Connection):
    """A connection to a reducer service: `async with ReducerClient(address) as reducer: ...`.

    `address` defaults to $ROLLOUT_REDUCER_ADDRESS, else 127.0.0.1:50052; `token`, `tls` and
    `timeout` as for AgentClient (WatchBundle, a stream, has no deadline). Bundles are named
    relative to the service's bundle root.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: bool | str | Path = False,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(
            address or address_from_env(DEFAULT_REDUCER_ADDRESS, REDUCER_ADDRESS_ENV),
            tls,
            IDEMPOTENT_CALLS,
            token or token_from_env(),
            timeout,
        )
        self.stub = reducer_pb2_grpc.ReducerServiceStub(self._channel)

    async def reduce_bundle(
        self,
        bundle: str,
        *,
        write_state: bool = False,
        salvage: bool = False,
        **options: Unpack[CallOptions],
    ) -> reducer_pb2.ReduceBundleResponse:
        """The reduced state of a bundle under the service's root (`.trace`), and where
        state.json went with write_state (`.state_path`)."""
        request = reducer_pb2.ReduceBundleRequest(
            bundle=bundle, write_state=write_state, salvage=salvage
        )
        call = self.stub.ReduceBundle(
            request, metadata=self.metadata, timeout=options.get("timeout", self.timeout)
        )
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    async def reduce_records(
        self,
        data: bytes | Iterable[bytes],
        *,
        salvage: bool = False,
        **options: Unpack[CallOptions],
    ) -> state_pb2.RolloutTrace:
        """The reduced state of a trace.binpb's bytes (all of them, or its chunks in order)
        uploaded to the service: for bundles the service cannot read from its root."""
        chunks = _chunks(data) if isinstance(data, bytes) else data

        async def requests() -> AsyncIterator[reducer_pb2.ReduceRecordsRequest]:
            first = True
            for chunk in chunks:
                yield reducer_pb2.ReduceRecordsRequest(chunk=chunk, salvage=salvage and first)
                first = False

        call = self.stub.ReduceRecords(
            requests(), metadata=self.metadata, timeout=options.get("timeout", self.timeout)
        )
        try:
            reply = await call
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None
        return reply.trace

    async def watch_bundle(self, bundle: str) -> AsyncIterator[reducer_pb2.WatchBundleResponse]:
        """The bundle's state each time new records arrive (`.trace`, `.records_read`), until
        its footer (or a corrupt frame): `async for update in reducer.watch_bundle(name)`."""
        call = self.stub.WatchBundle(
            reducer_pb2.WatchBundleRequest(bundle=bundle), metadata=self.metadata
        )
        try:
            async for update in call:
                yield update
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None
        finally:
            call.cancel()


def _chunks(data: bytes) -> list[bytes]:
    return [data[start : start + _UPLOAD_CHUNK] for start in range(0, len(data), _UPLOAD_CHUNK)]
