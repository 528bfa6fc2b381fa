"""What the cycle collector would find left by an action: the project's objects among it."""

from __future__ import annotations

import gc
from collections.abc import Callable

# Only the project's own objects are looked for: another thread (a server a test left to the
# loop's end, a client's pool) may leave cycles of its own at the same moment.
_PROJECT = ("trace_reducer.", "rollout.", "agent_server.")


def left_in_cycles(action: Callable[[], object]) -> list[str]:
    """The type names of the project's objects that `action` left for the cycle collector,
    run with the collector off (and set back as it was after)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        action()
        # With the collector off, all the action made is still in the youngest generation:
        # collecting it alone finds its cycles without walking the whole test session's heap.
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect(0)
        return [
            f"{type(found).__module__}.{type(found).__qualname__}"
            for found in gc.garbage
            if type(found).__module__.startswith(_PROJECT)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
