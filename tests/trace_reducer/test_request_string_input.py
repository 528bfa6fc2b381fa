"""`inference_started.input_as_string`: a call that sent `input` as a string is given back with
that string, by `trace-reducer request` and to a replay; only when its input is the one user
message such a string stands for, else as the list (a bundle that says more than it holds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trace_reducer import canonical_json, read_recorded_thread, request_body

from .bundles import BundleBuilder, user_item

ONE_MESSAGE = [{"content": "a string input", "role": "user"}]


@pytest.mark.parametrize(
    ("items", "as_string", "sent"),
    [
        (ONE_MESSAGE, True, "a string input"),
        # A bundle written before the field, or a call that sent the list: the list.
        (ONE_MESSAGE, False, ONE_MESSAGE),
        # The flag with an input no string stands for: the list, as recorded.
        ([{**ONE_MESSAGE[0], "type": "message"}], True, [{**ONE_MESSAGE[0], "type": "message"}]),
        (ONE_MESSAGE * 2, True, ONE_MESSAGE * 2),
        ([{"content": "hi", "role": "assistant"}], True, [{"content": "hi", "role": "assistant"}]),
        ([user_item("parts")], True, [user_item("parts")]),
    ],
)
def test_request_gives_back_a_string_input(
    tmp_path: Path, items: list[dict[str, Any]], as_string: bool, sent: Any
) -> None:
    bundle = BundleBuilder(tmp_path)
    turn = bundle.turn("turn-1", items)
    bundle.records.inference_started_after_prefix(
        turn,
        inference_call_id="call-1",
        attempt=1,
        model="m",
        provider_base_url="http://127.0.0.1:9/v1",
        envelope={"model": "m", "stream": True},
        prefix_count=0,
        new_items=items,
        input_as_string=as_string,
    )
    path = bundle.close()
    expected = canonical_json({"input": sent, "model": "m", "stream": True})
    assert request_body(path, "call-1") == expected
    printed = subprocess.run(
        [sys.executable, "-m", "trace_reducer.cli", "request", str(path), "call-1"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    assert printed == expected + b"\n"
    (call,) = read_recorded_thread(path).calls
    assert call.request == json.loads(expected)
