"""WatchBundle of a bundle already damaged when the watch starts."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rollout.reducer.v1 import reducer_pb2

from .live import reducer_service
from .test_watch import _bad_bundles


async def test_a_bundle_corrupt_from_the_start_sends_its_state_before_data_loss(
    tmp_path: Path,
) -> None:
    # Was: DATA_LOSS and no state at all; `trace-reducer watch` showed the records before.
    root = tmp_path / "root"
    bundles = _bad_bundles(root)
    received: list[reducer_pb2.WatchBundleResponse] = []
    async with reducer_service(root) as stub:
        call = stub.WatchBundle(reducer_pb2.WatchBundleRequest(bundle="corrupt"))

        async def read_all() -> None:
            async for response in call:
                received.append(response)

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await read_all()
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS
    assert received, "no state came before DATA_LOSS"
    last = received[-1]
    # Seq 6 is the bad frame: the five before it are the state.
    assert last.records_read == 5
    assert last.trace.turns
    assert bundles["corrupt"].exists()
