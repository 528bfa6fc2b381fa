"""redact_url and Redactor: every form a URL's credentials and a key may come back in."""

from __future__ import annotations

import base64

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


def test_adding_a_secret_keeps_the_rest() -> None:
    redactor = Redactor(["sk-KEY-1234"], url="http://host/v1?key=QUERYSECRET")
    with_client = redactor.adding(["CLIENTTOKEN"])
    assert with_client.text("sk-KEY-1234 QUERYSECRET CLIENTTOKEN") == "*** *** ***"
    assert redactor.text("CLIENTTOKEN") == "CLIENTTOKEN"
    assert redactor.adding([""]) is redactor
