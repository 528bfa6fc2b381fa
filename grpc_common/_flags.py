"""The access flags both servers take, declared once: `--auth-token-env`, `--tls-cert`,
`--tls-key` (what AccessControl.load reads). Imports no gRPC: every command builds its parser."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    parser.add_argument("--tls-cert", type=Path, metavar="PATH", help="PEM certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="PATH", help="PEM private key")
