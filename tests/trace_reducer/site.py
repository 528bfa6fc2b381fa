"""The served viewer for a test: a SiteServer on a loopback port and a client for it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx

from trace_reducer.view._site import SiteServer


@contextlib.asynccontextmanager
async def served_site(
    root: Path, *, warn: Callable[[str], None] = lambda _: None
) -> AsyncIterator[httpx.AsyncClient]:
    """`view ROOT` served on 127.0.0.1:0 without a token, and a client of its address."""
    server = SiteServer(str(root), None, warn=warn)
    address = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=address) as http:
            yield http
    finally:
        await server.stop()
