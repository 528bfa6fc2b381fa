"""The cycle collector set for a long-running server: start-up frozen, young passes rarer."""

from __future__ import annotations

import gc

# A server allocates all the time (a delta's event, record and messages) and makes little
# cyclic garbage, so the collector's default, a young-generation pass every 700 net
# allocations, runs hundreds of times a second at load, and every hundredth pass is a full
# one. Measured at P5's load (200 threads x 50 deltas/s; README, "Levers on the streaming
# path"): at 700, 21 µs of collector CPU a delta and full passes of 100-250 ms, during which
# no stream moves; at this threshold with start-up frozen, 3.4 µs and one full pass in the run.
YOUNG_GENERATION_THRESHOLD = 20_000


def tune_collector_for_serving() -> None:
    """Call once the server is up: what start-up made (modules, descriptors, the server's own
    objects) leaves the collector's passes for good, and the young generation is collected
    every YOUNG_GENERATION_THRESHOLD net allocations. A collector switched off stays off."""
    if not gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
