"""The one read-and-reduce pass: a bundle's records through the reducer, its fork's parent
and its rewards taken into account here. Every consumer reduces a bundle through it."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rollout.trace.v1 import record_pb2, state_pb2

from ..bundle._bulk import DeltaRun
from ..bundle._errors import PayloadError
from ..bundle._payloads import PayloadStore
from ..bundle._reader import BundleReader, Integrity, Item
from ..bundle._rewards import RewardFile, add_rewards, read_rewards
from ._items import ItemInfo
from ._parents import ForkResolver, ParentBundle
from ._reducer import Reducer


@dataclass
class Reduced:
    """A bundle reduced: its state and, for a fork, the parent it was resolved against."""

    trace: state_pb2.RolloutTrace
    parent: ParentBundle | None
    # What the reducer kept of the bundle's payloads: the bytes it did not parse (within its
    # budget) and the items it parsed, which is all a fork's parent needs to hand on.
    held: tuple[PayloadStore, dict[str, ItemInfo]]


class _Beside:
    """The default reward source: the rewards.binpb beside the bundle read."""


BESIDE = _Beside()


def keeping_payloads(store: PayloadStore) -> Callable[[record_pb2.TraceRecord], None]:
    """An on_record that keeps every payload in `store` (a fork may share any of them, a
    page may show any); one that does not fit is the reducer's to report, not this one's."""

    def keep(record: record_pb2.TraceRecord) -> None:
        if record.WhichOneof("body") == "payload":
            with contextlib.suppress(PayloadError):
                store.add(record.payload)

    return keep


def reduce_reader(
    reader: BundleReader,
    *,
    forks: ForkResolver | None,
    rewards: RewardFile | _Beside | None = BESIDE,
    compact: bool = False,
    on_record: Callable[[record_pb2.TraceRecord], None] | None = None,
    on_batch: Callable[[list[Item]], None] | None = None,
) -> Reduced:
    """Reduce every record `reader` yields, up to the first damage.

    forks: asked for a fork's parent (None: a fork's shared prefix stays unresolved).
    rewards: the rewards to attach; by default those of the rewards.binpb beside the bundle;
    None: none (a fork's parent, whose rewards are its own). on_record: shown every record but
    the text deltas read in bulk (payloads a consumer keeps, say). on_batch: shown every batch
    once applied, the bulk text deltas included (the replay's recorded provider streams).
    compact: Reducer.state's compact form.
    """
    reducer = Reducer(forks=forks)
    with no_cycle_collection():
        for batch in reader.batches():
            if on_record is not None:
                for record in batch:
                    if not isinstance(record, DeltaRun):
                        on_record(record)
            reducer.apply_many(batch)
            if on_batch is not None:
                on_batch(batch)
    if isinstance(rewards, _Beside):
        rewards = read_rewards(reader.bundle_dir)
    return Reduced(
        settle(reducer, reader.integrity, rewards, compact=compact, final=True),
        reducer.parent,
        reducer.held_payloads(),
    )


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cycle collector off for a pass over many records, on again after if it was on.

    A pass makes objects by the thousand that live until its end: the collector's passes over
    them are wasted (a tenth of an agent-written bundle's replay, a third of a warm listing of
    100,000 bundles). A reduction leaves no cycles (tested), so nothing of it waits for the
    collector to come back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def settle(
    reducer: Reducer,
    integrity: Integrity,
    rewards: RewardFile | None,
    *,
    compact: bool = False,
    final: bool = False,
) -> state_pb2.RolloutTrace:
    """The state once the records are in: their integrity set, the rewards attached. The end
    of reduce_reader, and of a follower that reduced the records as they were written.

    final: the reducer's own state is handed over (Reducer.final_state) and it takes no more
    records; by default a copy, and the follower reads on."""
    reducer.set_integrity(integrity)
    trace = reducer.final_state(compact=compact) if final else reducer.state(compact=compact)
    if rewards is not None:
        add_rewards(trace, rewards)
    return trace
