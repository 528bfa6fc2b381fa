"""replay_bundle: a whole bundle file through the reader and the reducer."""

from __future__ import annotations

import os
from collections.abc import Iterable

from rollout.trace.v1 import state_pb2

from ._forks import BundleForkResolver
from ._reader import read_bundle
from ._reducer import Reducer
from ._rewards import attach_rewards


def replay_bundle(
    path: str | os.PathLike[str], *, parents: Iterable[str | os.PathLike[str]] = ()
) -> state_pb2.RolloutTrace:
    """Reduce a whole bundle (its directory or trace.binpb) up to its first damage, with the
    rewards of its rewards.binpb.

    A fork's shared prefix is read from its parent bundle: one of `parents`, or the bundle
    beside it under the same trace root; when neither has it, integrity says so.
    Raises BundleError when path is missing or not a bundle, ReductionError when its records
    contradict each other; damage is reported in the state's integrity, never raised.
    """
    with read_bundle(path) as reader:
        reducer = Reducer(forks=BundleForkResolver(reader.bundle_dir, parents))
        for batch in reader.batches():
            reducer.apply_many(batch)
        reducer.set_integrity(reader.integrity)
        bundle_dir = reader.bundle_dir
    trace = reducer.state()
    attach_rewards(trace, bundle_dir)
    return trace
