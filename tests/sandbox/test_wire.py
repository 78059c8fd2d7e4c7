"""The value format between the sandboxed child and the judge: round trips, and what it refuses."""

from __future__ import annotations

import math

import pytest

from stages.sandbox._runner import ValueFormatError, decode_value, encode_value


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(10**5000),  # beyond Python's 4300-digit str() limit: ints travel as hex
        1.5,
        -0.0,
        float("inf"),
        1 + 2j,
        "",
        "héllo \ud800",  # a lone surrogate survives
        b"\x00\xff",
        [1, [2, (3, "x")]],
        (),
        {"a": 1, (1, 2): [3], 4: None},
        {1, 2, 3},
        frozenset({"a"}),
    ],
    ids=lambda value: type(value).__name__,
)
def test_round_trip_keeps_value_and_exact_type(value: object):
    decoded = decode_value(encode_value(value))
    assert decoded == value
    assert type(decoded) is type(value)


def test_nan_round_trips():
    assert math.isnan(decode_value(encode_value(float("nan"))))


def test_bool_and_int_stay_distinct():
    assert decode_value(encode_value([True, 1])) == [True, 1]
    assert [type(x) for x in decode_value(encode_value([True, 1]))] == [bool, int]


def test_subclasses_and_objects_are_refused():
    class AlwaysEqual(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    for value in (AlwaysEqual(1), object(), [1, object()], {"k": lambda: 0}, iter([1])):
        with pytest.raises(ValueFormatError):
            encode_value(value)


def test_depth_limit_on_both_sides():
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(ValueFormatError):
        encode_value(deep)
    crafted = b"l\x00\x00\x00\x01" * 150 + b"N"
    with pytest.raises(ValueFormatError):
        decode_value(crafted)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"Q",  # unknown tag
        b"s\x00\x00\x00\x05ab",  # truncated string
        b"l\xff\xff\xff\xffN",  # count larger than the data
        b"NN",  # trailing bytes
        b"S\x00\x00\x00\x01l\x00\x00\x00\x00",  # an unhashable set member
        b"i\x00\x00\x00\x02zz",  # not hex
    ],
)
def test_malformed_bytes_raise_value_format_error(data: bytes):
    with pytest.raises(ValueFormatError):
        decode_value(data)
