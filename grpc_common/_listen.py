"""What every server says when the address it is told to listen on cannot be had: one line,
`cannot listen on HOST:PORT: address already in use`, and exit status 2 from its command.
Imports no gRPC: the gateway and the `--workers` supervisor use it too."""

from __future__ import annotations

import errno
import os
import socket


class ListenError(OSError):
    """An address a server was told to listen on cannot be bound (in use, not this machine's,
    a privileged port): the operator's to fix, as a bad flag is."""


def listen_error(listen: str, error: OSError, what: str = "listen on") -> ListenError:
    """`cannot WHAT LISTEN: REASON`, the reason the system's words for the error's number (not
    the library's message around it, nor gRPC's advice to turn on its debug log)."""
    if isinstance(error, ListenError):
        return error  # said already
    made = ListenError(f"cannot {what} {listen}: {_reason(error)}")
    made.errno = error.errno
    return made


def refuse_address_in_use(host: str, port: int, listen: str) -> None:
    """Raise ListenError when (host, port) is taken, found by binding a plain socket to each of
    its addresses as the servers bind theirs (SO_REUSEADDR: a port whose last connections
    linger in TIME_WAIT is free; no SO_REUSEPORT: one another process listens on is not). Done
    before gRPC's C core binds, which says only "Failed to bind" and logs its own lines.

    Also raised when no address of the host can be bound at all; anything less (one of
    localhost's two addresses missing, say) is left to the server's own bind. Port 0 is
    never taken."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as error:
        raise listen_error(listen, error) from None
    failures: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                if os.name != "nt":  # where SO_REUSEADDR would let it share a bound port
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise listen_error(listen, error) from None
            failures.append(error)
    if failures and len(failures) == len(addresses):
        raise listen_error(listen, failures[0]) from None


def _reason(error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return "address already in use"
    if error.errno and error.errno > 0 and not isinstance(error, socket.gaierror):
        text = os.strerror(error.errno)
    else:
        text = error.strerror or str(error) or type(error).__name__
    return text[:1].lower() + text[1:]
