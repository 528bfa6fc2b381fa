"""tune_collector_for_serving: start-up frozen, the young generation's threshold raised."""

from __future__ import annotations

import json
import subprocess
import sys

from grpc_common._collector import YOUNG_GENERATION_THRESHOLD

# In a child: the collector's settings are the whole process's, and the test run's own must
# stay as they are.
_CHILD = """
import gc, json, sys
gc.set_threshold(700, 11, 12)
if sys.argv[1] == "disabled":
    gc.disable()
before = gc.get_freeze_count()
from grpc_common import tune_collector_for_serving
tune_collector_for_serving()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count() - before,
                  "enabled": gc.isenabled()}))
"""


def _tuned(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_start_up_is_frozen_and_young_passes_are_rarer() -> None:
    tuned = _tuned("enabled")
    # The older generations keep what the process had.
    assert tuned["threshold"] == [YOUNG_GENERATION_THRESHOLD, 11, 12]
    assert isinstance(tuned["frozen"], int)
    assert tuned["frozen"] > 1000
    assert tuned["enabled"] is True


def test_a_collector_switched_off_stays_off_and_untouched() -> None:
    tuned = _tuned("disabled")
    assert tuned == {"threshold": [700, 11, 12], "frozen": 0, "enabled": False}
