"""AccessControl: optional bearer-token authentication and TLS, set up alike on both servers."""

from __future__ import annotations

import os
import re
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
            token_env = variable_name(token_env, "--auth-token-env")
            token = header_secret(
                env.get(token_env, ""), f"the token in {token_env} (--auth-token-env)"
            )
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


_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def variable_name(value: str, flag: str) -> str:
    """value, checked to be an environment variable's name, as flag (`--api-key-env`) takes.

    The flags that name a secret's variable are easily given the secret itself
    (`--api-key-env sk-…`), and each message about the variable names it; what cannot be a
    name is therefore refused without being repeated. A name is shown: it is not a secret,
    and "OPENAI_API_KEY is unset" is what the user needs to read.
    """
    if not _VARIABLE_NAME.fullmatch(value):
        raise ValueError(f"{flag} takes the NAME of a variable, not its value")
    return value


def header_secret(value: str, what: str) -> str:
    """A secret as it can go into an `authorization` header: an API key, a bearer token.

    Surrounding white space (a newline from `$(cat keyfile)`) is dropped, as a client sending
    it drops it; any other character a header cannot carry is refused here, at start-up,
    naming its position and never the secret (the HTTP library's error would quote it).
    """
    secret = value.strip()
    for position, char in enumerate(secret, start=1):
        if not ("!" <= char <= "~"):
            raise ValueError(
                f"{what} has a character an HTTP header cannot carry "
                f"(character {position} of {len(secret)}: {_char_name(char)})"
            )
    return secret


def _char_name(char: str) -> str:
    if char == " ":
        return "a space"
    if char.isprintable():
        return f"U+{ord(char):04X}, not ASCII"
    return f"control character U+{ord(char):04X}"


def _read_file(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror or error}") from error
