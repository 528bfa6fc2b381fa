"""replay_bundle: a whole bundle file through the reader and the reducer."""

from __future__ import annotations

import os

from rollout.trace.v1 import state_pb2

from ._reader import BundleReader, read_bundle
from ._reducer import Reducer


def replay_bundle(path: str | os.PathLike[str], *, compact: bool = False) -> state_pb2.RolloutTrace:
    """Reduce a whole bundle (its directory or trace.binpb) up to its first damage.

    compact: the state's compact form (Reducer.state). Raises BundleError when path is missing
    or not a bundle, ReductionError when its records contradict each other; damage is reported
    in the state's integrity, never raised.
    """
    with read_bundle(path) as reader:
        return replay_reader(reader, compact=compact)


def replay_reader(reader: BundleReader, *, compact: bool = False) -> state_pb2.RolloutTrace:
    """replay_bundle on a bundle already open for reading."""
    reducer = Reducer()
    for batch in reader.batches():
        reducer.apply_many(batch)
    reducer.set_integrity(reader.integrity)
    return reducer.state(compact=compact)
