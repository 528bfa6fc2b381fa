"""Mutated bundles through the C frame scanner built with AddressSanitizer (scripts/fuzz-scan.sh).

Memory safety only: what the scan reads is compared with Python's reads in the test suite. Each
input is a small bundle of deltas and payloads with bytes changed, cut, inserted or dropped,
scanned from a random position with a random expected seq.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import random
import sys
import time
from types import ModuleType

from rollout.trace.v1 import record_pb2
from trace_reducer import encode_record


def load(path: str, name: str = "_scan") -> ModuleType:
    """The extension module `name` built at path (its init function is PyInit_<name>)."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def sample_bundle() -> bytes:
    frames = []
    for seq in range(1, 60):
        record = record_pb2.TraceRecord(seq=seq, time_us=seq * 1000)
        if seq % 5:
            record.output_text_delta.call = 1
            record.output_text_delta.delta = "wé€😀 "[: seq % 6]
        else:
            record.payload.payload_id = f"p{seq}"
            record.payload.data = b"x" * (seq * 7)
        frames.append(encode_record(record))
    return b"".join(frames)


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(len(out))
        choice = rng.random()
        if choice < 0.5:
            out[at] = rng.randrange(256)
        elif choice < 0.7:
            del out[at : at + rng.randint(1, 20)]
        elif choice < 0.9:
            out[at:at] = rng.randbytes(rng.randint(1, 20))
        else:
            del out[at:]
        if not out:
            out = bytearray(b"\x00")
    return bytes(out)


def main() -> None:
    scan = load(sys.argv[1])
    seconds = float(sys.argv[2])
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    data = sample_bundle()
    deadline = time.monotonic() + seconds
    inputs = 0
    while time.monotonic() < deadline:
        damaged = mutate(data, rng)
        seq = rng.choice([1, 2, rng.randrange(100)])
        scan.scan(damaged, rng.randrange(len(damaged) + 1), seq)
        scan.count_deltas(damaged)
        scan.crc32c(damaged)
        scan.crc32c(damaged, True)
        inputs += 1
    print(f"fuzz-scan: {inputs:,} mutated bundles scanned, no memory error")


if __name__ == "__main__":
    main()
