"""Test-only: put first on a command's PYTHONPATH by tests.commands.interrupt_while_importing, so
that a test can press Ctrl-C while the command loads, at a moment it knows instead of guesses.

With ROLLOUT_TEST_PAUSE_IMPORT=module and ROLLOUT_TEST_PAUSE_FDS=ready,wait in the environment,
the first import of that module stops before it is found: a byte is written to `ready`, then
`wait` is read until the test closes its end. A SIGINT there raises KeyboardInterrupt out of
the import, as one arriving a moment later in the module's own code would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class _PauseAt:
    def __init__(self, module: str, ready: int, wait: int) -> None:
        self.module = module
        self.ready = ready
        self.wait = wait

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        os.write(self.ready, b".")
        os.close(self.ready)
        while os.read(self.wait, 1):
            pass
        os.close(self.wait)
        return None  # the ordinary finders find it


def _install() -> None:
    module = os.environ.pop("ROLLOUT_TEST_PAUSE_IMPORT", None)
    fds = os.environ.pop("ROLLOUT_TEST_PAUSE_FDS", None)
    if module is None or fds is None:
        return
    ready, wait = (int(fd) for fd in fds.split(","))
    # Only this process pauses: a child it starts (a worker) inherits neither the fds nor the
    # variables.
    os.set_inheritable(ready, False)
    os.set_inheritable(wait, False)
    sys.meta_path.insert(0, _PauseAt(module, ready, wait))


_install()
