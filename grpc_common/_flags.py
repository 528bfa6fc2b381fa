"""The flags every server takes, declared once: `--auth-token-env`, `--tls-cert`, `--tls-key`
(what AccessControl.load reads) and `--event-loop`. Imports no gRPC: every command builds its
parser."""

from __future__ import annotations

import argparse

from ._loop import EVENT_LOOPS


def add_access_arguments(
    parser: argparse.ArgumentParser, guarded: str = "every RPC but health checks"
) -> None:
    """Add the access flags to a server command's parser (dests auth_token_env, tls_cert,
    tls_key); `guarded` says what the token is asked of."""
    parser.add_argument(
        "--auth-token-env",
        metavar="NAME",
        help=f"require `authorization: Bearer <token>` on {guarded}; "
        "the token is read from the environment variable NAME (default: no token)",
    )
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="serve TLS with this PEM certificate chain"
    )
    parser.add_argument("--tls-key", metavar="PEM", help="the PEM private key of --tls-cert")


def add_event_loop_argument(parser: argparse.ArgumentParser, env: str | None = None) -> None:
    """Add `--event-loop` (dest event_loop, None when not given); `env` names the environment
    variable the command also reads it from, for the help."""
    also = f"; env {env}" if env else ""
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help=f"the asyncio event loop to serve on (default uvloop where installed, else "
        f"asyncio{also})",
    )
