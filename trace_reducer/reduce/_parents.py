"""What the reducer asks a fork's parent through: the ForkResolver interface and ParentBundle.

Kept apart from the resolver that finds and reduces parents (`_forks`), so the reducer never
imports what builds reducers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from rollout.trace.v1 import record_pb2, state_pb2

from ..bundle._errors import PayloadError
from ..bundle._payloads import PayloadStore
from ._items import ItemInfo


class ParentBundle:
    """A fork's parent, reduced: its state, its items parsed, the payload bytes it kept, and
    its own parent (the chain is walked in a loop, however long)."""

    def __init__(
        self,
        path: Path,
        trace: state_pb2.RolloutTrace,
        payloads: PayloadStore,
        grandparent: ParentBundle | None,
        items: dict[str, ItemInfo] | None = None,
    ) -> None:
        self.path = path
        self.trace = trace
        self._payloads = payloads
        self._items = items or {}
        self._grandparent = grandparent

    def _chain(self) -> Iterator[ParentBundle]:
        node: ParentBundle | None = self
        while node is not None:
            yield node
            node = node._grandparent

    def payload(self, pid: str) -> bytes | None:
        """The bytes of payload `pid`, from this bundle or the bundles it forked from."""
        for node in self._chain():
            with contextlib.suppress(PayloadError):
                return node._payloads.get(pid)
        return None

    def item_info(self, pid: str) -> ItemInfo | None:
        """The item payload `pid` holds, as this bundle (or one it forked from) parsed it."""
        for node in self._chain():
            info = node._items.get(pid)
            if info is not None:
                return info
        return None

    def payload_ids(self) -> frozenset[str]:
        """Every payload id `payload` answers: this bundle's and its ancestors'."""
        return frozenset().union(*(node._payloads.ids() for node in self._chain()))

    def prefix_items(self, payload_ids: Sequence[str]) -> list[state_pb2.ConversationItem | None]:
        """The parent's conversation items a fork's prefix names, in order: for each payload
        id the first of the parent's items with that payload not taken yet."""
        thread = self.trace.threads.get(self.trace.root_thread_id)
        order = list(thread.conversation_item_ids) if thread is not None else []
        by_payload: dict[str, list[str]] = {}
        for item_id in order:
            item = self.trace.conversation_items[item_id]
            by_payload.setdefault(item.payload_id, []).append(item_id)
        found: list[state_pb2.ConversationItem | None] = []
        for pid in payload_ids:
            candidates = by_payload.get(pid)
            found.append(self.trace.conversation_items[candidates.pop(0)] if candidates else None)
        return found


def fork_payload(payloads: PayloadStore, parent: ParentBundle | None, pid: str) -> bytes:
    """Payload `pid` of a bundle, else of the fork's parent it shares its history with.

    Raises PayloadError when neither has it."""
    try:
        return payloads.get(pid)
    except PayloadError:
        data = parent.payload(pid) if parent is not None else None
        if data is None:
            raise
        return data


def fork_chain(
    forked: record_pb2.ThreadForked, parent: ParentBundle | None
) -> list[state_pb2.ForkLink]:
    """The threads a fork's history came through, its parent first: each with where it came
    from in turn (as far as the parent bundles were read)."""
    link = state_pb2.ForkLink(thread_id=forked.parent_thread_id, bundle=forked.parent_bundle)
    if parent is None or not parent.trace.HasField("fork"):
        return [link]
    origin = parent.trace.fork
    link.parent_thread_id = origin.parent_thread_id
    link.after_turn_id = origin.after_turn_id
    link.group_id = origin.group_id
    link.repetition_index = origin.repetition_index
    link.resumed = origin.resumed
    return [link, *origin.ancestors]


class ForkResolver(Protocol):
    """What the reducer asks when a bundle turns out to be a fork."""

    def resolve(self, forked: record_pb2.ThreadForked) -> ParentBundle | None:
        """The parent bundle of a fork, reduced; None when it cannot be found or read."""
