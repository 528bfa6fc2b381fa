"""Mutated payloads through the payloads' C encoding (scripts/fuzz-scan.sh builds it with
AddressSanitizer).

Memory safety first, and beside it the one rule the tests hold on random values: whatever the C
way encodes, it encodes to json's bytes. Each input is a conversation item or request body such
as the agent records, written as JSON, with bytes changed, cut, inserted or dropped, and read
back by json (which takes NaN, Infinity, long numbers and lone surrogates) wherever it still
reads.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from fuzz_scan import load, mutate

from trace_reducer.bundle._payloads import canonical_json_reference


def sample_payloads() -> list[bytes]:
    item: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [
            {"type": "output_text", "text": 'wé€😀 "q" \\ \u2028\x7f\t', "annotations": []}
        ],
    }
    body = {
        "model": "m",
        "stream": True,
        "temperature": 0.7,
        "top_p": 1e-05,
        "max_output_tokens": 12345678901234567890,
        "input": [item, {"type": "function_call_output", "call_id": "c", "output": "[1, 2.5e300]"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"b": None, "a": [True, False]}}],
    }
    return [json.dumps(value).encode() for value in (item, body)] + [b'[NaN, -Infinity, "\\ud800"]']


def main() -> None:
    encoder = load(sys.argv[1], "_canonical")
    seconds = float(sys.argv[2])
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    samples = sample_payloads()
    deadline = time.monotonic() + seconds
    inputs = encoded = 0
    while time.monotonic() < deadline:
        damaged = mutate(rng.choice(samples), rng)
        try:
            value = json.loads(damaged)
        except (ValueError, RecursionError):
            continue
        inputs += 1
        written = encoder.encode(value)
        if written is not None:
            encoded += 1
            assert written == canonical_json_reference(value), damaged
    print(
        f"fuzz-canonical: {inputs:,} mutated payloads read, {encoded:,} encoded the C way, "
        "no memory error"
    )


if __name__ == "__main__":
    main()
