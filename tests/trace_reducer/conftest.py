"""Fixtures the reducer's tests share: a copy of the golden corpus to list and serve."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "bundles"
TRACE_REDUCER = str(Path(sys.executable).parent / "trace-reducer")
# When the golden bundles were recorded (seconds since the epoch).
OLD = 1_700_000_000


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The golden corpus copied under tmp_path/runs."""
    target = tmp_path / "runs"
    shutil.copytree(GOLDEN, target)
    # Copies are new files: make them as old as the recordings, so none counts as live.
    for path in target.rglob("*.binpb"):
        os.utime(path, (OLD, OLD))
    return target
