"""Secrets: comparing one a client sent with the expected one, whatever bytes it sent; and
taking secrets out of URLs, messages and data before they are shown, logged or recorded."""

from __future__ import annotations

import base64
import hmac
import re
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import overload


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


# A query parameter whose value authenticates (`?key=`, `?api-key=`, `?sig=`, `?token=`):
# taken out of forwarded data too, where a value like `api-version=2024-02-01` is left alone.
_SECRET_PARAMETER = re.compile(r"key|token|secret|sig|auth|pass|code|credential", re.IGNORECASE)
# Secrets and URL parts shorter than this are left in free text: `?v=1` must not blank every
# `1`; and in data (a stream, a body) under the second: a key `x` must not blank every `x`.
_MIN_TEXT_FORM = 4
_MIN_DATA_FORM = 8
_HIDDEN = "***"
_HIDDEN_BYTES = _HIDDEN.encode()


def redact_url(url: str) -> str:
    """url as it may be recorded or logged: no user info, every query value (and a bare query
    token) replaced by `...`; a port that does not parse is left out."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    query = "&".join(
        f"{name}=..." if sep else "..."
        for name, sep, _ in (piece.partition("=") for piece in parts.query.split("&") if piece)
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class Redactor:
    """Takes every form in which secrets may come back out of text and data.

    The secrets: keys and tokens given as such, and what a URL carries — its password (or a
    user name standing alone, `https://TOKEN@host`), the Basic Authorization value they make,
    its query values — each as written in the URL, decoded, and decoded as a form. A server
    that echoes a request back (an error quoting the Authorization header, a redirect) may
    return any of them.

    `text` is for messages (errors, logs): every form of four characters or more. `data` is
    for bytes passed on or recorded as they came: only the forms that authenticate (the keys,
    the password, the Basic value, values of query parameters named like a key), of eight
    characters or more, so that a stream quoting `2024-02-01` is not altered. A key or token
    given as such is held to the same lengths: a placeholder such as `x` or vLLM's `EMPTY`
    (what clients of a server that wants no key send) is no secret, and taking every `x` out
    of a stream left its events unreadable (`response.output_te***t.delta`).
    """

    def __init__(
        self, secrets: Iterable[str] = (), url: str | None = None, spellings: Iterable[str] = ()
    ) -> None:
        """secrets: given as such; url: the URL whose credentials are secrets, shown as
        redact_url shows it; spellings: the same URL as an HTTP client sends it (a client
        that normalises the percent-encoding sends forms the URL as given does not hold)."""
        given = {secret for secret in secrets if secret}
        self._given = frozenset(given)
        self._spellings = tuple(spellings)
        text_forms = {secret for secret in given if len(secret) >= _MIN_TEXT_FORM}
        data_forms = {secret for secret in given if len(secret) >= _MIN_DATA_FORM}
        self._url = url
        self._display = redact_url(url) if url else None
        for spelling in (url, *self._spellings) if url else ():
            strong, weak = _url_forms(spelling)
            text_forms |= {form for form in strong | weak if len(form) >= _MIN_TEXT_FORM}
            data_forms |= {form for form in strong if len(form) >= _MIN_DATA_FORM}
        # Longest first: a secret that holds another is taken out whole.
        self._text = sorted(text_forms, key=len, reverse=True)
        self._data = sorted(data_forms, key=len, reverse=True)
        self._data_bytes = [form.encode() for form in self._data]

    def adding(self, secrets: Iterable[str]) -> Redactor:
        """This redactor with more secrets (a client's own token, passed on for one call)."""
        more = {secret for secret in secrets if secret} - self._given
        if not more:
            return self
        return Redactor([*self._given, *more], url=self._url, spellings=self._spellings)

    def __bool__(self) -> bool:
        return bool(self._text) or self._url != self._display

    def text(self, text: str) -> str:
        """text with the URL shown redacted and every secret as `***`."""
        if self._url and self._display is not None and self._url in text:
            text = text.replace(self._url, self._display)
        for form in self._text:
            if form in text:
                text = text.replace(form, _HIDDEN)
        return text

    @overload
    def data(self, data: bytes) -> bytes: ...

    @overload
    def data(self, data: str) -> str: ...

    def data(self, data: bytes | str) -> bytes | str:
        """data with every authenticating secret as `***` (the same object when none is in
        it: a check per secret, cheap enough for every chunk of a stream)."""
        if isinstance(data, bytes):
            for form in self._data_bytes:
                if form in data:
                    data = data.replace(form, _HIDDEN_BYTES)
            return data
        for text_form in self._data:
            if text_form in data:
                data = data.replace(text_form, _HIDDEN)
        return data

    def stream(self) -> StreamRedactor:
        """A StreamRedactor of this redactor's data forms, for one stream of chunks."""
        return StreamRedactor(self)

    async def chunks(self, source: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """source's chunks (a network read each) through one StreamRedactor, its held tail
        last: what a forwarded or recorded stream is passed through, so that a secret an
        upstream echoes across two reads is taken out too. Empty pieces are not yielded."""
        stream = self.stream()
        async for chunk in source:
            piece = stream.feed(chunk)
            if piece:
                yield piece
        tail = stream.flush()
        if tail:
            yield tail


class StreamRedactor:
    """Redactor.data over a stream that arrives in chunks.

    `data` applied per network read misses a secret that one read ends in and the next goes
    on with: neither half matches, and the secret passes whole. This holds back only the tail
    that could still become one — the longest suffix of what came that is a proper prefix of
    some data form, so under the longest form's length — and returns every other byte at
    once: a chunk that ends otherwise (an SSE event's `\n\n`) goes out whole, without waiting
    for the next read.

    Guaranteed: what feed and flush return, joined, equals `data` of the whole stream, however
    it is cut, as long as no occurrence of one form in it partly overlaps an occurrence of
    another (one form inside another is taken out whole, as `data` takes it; forms holding
    `*` are not supposed to be there). Whatever the overlaps, every byte passes `data`, and no
    complete occurrence is split between two returned pieces.
    """

    __slots__ = ("_forms", "_held", "_redactor")

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._forms = redactor._data_bytes
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of chunk (after what was held) can be passed on now, redacted; chunk itself
        when there is no secret, and none begins in its tail or in it."""
        if not self._forms:
            return chunk
        data = self._held + chunk if self._held else chunk
        cut = self._cut(data)
        self._held = data[cut:]
        return self._redactor.data(data if cut == len(data) else data[:cut])

    def flush(self) -> bytes:
        """What was held, redacted: at the stream's end, where it can no longer grow into a
        secret."""
        held, self._held = self._held, b""
        return self._redactor.data(held) if held else held

    def _cut(self, data: bytes) -> int:
        """Where what is passed on ends: before the longest tail that may become a form, and
        never inside a whole form (which a tail of another may overlap)."""
        cut = self._tail(data, 0)
        while cut < len(data):
            end = self._across(data, cut)
            if end is None:
                break
            cut = self._tail(data, end)
        return cut

    def _tail(self, data: bytes, start: int) -> int:
        """The start of data's longest suffix from start on that is a proper prefix of some
        form (len(data) for none). Only the places of a form's first byte within its length
        of the end are looked at: a few `find`s a chunk for the usual one without them."""
        size = len(data)
        cut = size
        for form in self._forms:
            first = form[0]
            at = data.find(first, max(start, size - len(form) + 1), cut)
            while at != -1:
                if form.startswith(data[at:]):
                    cut = at
                    break
                at = data.find(first, at + 1, cut)
        return cut

    def _across(self, data: bytes, cut: int) -> int | None:
        """The furthest end of a whole form in data that begins before cut and ends after it."""
        end = None
        for form in self._forms:
            at = data.find(form, max(0, cut - len(form) + 1), cut + len(form) - 1)
            if -1 < at < cut:
                end = max(end or 0, at + len(form))
        return end


def _url_forms(url: str) -> tuple[set[str], set[str]]:
    """What a URL carries that a reply may echo: (the authenticating forms, the rest)."""
    parts = urllib.parse.urlsplit(url)
    strong: set[str] = set()
    weak: set[str] = set()
    if "@" in parts.netloc:
        user, has_password, password = parts.netloc.rpartition("@")[0].partition(":")
        # With a password the user name is an account's name, often a plain word ("admin");
        # alone it is the token.
        for raw in (password,) if has_password else (user,):
            strong |= _decodings(raw)
        plain = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        try:
            encoded = plain.encode("latin-1")
        except UnicodeEncodeError:
            encoded = plain.encode()
        strong.add(base64.b64encode(encoded).decode())
    for piece in parts.query.split("&"):
        name, sep, value = piece.partition("=")
        if not sep:
            strong |= _decodings(name)
        elif _SECRET_PARAMETER.search(name):
            strong |= _decodings(value)
        else:
            weak |= _decodings(value)
    strong.discard("")
    weak.discard("")
    return strong, weak - strong


def _decodings(raw: str) -> set[str]:
    """raw as written in a URL, percent-decoded, and decoded as a form (`+` a space)."""
    return {raw, urllib.parse.unquote(raw), urllib.parse.unquote_plus(raw)}
