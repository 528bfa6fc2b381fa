"""The open-file limit of a server process, raised at start to what the system allows it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

try:
    import resource
except ImportError:  # Windows: no such limit to raise
    resource = None  # type: ignore[assignment]

# Tried when the hard limit is unlimited, or refused (macOS refuses a soft limit above
# kern.maxfilesperproc, often 10240 or more, while reporting the hard one as unlimited).
_FALLBACKS = (1 << 20, 1 << 16, 10_240)


def raise_open_file_limit(
    setrlimit: Callable[[int, tuple[int, int]], None] | None = None,
) -> int | None:
    """Raise this process's soft limit on open files to its hard limit; return the limit now
    in force (None where there is none to read).

    Every open thread of the agent server, and every open gateway session, keeps its bundle's
    file open, beside its client's and its provider's connections. Most systems start a
    process with a soft limit of 1,024 under a hard limit hundreds of times that, and the soft
    one is the process's own to raise; left there, an evaluation holding a thousand rollouts
    open would see StartThread fail and its turns fail to connect to their provider, with
    "Too many open files". Go's runtime raises it the same way at start. Our servers use epoll
    (gRPC, asyncio, uvloop, aiohttp), so numbers past select()'s 1,024 are no trouble to them.

    setrlimit: resource.setrlimit unless a test hands in another.
    """
    if resource is None:
        return None
    set_limit = setrlimit or resource.setrlimit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = [hard] if hard != resource.RLIM_INFINITY else []
    wanted += [limit for limit in _FALLBACKS if hard == resource.RLIM_INFINITY or limit < hard]
    for limit in wanted:
        if limit <= soft:
            break
        with contextlib.suppress(ValueError, OSError):
            set_limit(resource.RLIMIT_NOFILE, (limit, hard))
            return limit
    return soft
