"""Many independent runs of the installed commands at once, one per core: a test that checks
dozens of short runs (each mostly an interpreter starting) waits for them side by side."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def run_each(
    argvs: Sequence[Sequence[str]], timeout: float = 60
) -> list[subprocess.CompletedProcess[str]]:
    """subprocess.run of every argv (output captured as text), in the order given."""

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(run, argvs))
