"""Argument checks shared by every entry point: sizes, pointers, streams, alignments, indices, ranges.

One rule everywhere (issue 21, step 3): an integer argument is any integer type (``int``, an ``int``
subclass, ``np.int64``...: what :func:`operator.index` accepts) and is returned as a plain ``int``;
``bool`` is refused (``True`` is no size, pointer or stream); anything else raises
:class:`~gpumem.errors.InvalidArgumentError` naming the argument, the range it must lie in and the
value given. Every checker returns the value to use, so a caller writes ``nbytes = check_nbytes(nbytes)``.

>>> check_stream(7), check_nbytes(4096), check_alignment(256)
(7, 4096, 256)
>>> check_stream(2**64 + 1)
Traceback (most recent call last):
...
gpumem.errors.InvalidArgumentError: stream must be an int in [0, 2**64), got 18446744073709551617

Note [Checks on hot paths]: the checks cost a Python call, which the native engine's hot path (an
allocation served from the cache, in C) avoids with an inline guard that lets only the common good case
through (an exact int in range), so that a bad or unusual argument still goes through the one check here
(:mod:`gpumem.allocator.native` calls these for it). The Python engine, the readable reference, simply
calls them.
"""

from __future__ import annotations

import math
import numbers
import operator
import re as _re
from fractions import Fraction as _Fraction
from numbers import Integral as _Integral
from numbers import Real as _Real
from types import MappingProxyType as _MappingProxyType
from typing import Mapping as _Mapping

from .errors import InvalidArgumentError
from .units import GiB, KiB, MiB, TiB

__all__ = ["STREAM_END", "MAX_ALIGNMENT", "as_int", "check_int_in_range", "check_real_in_range", "check_nbytes",
           "check_pointer", "check_stream", "check_alignment", "check_index", "check_duration", "BYTE_UNITS", "MAX_NBYTES", "parse_nbytes",
           "parse_limit"]

STREAM_END = 1 << 64
"""Streams are ``cudaStream_t`` handles: ints in [0, 2**64) (0 is the default stream)."""
MAX_ALIGNMENT = 1 << 30
"""The largest alignment accepted (1 GiB): larger ones are certainly a mistake."""


def _bound(value: float) -> str:
    """``value`` for a message: powers of two as ``2**k`` (2**64 reads better than 18446744073709551616)."""
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return repr(value) if isinstance(value, float) else str(value)


def range_text(lo: float, hi: float | None, *, hi_open: bool = False) -> str:
    """``[lo, hi]``, ``[lo, hi)`` (``hi_open``, or ``hi + 1`` a power of two: ``[0, 2**63)``) or ``>= lo``."""
    if hi is None:
        return f">= {_bound(lo)}"
    if not hi_open and isinstance(hi, int) and hi >= 1 << 16 and (hi + 1) & hi == 0:
        hi, hi_open = hi + 1, True
    return f"[{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"


def as_int(value: object, what: str) -> int:
    """``value`` as a plain ``int`` (any integer type, through :func:`operator.index`); a ``bool``, a non-integer,
    or an ``__index__`` that raises raises :class:`InvalidArgumentError` naming ``what``."""
    if type(value) is int:   # type(), not __class__, which an object may fake (attacker 45, F4)
        return value  # type: ignore[return-value]
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got bool {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):   # an __index__ may raise anything: a bad value, not a crash
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__} {value!r:.60}") from None
    return int(n)


def check_int_in_range(value: object, what: str, lo: int, hi: int | None = None) -> int:
    """An integer in ``[lo, hi]`` (``hi=None``: no upper bound) as a plain ``int``."""
    n = as_int(value, what)
    if n < lo or (hi is not None and n > hi):
        raise InvalidArgumentError(f"{what} must be an int in {range_text(lo, hi)}, got {n}")
    return n


