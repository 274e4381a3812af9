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

from .errors import InvalidArgumentError

__all__ = ["STREAM_END", "MAX_ALIGNMENT", "as_int", "check_int_in_range", "check_real_in_range", "check_nbytes",
           "check_pointer", "check_stream", "check_alignment", "check_index"]

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
    """``value`` as a plain ``int`` (any integer type, through :func:`operator.index`); a ``bool`` or a
    non-integer raises :class:`InvalidArgumentError` naming ``what``."""
    if value.__class__ is int:
        return value  # type: ignore[return-value]
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got bool {value!r}")
    try:
        return int(operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__} {value!r:.60}") from None


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
