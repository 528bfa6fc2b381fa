"""P1's floor for the complete form: what it copies is every call's whole request, as
`replay_bundle` gives it, and nothing of the compact form."""

from __future__ import annotations

from pathlib import Path

from bench.reducer_bench import CompleteRequests
from bench.synthetic import Shape, write_conversation
from trace_reducer import replay_bundle


def test_the_copy_floor_copies_each_calls_whole_request(tmp_path: Path) -> None:
    bundle = write_conversation(tmp_path, Shape(turns=6, deltas_per_turn=3))
    complete = replay_bundle(bundle)
    compact = replay_bundle(bundle, compact=True)
    requests = CompleteRequests(bundle, copies=2)
    assert requests.copy() == len(complete.inference_calls) == 6
    copied = sorted(
        (list(call.request_item_ids), list(call.input_payload_ids))
        for call in requests.state.inference_calls.values()
    )
    whole = sorted(
        (list(call.request_item_ids), list(call.input_payload_ids))
        for call in complete.inference_calls.values()
    )
    assert copied == whole
    # The compact form holds less: the floor copies what the expansion adds.
    held = sum(len(call.request_item_ids) for call in compact.inference_calls.values())
    assert held < sum(len(ids) for ids, _ in copied)
    # Each copy fills a fresh state.
    first = requests.state
    requests.copy()
    assert requests.state is not first
    again = sorted(
        (list(call.request_item_ids), list(call.input_payload_ids))
        for call in requests.state.inference_calls.values()
    )
    assert again == whole
