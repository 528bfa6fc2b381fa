"""Comparing a secret a client sent with the expected one, whatever bytes the client sent."""

from __future__ import annotations

import hmac


def same_secret(given: str | bytes, expected: str) -> bool:
    """Whether given is expected, compared in constant time as bytes.

    `hmac.compare_digest` refuses text that is not ASCII (TypeError), and `str.encode()`
    refuses the lone surrogates that stand for the bytes of a header, cookie or query that
    were not UTF-8 (aiohttp decodes them with surrogateescape): either was an HTTP 500 for a
    client that sent such a token. "surrogatepass" encodes every string; the expected
    secret is ASCII (header_secret) or valid text, so a given string holding a surrogate
    encodes to other bytes and never matches.
    """
    given_bytes = given if isinstance(given, bytes) else given.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given_bytes, expected.encode("utf-8", "surrogatepass"))


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value (None for any other
    scheme); the scheme's case and the white space around the token do not matter."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
