"""Requests aiohttp's HTTP parser refuses, each carrying a secret, sent on raw sockets; and
the check that a server's log named the refusal without quoting the request."""

from __future__ import annotations

import asyncio
import logging

SECRET = "s3cret-token"
_S = SECRET.encode()

# Each is refused by the parser before any handler of ours runs.
MALFORMED_REQUESTS = {
    "del-in-token": b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + _S + b"\x7f\r\n\r\n",
    "nul-in-header": b"GET / HTTP/1.1\r\nHost: x\r\nCookie: t=" + _S + b"\x00\r\n\r\n",
    "control-in-query": b"GET /?token=" + _S + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
    "header-too-long": b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + _S + b"a" * 9000 + b"\r\n\r\n",
    "space-in-name": b"GET / HTTP/1.1\r\nHost: x\r\nX " + _S + b": 1\r\n\r\n",
    "bad-length": b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + _S + b"\r\n\r\n",
    "bad-chunk": b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + _S + b"\r\n",
}


async def status_line(port: int, request: bytes) -> bytes:
    """The status line the server at 127.0.0.1:port answers request with."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n")
    finally:
        writer.close()
    return head.rstrip(b"\r\n")


async def until_closed(port: int, head: bytes) -> bytes:
    """What the server at 127.0.0.1:port sends after `head` (a request never finished)
    until it closes the connection: b"" when it closes without a word."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


def refusals(records: list[logging.LogRecord]) -> list[str]:
    """The refusal lines among records; fails on a traceback or a line quoting the secret.
    asyncio's own records may carry a traceback of something else: a client an earlier test
    left open, collected now, logs there."""
    for record in records:
        line = record.getMessage()
        assert record.exc_info is None or record.name == "asyncio", (record.name, line)
        assert SECRET not in line, (record.name, line)
    return [
        f"{r.levelname} {r.getMessage()}"
        for r in records
        if r.getMessage().startswith("refused a malformed HTTP request")
    ]
