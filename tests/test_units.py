"""gpumem.units: sizes and limits from text (the rules of ``--limit`` and ``CachingAllocator(limit=...)``)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError
from gpumem.units import GiB, KiB, MiB, TiB, format_bytes
from gpumem.validate import BYTE_UNITS, MAX_NBYTES, parse_limit, parse_nbytes

H200 = 150_109_880_320


@pytest.mark.parametrize("text, nbytes", [
    ("0", 0), ("4096", 4096), ("100B", 100), ("1KiB", KiB), ("8GiB", 8 * GiB), ("8 GiB", 8 * GiB),
    ("8gib", 8 * GiB), ("512MiB", 512 * MiB), ("512MB", 512 * 10**6), ("2TB", 2 * 10**12), ("1TiB", TiB),
    ("1.5GiB", 3 * GiB // 2), ("0.5KiB", 512), ("1e3KiB", 1000 * KiB), (" 7 ", 7), ("+5MiB", 5 * MiB),
])
def test_parse_nbytes(text, nbytes):
    assert parse_nbytes(text) == nbytes


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("-1", "negative"), ("1.5", "not a whole number of bytes"), ("0.3KiB", "not a whole number"),
    ("8G", "GB or GiB"), ("8k", "KB or KiB"), ("8 furlongs", "unknown unit"), ("inf", "finite"), ("NaN", "finite"),
    ("GiB", "cannot read"), ("1,000", "cannot read"), ("x" * 10_000, "too long"), ("1e30GiB", "more than"),
])
def test_parse_nbytes_refuses(text, words):
    with pytest.raises(InvalidArgumentError, match=words) as info:
        parse_nbytes(text)
    assert len(str(info.value)) < 400  # a long input is quoted by a short prefix only


def test_parse_nbytes_refuses_non_text():
    with pytest.raises(InvalidArgumentError, match="must be text"):
        parse_nbytes(8 * GiB)  # type: ignore[arg-type]


@pytest.mark.parametrize("value, nbytes", [
    # bytes
    (8 * GiB, 8 * GiB), (1, 1), ("8GiB", 8 * GiB), ("512MB", 512 * 10**6), ("536870912", 512 * MiB), ("1B", 1),
    # fractions of the device: a float, a decimal point, or a percentage
    (1.0, H200), (0.5, H200 // 2), ("1.0", H200), ("0.5", H200 // 2), (".5", H200 // 2), ("50%", H200 // 2),
    ("100%", H200), ("90%", H200 * 9 // 10), ("0.9", H200 * 9 // 10), ("12.5%", H200 // 8), ("1e-1", H200 // 10),
    (None, None),
])
def test_parse_limit(value, nbytes):
    assert parse_limit(value, H200) == nbytes


@pytest.mark.parametrize("value, words", [
    ("2.5", "fraction of the device"),  # the old CLI made this 2 bytes
    (2.5, "fraction of the device"), (8e9, "fraction of the device"),  # a float above 1 is not truncated to bytes
    ("1", "ambiguous"), ("inf", "finite"), (float("inf"), "finite"), (float("nan"), "finite"), ("nan", "finite"),
    ("0", "positive"), (0, "positive"), (-5, "positive"), ("-5", "negative"), (0.0, r"\(0, 1\]"),
    ("0%", "0%"), ("101%", "100%"), ("5GiB%", "percentage"), ("8G", "GB or GiB"), ("abc", "cannot read"),
    (True, "bool"), ([1], "list"), ("1e-30", "less than one byte"), (2**65, "more than"),
])
def test_parse_limit_refuses(value, words):
    with pytest.raises(InvalidArgumentError, match=words):
        parse_limit(value, H200)


@pytest.mark.parametrize("total", [0, -1, 1.5, None])
def test_parse_limit_needs_a_device_size(total):
    with pytest.raises(InvalidArgumentError, match="total_nbytes"):
        parse_limit("50%", total)  # type: ignore[arg-type]


@given(st.integers(min_value=2, max_value=MAX_NBYTES))
def test_whole_numbers_are_bytes(n):
    assert parse_limit(str(n), H200) == parse_limit(n, H200) == parse_nbytes(str(n)) == n


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(BYTE_UNITS)),
       st.sampled_from(["", " "]), st.booleans())
def test_units_scale_exactly(k, unit, space, upper):
    text = f"{k}{space}{unit.upper() if upper else unit}"
    assert parse_nbytes(text) == k * BYTE_UNITS[unit]


@given(st.integers(min_value=1, max_value=10**4), st.integers(min_value=1, max_value=2**50))
def test_percentages_and_fractions_agree(basis_points, total):
    """``p%``, the decimal ``p/100`` and the float agree, and are ``floor(fraction * total)``, never above total."""
    pct = Fraction(basis_points, 100)  # 0.01% .. 100%
    expected = math.floor(pct / 100 * total)
    pct_text = f"{basis_points // 100}.{basis_points % 100:02d}%"
    frac_text = f"{basis_points // 10_000}.{basis_points % 10_000:04d}"
    if expected < 1:
        for text in (pct_text, frac_text):
            with pytest.raises(InvalidArgumentError, match="less than one byte"):
                parse_limit(text, total)
        return
    assert parse_limit(pct_text, total) == parse_limit(frac_text, total) == expected <= total
    as_float = parse_limit(basis_points / 10_000, total)
    assert abs(as_float - expected) <= 1 + total * 1e-15  # a binary float is not the decimal it prints as


@given(st.integers(min_value=1, max_value=MAX_NBYTES))
@example(8320)   # 8.125 KiB, exactly halfway: Hypothesis once found it beyond the bound by a float's error
def test_format_bytes_round_trips_within_rounding(n):
    value, unit = format_bytes(n).split()
    back = parse_nbytes(f"{value}{unit}") if unit == "B" else None
    if back is not None:
        assert back == n
    else:
        # at most half the last digit; a value exactly halfway (8320 B is 8.125 KiB, printed 8.12) is off by
        # that half, and the product of floats may land a hair beyond it
        assert abs(float(value) * BYTE_UNITS[unit.lower()] - n) <= 0.005 * BYTE_UNITS[unit.lower()] * (1 + 1e-9)


@pytest.mark.parametrize("limit", [64 * MiB, 8 * GiB, 0.5, 1.0, 0.001])
def test_the_allocator_reads_limits_by_the_same_rules(limit):
    from gpumem import open_device
    from gpumem.allocator import CachingAllocator

    dev = open_device("sim:t4-16gb")
    try:
        alloc = CachingAllocator(dev, "gpumem", limit=limit)
        try:
            assert alloc.limit_nbytes == parse_limit(limit, dev.properties().total_nbytes)
        finally:
            alloc.close()
    finally:
        dev.close()
