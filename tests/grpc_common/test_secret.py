"""redact_url and Redactor: every form a URL's credentials and a key may come back in."""

from __future__ import annotations

import base64
import random
from collections.abc import AsyncIterator
from itertools import pairwise

import pytest

from grpc_common import Redactor, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://u:pw@host:8/v1?key=K&v=2", "http://host:8/v1?key=...&v=..."),
        ("http://TOKEN@host/v1", "http://host/v1"),
        ("http://host/v1?BARETOKEN", "http://host/v1?..."),
        ("http://host/v1?a=1&&BARE", "http://host/v1?a=...&..."),
        ("http://[::1]:9/v1", "http://[::1]:9/v1"),
    ],
)
def test_redact_url_keeps_neither_user_info_nor_query_values(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_every_spelling_of_a_url_secret_is_taken_out_of_text() -> None:
    redactor = Redactor(
        ["sk-KEY-1234"],
        url="http://alice:p%40ss%2Fword@host/v1?api-key=Q%2B1%2Fx&version=2024-02-01&BARETOKEN",
        spellings=["http://alice:p%40ss%2Fword@host/v1?api-key=Q%2B1/x&version=2024-02-01"],
    )
    basic = base64.b64encode(b"alice:p@ss/word").decode()
    echoes = [
        "sk-KEY-1234",
        "p%40ss%2Fword",
        "p@ss/word",
        basic,
        "Q%2B1%2Fx",
        "Q%2B1/x",
        "Q+1/x",
        "BARETOKEN",
        "2024-02-01",
    ]
    for echo in echoes:
        assert redactor.text(f"error: {echo}!") == "error: ***!", echo
    # The whole URL is shown as redact_url shows it.
    url = "http://alice:p%40ss%2Fword@host/v1?api-key=Q%2B1%2Fx&version=2024-02-01&BARETOKEN"
    assert redactor.text(f"at {url}") == "at http://host/v1?api-key=...&version=...&..."


def test_data_loses_only_what_authenticates() -> None:
    redactor = Redactor(["sk-KEY-1234"], url="http://host/v1?version=2024-02-01&sig=SIGNATURE1")
    data = b'{"text": "as of 2024-02-01", "echo": "sk-KEY-1234 SIGNATURE1"}'
    assert redactor.data(data) == b'{"text": "as of 2024-02-01", "echo": "*** ***"}'
    assert redactor.data(data.decode()) == redactor.data(data).decode()
    clean = b'{"text": "nothing secret"}'
    assert redactor.data(clean) is clean


def test_a_user_name_beside_a_password_is_not_a_secret() -> None:
    redactor = Redactor(url="http://admin:LONGPASSWORD@host/v1")
    assert redactor.text("admin said LONGPASSWORD") == "admin said ***"
    alone = Redactor(url="http://LONGUSERTOKEN@host/v1")
    assert alone.text("token LONGUSERTOKEN") == "token ***"


def test_short_url_parts_are_left_in_free_text() -> None:
    redactor = Redactor(url="http://host/v1?v=1&pw=abc")
    assert redactor.text("v1 of 1 abc") == "v1 of 1 abc"


def test_a_short_key_is_no_secret_to_data_nor_under_four_characters_to_text() -> None:
    # A placeholder a client sends to a server that wants no key (`x`, vLLM's `EMPTY`):
    # taking it out of data blanked every `x` of a stream (`response.output_te***t.delta`).
    redactor = Redactor(["x", "EMPTY", "LONGER-KEY"]).adding(["abc1234"])
    data = b'{"type": "response.output_text.delta", "delta": "EMPTY abc1234 LONGER-KEY"}'
    assert redactor.data(data) == data.replace(b"LONGER-KEY", b"***")
    assert redactor.text("max_tokens: EMPTY abc1234 LONGER-KEY") == "max_tokens: *** *** ***"
    assert _streamed(redactor, data, [7, 30]) == redactor.data(data)


def test_adding_a_secret_keeps_the_rest() -> None:
    redactor = Redactor(["sk-KEY-1234"], url="http://host/v1?key=QUERYSECRET")
    with_client = redactor.adding(["CLIENTTOKEN"])
    assert with_client.text("sk-KEY-1234 QUERYSECRET CLIENTTOKEN") == "*** *** ***"
    assert redactor.text("CLIENTTOKEN") == "CLIENTTOKEN"
    assert redactor.adding([""]) is redactor


# -- a stream of chunks ------------------------------------------------------------------------

_STREAM_REDACTOR = Redactor(
    ["sk-KEY-1234", "my-sk-KEY-1234-too"],
    url="http://alice:PASSWORD9@host/v1?sig=SIGNATURE1&version=2024-02-01",
)
# Several secrets, one beside another, one inside a longer one, starts that come to nothing.
_STREAM = (
    b'data: {"message": "bad key: Bearer sk-KEY-1234", "auth": "Basic '
    + base64.b64encode(b"alice:PASSWORD9")
    + b'"}\n\nevent: error\ndata: sk-KEY sk-KEY-1234SIGNATURE1 my-sk-KEY-1234-too 2024-02-01'
    + b" PASSWORD PASSWORD9 SIGNATURE\n\n"
)


def _streamed(redactor: Redactor, stream: bytes, cuts: list[int]) -> bytes:
    redacting = redactor.stream()
    bounds = [0, *cuts, len(stream)]
    pieces = [redacting.feed(stream[a:b]) for a, b in pairwise(bounds)]
    return b"".join([*pieces, redacting.flush()])


def test_a_stream_cut_anywhere_is_redacted_as_a_whole() -> None:
    whole = _STREAM_REDACTOR.data(_STREAM)
    assert b"KEY-1234" not in whole
    assert b"PASSWORD9" not in whole
    assert b"SIGNATURE1" not in whole
    for cut in range(len(_STREAM) + 1):
        assert _streamed(_STREAM_REDACTOR, _STREAM, [cut]) == whole, cut


def test_a_stream_cut_many_times_is_redacted_as_a_whole() -> None:
    whole = _STREAM_REDACTOR.data(_STREAM)
    rng = random.Random(7)
    for _ in range(500):
        cuts = sorted(rng.sample(range(len(_STREAM) + 1), rng.randint(2, 40)))
        assert _streamed(_STREAM_REDACTOR, _STREAM, cuts) == whole, cuts
    # A byte a read.
    assert _streamed(_STREAM_REDACTOR, _STREAM, list(range(len(_STREAM) + 1))) == whole


def test_only_a_tail_that_may_become_a_secret_is_held() -> None:
    redacting = _STREAM_REDACTOR.stream()
    event = b'data: {"text": "sk-KEY-1234 SIGNATURE1 sk-KEY"}\n\n'
    assert redacting.feed(event) == b'data: {"text": "*** *** sk-KEY"}\n\n'
    clean = b'data: {"text": "nothing secret"}\n\n'
    assert redacting.feed(clean) is clean
    assert redacting.feed(b"data: Bearer sk-KE") == b"data: Bearer "
    assert redacting.feed(b"Y-12") == b""
    assert redacting.feed(b"34 and SIGNAT") == b"*** and "
    assert redacting.flush() == b"SIGNAT"
    assert redacting.flush() == b""
    assert redacting.feed(clean) is clean


def test_a_stream_without_secrets_is_passed_on_as_it_came() -> None:
    redacting = Redactor().stream()
    for chunk in (b"data: sk-", b"KEY-1234\n\n", b""):
        assert redacting.feed(chunk) is chunk
    assert redacting.flush() == b""


async def test_chunks_passes_a_stream_on_redacted_and_its_held_tail_last() -> None:
    async def reads() -> AsyncIterator[bytes]:
        for chunk in (b"a sk-KEY-", b"1234 b", b"", b" sk-KEY-12"):
            yield chunk

    got = [chunk async for chunk in _STREAM_REDACTOR.chunks(reads())]
    assert got == [b"a ", b"*** b", b" ", b"sk-KEY-12"]
