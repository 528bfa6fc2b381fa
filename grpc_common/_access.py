"""AccessControl: optional bearer-token authentication and TLS, set up alike on both servers."""

from __future__ import annotations

import binascii
import contextlib
import os
import re
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ._files import read_given_file
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
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
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
        for given, flag in ((tls_cert, "--tls-cert"), (tls_key, "--tls-key")):
            # `--tls-cert "$CERT"` with CERT unset: a slip, not the current directory.
            if given is not None and not os.fspath(given):
                raise ValueError(f"{flag} is empty: give a PEM file")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        cert = key = None
        if tls_cert is not None and tls_key is not None:
            cert_path, key_path = Path(tls_cert), Path(tls_key)
            cert = _read_file(cert_path, "--tls-cert")
            key = _read_file(key_path, "--tls-key")
            _check_pem(cert, key, cert_path, key_path)
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


_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END \1-----")


def _check_pem(cert: bytes, key: bytes, cert_path: Path, key_path: Path) -> None:
    """Refuse, naming the file, a certificate or key that is not PEM, or a key that is not the
    certificate's. gRPC would only find out when binding, with C-core log lines and "Failed to
    bind to address", a message about the port, not the file."""
    if not _pem_blocks(cert, lambda label: label == b"CERTIFICATE"):
        raise ValueError(f"--tls-cert: {cert_path} holds no PEM certificate")
    if not _pem_blocks(key, lambda label: label.endswith(b"PRIVATE KEY")):
        raise ValueError(f"--tls-key: {key_path} holds no PEM private key")
    # OpenSSL itself on what was read (not the paths again: a file may have changed, or be a
    # pipe), where the platform can give bytes a path without a file on disk.
    if not hasattr(os, "memfd_create"):
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with _memory_file(cert) as cert_file, _memory_file(key) as key_file:
        try:
            context.load_cert_chain(cert_file, key_file, password=_no_password)
        except ssl.SSLError as error:
            # OpenSSL's reason is a constant's name: KEY_VALUES_MISMATCH, PEM_LIB.
            reason = (error.reason or "").lower().replace("_", " ") or "OpenSSL cannot parse them"
            raise ValueError(f"{_UNUSABLE.format(cert_path, key_path)} ({reason})") from None
        except _EncryptedKeyError:
            raise ValueError(
                f"{_UNUSABLE.format(cert_path, key_path)} (the key is encrypted; gRPC takes "
                "only an unencrypted one)"
            ) from None


_UNUSABLE = "--tls-cert / --tls-key: {} and {} do not load as a certificate chain and its key"


class _EncryptedKeyError(Exception):
    pass


def _no_password() -> str:
    # Asked for an encrypted key's password: gRPC could not be given one either, and OpenSSL
    # would otherwise prompt on the terminal.
    raise _EncryptedKeyError


def _pem_blocks(data: bytes, wanted: Callable[[bytes], bool]) -> bool:
    """Whether data holds a PEM block wanted by its label whose body is base64."""
    for block in _PEM_BLOCK.finditer(data):
        if wanted(block.group(1)):
            try:
                binascii.a2b_base64(block.group(2))
            except binascii.Error:
                continue
            return True
    return False


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    fd = os.memfd_create("tls-pem", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


# A PEM chain or key is a few KiB; a path such as /dev/zero is no certificate.
_MAX_PEM_BYTES = 16 << 20


def _read_file(path: Path, flag: str) -> bytes:
    # A FIFO, a directory or a device is said to be one (a FIFO was waited on for ever).
    data = read_given_file(path, flag, limit=_MAX_PEM_BYTES)
    if len(data) > _MAX_PEM_BYTES:
        raise ValueError(f"{flag}: {path} is larger than {_MAX_PEM_BYTES >> 20} MiB: not PEM")
    return data
