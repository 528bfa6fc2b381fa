"""The compact form of a reduced state: each request as a prefix of the previous one plus items.

A conversation re-sends its whole history with every request, so listing every request whole
makes the state grow with the square of the conversation. The compact form keeps, on each
InferenceCall, only the items after `request_prefix_count` items of the request of
`request_prefix_call_id`. This module turns it back into the complete form, one call at a time
if need be, so that a writer never holds more than one complete request.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

from rollout.trace.v1 import state_pb2

_Request = tuple[list[str], list[str]]


class RequestIndex:
    """Every call's compact request, by call id, and the complete request of any of them.

    remember: keep every complete request found, so expanding all calls costs what the complete
    form holds; without it only one call's is held at a time, and each walks its chain anew.
    """

    __slots__ = ("_calls", "_known")

    def __init__(
        self, calls: Mapping[str, state_pb2.InferenceCall], *, remember: bool = False
    ) -> None:
        self._known: dict[str, _Request] | None = {} if remember else None
        # What expanding needs of each call, copied: the caller may rewrite the calls.
        self._calls = {
            call_id: (
                call.request_prefix_call_id,
                call.request_prefix_count,
                list(call.request_item_ids),
                list(call.input_payload_ids),
            )
            for call_id, call in calls.items()
        }

    def complete(self, call_id: str) -> _Request:
        """The whole request_item_ids and input_payload_ids of a call.

        Each call's request starts with a prefix of an earlier one's; the chain is walked back
        until no prefix is needed (or a remembered request is reached), then the pieces are
        joined front to back.
        """
        known = self._known
        if known is not None and call_id in known:
            return known[call_id]
        item_pieces: list[list[str]] = []
        payload_pieces: list[list[str]] = []
        wanted: int | None = None  # how many of this call's items are needed; None: all
        current = call_id
        seen: set[str] = set()
        while True:
            entry = self._calls.get(current)
            if entry is None or current in seen:
                # A prefix naming no call (or a loop, in a state written by hand) adds nothing.
                break
            seen.add(current)
            if known is not None and current in known and wanted is not None:
                whole_items, whole_payloads = known[current]
                item_pieces.append(whole_items[:wanted])
                payload_pieces.append(whole_payloads[:wanted])
                break
            prefix_call, prefix_count, items, payloads = entry
            own = len(items) if wanted is None else max(0, wanted - prefix_count)
            item_pieces.append(items[:own])
            payload_pieces.append(payloads[:own])
            needed = prefix_count if wanted is None else min(wanted, prefix_count)
            if not needed or not prefix_call:
                break
            wanted = needed
            current = prefix_call
        item_pieces.reverse()
        payload_pieces.reverse()
        request = (
            list(chain.from_iterable(item_pieces)),
            list(chain.from_iterable(payload_pieces)),
        )
        if known is not None:
            known[call_id] = request
        return request


def is_compact(trace: state_pb2.RolloutTrace) -> bool:
    """Whether any inference call of the state holds its request in the compact form."""
    return any(call.request_prefix_call_id for call in trace.inference_calls.values())


def expand_call(call: state_pb2.InferenceCall, index: RequestIndex) -> None:
    """Make one call's request whole, in place (index was taken before any call changed)."""
    if not call.request_prefix_call_id:
        return
    items, payloads = index.complete(call.inference_call_id)
    del call.request_item_ids[:]
    call.request_item_ids.extend(items)
    del call.input_payload_ids[:]
    call.input_payload_ids.extend(payloads)
    call.ClearField("request_prefix_call_id")
    call.ClearField("request_prefix_count")


def expand_request_items(trace: state_pb2.RolloutTrace) -> None:
    """Turn a compact state into the complete one, in place: every request whole.

    A state already complete is left as it is.
    """
    if not is_compact(trace):
        return
    calls = trace.inference_calls
    index: RequestIndex | None = None
    # The whole request of the call expanded last, as a message of its own: most calls start
    # with the previous call's request, and copying one message's lists into another is done
    # inside the message library, not a string at a time.
    whole = state_pb2.InferenceCall()
    previous = ""
    for call_id in sorted(calls, key=lambda call_id: calls[call_id].execution.started_seq):
        call = calls[call_id]
        prefix = call.request_prefix_call_id
        if prefix and prefix == previous:
            count = call.request_prefix_count
            del whole.request_item_ids[count:]
            del whole.input_payload_ids[count:]
            whole.request_item_ids.extend(call.request_item_ids)
            whole.input_payload_ids.extend(call.input_payload_ids)
            own = state_pb2.InferenceCall()
            own.CopyFrom(call)
            own.ClearField("request_item_ids")
            own.ClearField("input_payload_ids")
            own.ClearField("request_prefix_call_id")
            own.ClearField("request_prefix_count")
            call.CopyFrom(whole)
            call.MergeFrom(own)
        else:
            if prefix:
                # Not the call just before (threads interleaved, or a state written by hand):
                # walk its chain.
                index = index or RequestIndex(calls)
                expand_call(call, index)
            whole.Clear()
            whole.request_item_ids.extend(call.request_item_ids)
            whole.input_payload_ids.extend(call.input_payload_ids)
        previous = call_id