def check_real_in_range(value: object, what: str, lo: float, hi: float) -> float:
    """A finite real number (int or float, not bool) in ``[lo, hi]``, as a ``float``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a number in {range_text(lo, hi)}, got "
                                   f"{type(value).__name__} {value!r:.60}")
    try:
        x = float(value)
    except (OverflowError, ValueError):
        x = math.inf
    if not (math.isfinite(x) and lo <= x <= hi):
        raise InvalidArgumentError(f"{what} must be a finite number in {range_text(lo, hi)}, got {value!r:.60}")
    return x


def check_nbytes(nbytes: object, *, what: str = "nbytes", allow_zero: bool = False) -> int:
    """A size in bytes: an integer > 0 (>= 0 with ``allow_zero``). No upper bound: a request larger than
    any device is an out-of-memory error of the allocator, which says so, not a bad argument."""
    n = as_int(nbytes, what)
    if n < 0:
        raise InvalidArgumentError(f"{what} must not be negative, got {n}")
    if n == 0 and not allow_zero:
        raise InvalidArgumentError(f"{what} must be positive, got 0")
    return n


def check_pointer(ptr: object, *, what: str = "ptr") -> int:
    """A device address: an integer > 0 (whether anything lives there is the callee's question)."""
    p = as_int(ptr, what)
    if p <= 0:
        raise InvalidArgumentError(f"{what} must be a positive address, got {p}")
    return p


def check_stream(stream: object, *, what: str = "stream") -> int:
    """A stream handle: an integer in [0, 2**64) (a ``cudaStream_t``; 0 is the default stream). Any such
    int is accepted, not only streams from ``Device.stream_create``: foreign code passes its own."""
    s = as_int(stream, what)
    if not 0 <= s < STREAM_END:
        raise InvalidArgumentError(f"{what} must be an int in [0, 2**64), got {s}")
    return s


def check_alignment(alignment: object, *, what: str = "alignment", allow_zero: bool = False) -> int:
    """A power of two in [1, 1 GiB] (0 too with ``allow_zero``: "no constraint")."""
    a = as_int(alignment, what)
    if a == 0 and allow_zero:
        return 0
    if not 1 <= a <= MAX_ALIGNMENT or a & (a - 1):
        zero = "0 or " if allow_zero else ""
        raise InvalidArgumentError(f"{what} must be {zero}a power of two in [1, 2**30], got {a}")
    return a


def check_index(index: object, n: int, *, what: str = "index") -> int:
    """An index into ``n`` things: an integer in [0, n)."""
    i = as_int(index, what)
    if not 0 <= i < n:
        raise InvalidArgumentError(f"{what} must be an int in [0, {n}), got {i}")
    return i


def check_duration(value: object, *, what: str) -> float:
    """Return ``value`` as a float if it is a finite real number of seconds >= 0, else raise
    :class:`~gpumem.errors.InvalidArgumentError` (``bool``, text, NaN, infinities and ints too large for a
    float are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0, got {type(value).__name__} "
                                   f"{value!r}"[:200])
    try:
        seconds = float(value)
    except (OverflowError, ValueError, TypeError):
        raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0, got one too large "
                                   f"for a float") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


# -- parsing sizes and limits ------------------------------------------------------------------------------
#
# Note [Size and limit syntax]
# ----------------------------
# One set of rules for the command line (``--limit``) and the Python API (``CachingAllocator(limit=...)``):
#
# * bytes: a whole number (``536870912``), or a number with a unit (``8GiB``, ``512MiB``, ``1.5GiB``,
#   ``512MB``, ``64KiB``, ``100B``). Binary units KiB/MiB/GiB/TiB are powers of 1024, decimal units
#   KB/MB/GB/TB powers of 1000; units are case-insensitive and may follow a space. The result must be a
#   whole number of bytes (``1.5GiB`` is, ``0.3KiB`` is not). ``K``/``M``/``G``/``T`` alone are refused:
#   they could mean either.
# * a fraction of the device: a percentage (``90%``, ``12.5%``), or a number written with a decimal
#   point in (0, 1] (``0.9``, ``1.0``). A bare number with a decimal point or an exponent is always a
#   fraction, so ``2.5`` is refused rather than read as 2 bytes.
# * ``1`` alone is refused as ambiguous (write ``1.0`` or ``100%`` for the whole device, ``1B`` for one
#   byte); ``0``, negative numbers, ``inf``, ``nan`` and anything else are refused with a message saying
#   what is accepted.
# * from Python, an ``int`` is bytes and a ``float`` is a fraction in (0, 1] (a ``float`` above 1 is
#   refused, never truncated), a ``str`` follows the rules above.
#
# A fraction becomes ``floor(fraction * total)`` bytes, computed exactly (rational arithmetic), and must
# come to at least one byte. Sizes above 2**64 bytes are refused.

#: Unit suffixes accepted by :func:`parse_nbytes` (lower case) and their size in bytes (read-only).
BYTE_UNITS: _Mapping[str, int] = _MappingProxyType({
    "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
})
_AMBIGUOUS_UNITS: _Mapping[str, str] = _MappingProxyType(
    {"k": "KB or KiB", "m": "MB or MiB", "g": "GB or GiB", "t": "TB or TiB"})
_MAX_TEXT_CHARS = 64
#: The largest size :func:`parse_nbytes` and :func:`parse_limit` accept: 2**64 bytes, more than any address space.
MAX_NBYTES = 2**64
_NUMBER_UNIT = _re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]{1,4}))?\s*([A-Za-z]*)$")

_LIMIT_HELP = ("bytes (an integer, or with a unit: 8GiB, 512MiB, 512MB), a percentage of the device (90%) or a "
               "fraction of the device written with a decimal point, in (0, 1] (0.9, 1.0)")


def _invalid(message: str) -> Exception:
    return InvalidArgumentError(message)


def _quote(text: str) -> str:
    """``repr`` of at most a short prefix of ``text`` (error messages never echo long input whole)."""
    return repr(text) if len(text) <= _MAX_TEXT_CHARS else repr(text[:_MAX_TEXT_CHARS]) + "..."


def _split(text: str, what: str) -> tuple[_Fraction, str, bool]:
    """``(number, unit, has_point_or_exponent)`` of a size text, or raise with what ``what`` accepts."""
    if not isinstance(text, str):
        raise _invalid(f"{what} must be text, got {type(text).__name__}")
    s = text.strip()
    if len(s) > _MAX_TEXT_CHARS:
        raise _invalid(f"{what}: {_quote(s)} is too long")
    if not s:
        raise _invalid(f"{what} is empty")
    if s.startswith("-"):
        raise _invalid(f"{what}: {_quote(s)} is negative")
    m = _NUMBER_UNIT.match(s.lstrip("+"))
    if m is None:
        low = s.lower()
        if low.lstrip("+") in ("inf", "infinity", "nan"):
            raise _invalid(f"{what}: {_quote(s)} is not a finite number")
        raise _invalid(f"{what}: cannot read {_quote(s)}")
    digits, exponent, unit = m.groups()
    number = _Fraction(digits) * _Fraction(10) ** int(exponent or 0)  # exact, whatever the number of digits
    return number, unit.lower(), ("." in digits or exponent is not None)


def _unit_nbytes(number: _Fraction, unit: str, text: str, what: str) -> int:
    if unit in _AMBIGUOUS_UNITS:
        raise _invalid(f"{what}: the unit in {_quote(text.strip())} is ambiguous: write {_AMBIGUOUS_UNITS[unit]}")
    scale = BYTE_UNITS.get(unit)
    if scale is None:
        raise _invalid(f"{what}: unknown unit {_quote(unit)} in {_quote(text.strip())}; units are "
                       "B, KiB, MiB, GiB, TiB (powers of 1024) and KB, MB, GB, TB (powers of 1000)")
    nbytes = number * scale
    if nbytes.denominator != 1:
        raise _invalid(f"{what}: {_quote(text.strip())} is not a whole number of bytes")
    return _checked_nbytes(int(nbytes), text, what)


def _checked_nbytes(nbytes: int, text: str, what: str) -> int:
    if nbytes > MAX_NBYTES:
        raise _invalid(f"{what}: {_quote(text.strip())} is more than {MAX_NBYTES} bytes (16 EiB)")
    return nbytes


def parse_nbytes(text: str) -> int:
    """Bytes from a size text: ``"8GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"4096"``, ``"100B"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB)
    powers of 1000, case-insensitive; a number without a unit is bytes and must then be a
    whole number. Raises :class:`~gpumem.errors.InvalidArgumentError` for anything else
    (fractions of a byte, ``8G``, negative or non-finite numbers), naming the problem.

    >>> parse_nbytes("8GiB"), parse_nbytes("512MB"), parse_nbytes("1.5KiB")
    (8589934592, 512000000, 1536)
    """
    number, unit, has_point = _split(text, "size")
    if not unit:
        if has_point:
            raise _invalid(f"size: {_quote(text.strip())} is not a whole number of bytes; "
                           "write an integer or add a unit (B, KiB, MiB, GiB, KB, MB, GB...)")
        return _checked_nbytes(int(number), text, "size")
    return _unit_nbytes(number, unit, text, "size")


def _fraction_nbytes(fraction: _Fraction, total_nbytes: int, shown: str) -> int:
    nbytes = math.floor(fraction * total_nbytes)
    if nbytes < 1:
        raise _invalid(f"limit {shown} of a {total_nbytes}-byte device is less than one byte")
    return nbytes


def parse_limit(value: "int | float | str | None", total_nbytes: int) -> "int | None":
    """The byte limit that ``value`` stands for on a device of ``total_nbytes``; None for None.

    ``value`` is an ``int`` (bytes, at least 1), a ``float`` (a fraction of the device in
    (0, 1]) or a ``str`` by the rules of Note [Size and limit syntax]: ``"8GiB"``,
    ``"512MB"``, ``"536870912"``, ``"90%"``, ``"0.9"``, ``"1.0"``. Nothing is truncated
    silently: ``"2.5"``, ``2.5``, ``"1"`` (ambiguous), ``"0.3KiB"``, ``"8G"``, ``"inf"`` and
    ``"nan"`` raise :class:`~gpumem.errors.InvalidArgumentError` saying what is accepted.

    >>> parse_limit("90%", 1000), parse_limit(0.5, 1000), parse_limit("2KiB", 1000), parse_limit(64, 1000)
    (900, 500, 2048, 64)
    """
    if not isinstance(total_nbytes, _Integral) or isinstance(total_nbytes, bool) or total_nbytes <= 0:
        raise _invalid(f"total_nbytes must be a positive int, got {total_nbytes!r}")
    total_nbytes = int(total_nbytes)
    if value is None:
        return None
    if isinstance(value, bool):
        raise _invalid(f"limit must be {_LIMIT_HELP}; got a bool")
    if isinstance(value, _Integral):
        if value <= 0:
            raise _invalid(f"limit must be positive, got {int(value)} bytes")
        return _checked_nbytes(int(value), str(int(value)), "limit")
    if isinstance(value, _Real):
        f = float(value)
        if not math.isfinite(f):
            raise _invalid(f"limit must be a finite number, got {f!r}")
        if not 0 < f <= 1:
            raise _invalid(f"a float limit is a fraction of the device and must be in (0, 1], got {f!r}; "
                           "pass bytes as an int")
        return _fraction_nbytes(_Fraction(f), total_nbytes, repr(f))
    if not isinstance(value, str):
        raise _invalid(f"limit must be {_LIMIT_HELP}; got {type(value).__name__}")
    s = value.strip()
    if s.endswith("%"):
        number, unit, _ = _split(s[:-1], "limit")
        if unit:
            raise _invalid(f"limit: cannot read {_quote(s)}; a percentage is a number followed by %")
        if not 0 < number <= 100:
            raise _invalid(f"limit: a percentage must be in (0%, 100%], got {_quote(s)}")
        return _fraction_nbytes(number / 100, total_nbytes, s)
    try:
        number, unit, has_point = _split(s, "limit")
    except Exception as exc:
        raise _invalid(f"{exc}; a limit is {_LIMIT_HELP}") from None
    if unit:
        nbytes = _unit_nbytes(number, unit, s, "limit")
        if nbytes <= 0:
            raise _invalid(f"limit must be positive, got {_quote(s)}")
        return nbytes
    if has_point:
        if not 0 < number <= 1:
            example = f" (e.g. {s}GiB)" if "e" not in s.lower() else ""
            raise _invalid(f"limit: {_quote(s)} has a decimal point or an exponent, so it is a fraction of the device, "
                           f"and must be in (0, 1]; for bytes write a whole number or add a unit{example}")
        return _fraction_nbytes(number, total_nbytes, s)
    if number == 1:
        raise _invalid("limit: '1' is ambiguous: write 1.0 or 100% for the whole device, or 1B for one byte")
    if number <= 0:
        raise _invalid(f"limit must be positive, got {_quote(s)}")
    return _checked_nbytes(int(number), s, "limit")
