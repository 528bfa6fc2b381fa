"""The payloads' JSON encoding in C (_canonical.c) against json, its definition.

canonical_json takes the C way for the values payloads are made of and json for the rest; every
value must come out as json's bytes (payload ids are hashes of them, and a replay matches a
request by them), and the C way must not keep what it allocates.
"""

from __future__ import annotations

import gc
import json
import math
import random
import sys
import tracemalloc
from collections import OrderedDict
from typing import Any

import pytest

from trace_reducer.bundle import canonical_json, canonical_json_with_list
from trace_reducer.bundle._payloads import canonical_json_reference

try:
    from trace_reducer.bundle import _canonical
except ImportError:  # not built: test_the_c_way_is_built says so, the rest fail
    _canonical = None  # type: ignore[assignment]

# Texts json escapes, each its own way: quotes, backslash, the short escapes, other controls,
# DEL, non-ASCII in and past the BMP, lone and paired surrogates, the line separators.
_TEXTS = [
    "",
    "plain words",
    'a "quoted" \\ back',
    "\b\f\n\r\t",
    "\x00\x01\x1f",
    "\x7f",
    "~ ",
    "é日本",
    "\U0001f600",
    "\ud800",
    "\udfff x \ud83d",
    "\u2028\u2029",
    "\uffff\U0010ffff",
]
_FLOATS = [
    0.0,
    -0.0,
    0.1,
    1.5,
    100.0,
    1e16,
    1e-05,
    1.2345678901234568e17,
    5e-324,
    sys.float_info.max,
    math.nan,
    math.inf,
    -math.inf,
]
_INTS = [0, -1, 7, 2**63, -(2**64) - 1, 10**40]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_TEXTS)
    # Random code points over the whole range, surrogates included.
    return "".join(
        chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0, 0x10FFFF)]))
        for _ in range(rng.randint(0, 8))
    )


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            _text(rng),
            rng.choice(_INTS),
            rng.randint(-(10**6), 10**6),
            rng.choice(_FLOATS),
            rng.uniform(-1e20, 1e20) * 10 ** rng.randint(-30, 30),
            rng.choice([True, False, None]),
        ]
    )


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 4 or roll < 0.5:
        return _scalar(rng)
    if roll < 0.65:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.7:
        return tuple(_value(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def test_the_c_way_is_built() -> None:
    # The suite runs where setup.py built the extension; without it nothing below is tested.
    assert _canonical is not None


def test_random_values_come_out_as_json_writes_them() -> None:
    rng = random.Random(20261207)
    for _ in range(6_000):
        value = _value(rng)
        encoded = _canonical.encode(value)
        assert encoded == canonical_json_reference(value), value
        assert canonical_json(value) == encoded


@pytest.mark.parametrize("text", _TEXTS)
def test_each_escape_as_json_writes_it(text: str) -> None:
    value = {text: [text, {"k": text}]}
    assert _canonical.encode(value) == canonical_json_reference(value)


@pytest.mark.parametrize("number", [*_FLOATS, *_INTS, True, False])
def test_each_number_as_json_writes_it(number: float) -> None:
    assert _canonical.encode([number]) == canonical_json_reference([number])


def test_keys_sort_by_code_point() -> None:
    value = {"b": 1, "a": 2, "B": 3, "é": 4, "\U0001f600": 5, "\uffff": 6, "": 7, "aa": 8}
    assert _canonical.encode(value) == canonical_json_reference(value)
    assert _canonical.encode(value) == canonical_json_reference(dict(sorted(value.items())))


def test_large_dicts_sort_as_small_ones_do() -> None:
    rng = random.Random(3)
    for size in (15, 16, 17, 40, 300):
        value = {_text(rng) + str(index): _scalar(rng) for index in range(size)}
        assert _canonical.encode(value) == canonical_json_reference(value)


class _Text(str):
    pass


class _Number(int):
    def __repr__(self) -> str:
        return "not a number"


class _Dict(dict[str, Any]):
    pass


@pytest.mark.parametrize(
    "value",
    [
        {1: "a"},  # json turns the key into text after sorting
        {"a": 1, None: 2},
        [_Text("x")],
        [_Number(3)],
        {"a": _Dict(b=1)},
        OrderedDict(b=1, a=2),
        [object()],
        [b"bytes"],
        {"set": {1, 2}},
    ],
    ids=repr,
)
def test_what_is_not_a_payload_value_goes_to_json(value: Any) -> None:
    assert _canonical.encode(value) is None
    try:
        expected: bytes | type[Exception] = canonical_json_reference(value)
    except (TypeError, ValueError) as error:
        expected = type(error)
    if isinstance(expected, bytes):
        assert canonical_json(value) == expected
    else:
        with pytest.raises(expected):
            canonical_json(value)


def test_deep_and_circular_values_go_to_json() -> None:
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    assert _canonical.encode(deep) is None
    assert canonical_json(deep) == canonical_json_reference(deep)
    shallow: Any = "x"
    for _ in range(150):
        shallow = {"k": shallow}
    assert _canonical.encode(shallow) == canonical_json_reference(shallow)
    circular: list[Any] = []
    circular.append(circular)
    assert _canonical.encode(circular) is None
    with pytest.raises(ValueError, match="Circular"):
        canonical_json(circular)


def test_an_int_too_long_for_text_fails_as_json_does() -> None:
    huge = 10 ** (sys.get_int_max_str_digits() + 1)
    with pytest.raises(ValueError, match="integer string conversion"):
        canonical_json_reference([huge])
    with pytest.raises(ValueError, match="integer string conversion"):
        _canonical.encode([huge])


def test_a_payload_decoded_and_encoded_again_is_the_same_bytes() -> None:
    rng = random.Random(7)
    for _ in range(2_000):
        value = _value(rng)
        encoded = canonical_json(value)
        assert canonical_json(json.loads(encoded)) == encoded


def test_the_c_way_keeps_nothing_it_allocates() -> None:
    rng = random.Random(11)
    values = [_value(rng) for _ in range(200)] + [{1: 2}, [object()]]
    for value in values:
        _canonical.encode(value)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(100):
            for value in values:
                _canonical.encode(value)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    # 20,200 encodings: a leak of one small object each would be ~1 MB.
    assert grown < 64 * 1024


def test_a_list_joined_from_its_items_encodings_is_the_whole_encoded() -> None:
    rng = random.Random(5)
    for _ in range(500):
        obj = {_text(rng): _value(rng) for _ in range(rng.randint(0, 6))}
        key = _text(rng) + "!"
        obj.pop(key, None)
        items = [_value(rng) for _ in range(rng.randint(0, 5))]
        encoded = [canonical_json(item) for item in items]
        assert canonical_json_with_list(obj, key, encoded) == canonical_json({**obj, key: items})
