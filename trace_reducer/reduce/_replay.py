"""replay_bundle: a whole bundle file through the reader and the reducer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from rollout.trace.v1 import state_pb2

from ..bundle._confine import ConfinedBundle
from ..bundle._reader import BundleReader, Item, read_bundle
from ..bundle._rewards import read_rewards
from ._forks import BundleForkResolver
from ._parents import ForkResolver
from ._pass import reduce_reader


def replay_bundle(
    path: str | os.PathLike[str],
    *,
    parents: Iterable[str | os.PathLike[str]] = (),
    compact: bool = False,
) -> state_pb2.RolloutTrace:
    """Reduce a whole bundle (its directory or trace.binpb) up to its first damage, with the
    rewards of its rewards.binpb.

    A fork's shared prefix is read from its parent bundle: one of `parents`, or the bundle
    beside it under the same trace root; when neither has it, integrity says so. compact: the
    state's compact form (Reducer.state).
    Raises BundleError when path is missing or not a bundle, ReductionError when its records
    contradict each other; damage is reported in the state's integrity, never raised.
    """
    with read_bundle(path) as reader:
        forks = BundleForkResolver(reader.bundle_dir, parents)
        return replay_reader(reader, forks=forks, compact=compact)


def replay_confined(bundle: ConfinedBundle) -> state_pb2.RolloutTrace:
    """replay_bundle of a bundle opened under a root (BundleRoot.open): its trace, rewards and
    fork parents all read through descriptors from that root, never by path again, so a
    directory swapped for a symbolic link on the way changes nothing about what is read."""
    return replay_reader(
        bundle.reader(),
        forks=BundleForkResolver.beside(bundle),
        rewards_dir_fd=bundle.dir_fd,
    )


def replay_reader(
    reader: BundleReader,
    *,
    forks: ForkResolver | None = None,
    compact: bool = False,
    rewards_dir_fd: int | None = None,
    observe: Callable[[list[Item]], None] | None = None,
) -> state_pb2.RolloutTrace:
    """replay_bundle on a bundle already open for reading; its rewards.binpb is read beside it
    (through rewards_dir_fd, the bundle directory's descriptor, when given).

    observe(batch), when given, sees every batch the reducer applied, in order: what a reader
    needs of the records beside the state takes it from the same pass."""
    rewards = read_rewards(reader.bundle_dir, dir_fd=rewards_dir_fd)
    return reduce_reader(
        reader, forks=forks, rewards=rewards, compact=compact, on_batch=observe
    ).trace
