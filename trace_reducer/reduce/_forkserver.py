"""Imported by the pool's forkserver as it starts (its preload), for what it does there: SIGTERM
blocked in the forkserver, and so in every worker it forks, from birth.

A SIGTERM sent to every process of a service (a service manager stopping it) killed the
forkserver, and the pool, which hears of its workers' ends through the forkserver, took every
worker for dead and killed them mid-bundle. Blocked, the signal waits: the forkserver never
takes it, and a worker takes it once it can tell who sent it (reduce/_pool.py's
_take_sigterm_from), a SIGTERM from its driver sent while it was still starting included.
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
