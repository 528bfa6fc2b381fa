"""AccessControl: optional bearer-token authentication and TLS, set up alike on both servers."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ._handlers import BearerTokenInterceptor


@dataclass(frozen=True)
class AccessControl:
    """Who may call a server, and over what: off (plaintext, no token) unless configured."""

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def load(
        cls,
        *,
        token_env: str | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> AccessControl:
        """Read the token from the variable named token_env, and the TLS certificate and key.

        Raises ValueError with a message fit for the user (naming the flag it came from); never
        one that shows the token.
        """
        env = os.environ if environ is None else environ
        token = None
        if token_env:
            token = env.get(token_env, "")
            if not token:
                raise ValueError(f"--auth-token-env names {token_env}, which is unset or empty")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        cert = key = None
        if tls_cert is not None and tls_key is not None:
            cert = _read_file(tls_cert, "--tls-cert")
            key = _read_file(tls_key, "--tls-key")
        return cls(token=token, tls_cert=cert, tls_key=key)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor[Any, Any]]:
        return [BearerTokenInterceptor(self.token)] if self.token else []

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])


def _read_file(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror or error}") from error
