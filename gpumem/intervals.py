"""A map of disjoint address intervals, the one structure behind every address book in gpumem.

The simulator's address space, its packed small-allocation pages, the VMM book's
reservations and mappings, and the CUDA adapter's malloc record all answer the
same questions: which interval holds this address, which intervals overlap this
range, do these intervals tile this range without a hole, where is a free gap.
:class:`IntervalMap` answers them in O(log n) with a sorted list of starts.

Note [Intervals are half-open and never overlap]
------------------------------------------------
An interval is ``[start, end)`` with ``end > start``. :meth:`IntervalMap.add`
refuses an interval that overlaps one already present, raising
:class:`~gpumem.errors.InternalError`: callers check for overlap first (and
raise the user-facing error, such as ``MappingOverlapError``), so reaching the
map with an overlap is a bug in gpumem, not bad input.
"""

from __future__ import annotations

import bisect
from typing import Generic, Iterator, TypeVar

from .errors import InternalError

V = TypeVar("V")


class IntervalMap(Generic[V]):
    """Disjoint half-open intervals ``[start, end)``, each with a value, kept sorted by start.

    >>> m = IntervalMap(); m.add(0x1000, 0x2000, "a"); m.add(0x3000, 0x3800, "b")
    >>> m.find(0x1fff)
    (4096, 8192, 'a')
    >>> m.find(0x2000) is None
    True
    """

    __slots__ = ("_starts", "_items")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._items: dict[int, tuple[int, V]] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __contains__(self, start: object) -> bool:
        """Whether an interval starts exactly at ``start``."""
        return start in self._items

    def get(self, start: int) -> V | None:
        """The value of the interval starting exactly at ``start``, or ``None``."""
        item = self._items.get(start)
        return None if item is None else item[1]

    def end_of(self, start: int) -> int:
        """The end of the interval starting at ``start`` (:class:`KeyError` if there is none)."""
        return self._items[start][0]

    def add(self, start: int, end: int, value: V) -> None:
        """Insert ``[start, end)``; it must not overlap any interval (Note [Intervals are half-open...])."""
        if end <= start:
            raise InternalError(f"empty or reversed interval [{start:#x}, {end:#x})")
        hit = self.first_overlap(start, end)
        if hit is not None:
            raise InternalError(f"[{start:#x}, {end:#x}) overlaps [{hit[0]:#x}, {hit[1]:#x}) in an interval map")
        bisect.insort(self._starts, start)
        self._items[start] = (end, value)

    def remove(self, start: int) -> V:
        """Remove the interval starting at ``start`` and return its value."""
        item = self._items.pop(start, None)
        if item is None:
            raise InternalError(f"no interval starts at {start:#x}")
        del self._starts[bisect.bisect_left(self._starts, start)]
        return item[1]

    def find(self, point: int) -> tuple[int, int, V] | None:
        """``(start, end, value)`` of the interval holding ``point``, or ``None``."""
        starts = self._starts
        i = bisect.bisect_right(starts, point) - 1
        if i < 0:
            return None
        start = starts[i]
        end, value = self._items[start]
        return (start, end, value) if point < end else None

    def first_overlap(self, start: int, end: int) -> tuple[int, int, V] | None:
        """The lowest interval that overlaps ``[start, end)``, or ``None``."""
        starts = self._starts
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0:
            s = starts[i]
            e, v = self._items[s]
            if e > start:
                return s, e, v
        if i + 1 < len(starts) and starts[i + 1] < end:
            s = starts[i + 1]
            e, v = self._items[s]
            return s, e, v
        return None

    def overlapping(self, start: int, end: int) -> list[tuple[int, int, V]]:
        """Every interval that overlaps ``[start, end)``, by address."""
        starts = self._starts
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        out = []
        while i < len(starts) and starts[i] < end:
            s = starts[i]
            e, v = self._items[s]
            if e > start:
                out.append((s, e, v))
            i += 1
        return out

    def tiling(self, start: int, end: int) -> tuple[list[tuple[int, int, V]], int | None]:
        """The intervals that tile ``[start, end)`` from ``start`` on without a hole, and the first
        address not covered (``None`` when the whole range is covered)."""
        starts = self._starts
        i = bisect.bisect_right(starts, start) - 1
        out: list[tuple[int, int, V]] = []
        cursor = start
        while cursor < end:
            if i < 0 or i >= len(starts):
                return out, cursor
            s = starts[i]
            e, v = self._items[s]
            if not s <= cursor < e:
                return out, cursor
            out.append((s, e, v))
            cursor = e
            i += 1
        return out, None

    def find_gap(self, lo: int, hi: int, nbytes: int, alignment: int = 1) -> int | None:
        """The lowest ``alignment``-aligned address ``a`` in ``[lo, hi)`` with ``[a, a + nbytes)`` free, or ``None``."""
        def up(x: int) -> int:
            return -(-x // alignment) * alignment

        cursor = lo
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        for s in self._starts[i:]:
            if s >= hi:
                break
            cand = up(cursor)
            if cand + nbytes <= s:
                return cand if cand + nbytes <= hi else None
            cursor = max(cursor, self._items[s][0])
        cand = up(cursor)
        return cand if cand + nbytes <= hi else None

    def free_run(self, lo: int, hi: int, at: int) -> tuple[int, int]:
        """``(start, end)``: the free run within ``[lo, hi)`` that holds ``at`` (``lo <= at < hi``, not inside an
        interval: else :class:`~gpumem.errors.InternalError`)."""
        if not lo <= at < hi:
            raise InternalError(f"free_run: {at:#x} is not in [{lo:#x}, {hi:#x})")
        starts = self._starts
        i = bisect.bisect_right(starts, at) - 1
        start, end = lo, hi
        if i >= 0:
            e = self._items[starts[i]][0]
            if e > at:
                raise InternalError(f"free_run: {at:#x} is inside the interval at {starts[i]:#x}")
            start = max(lo, e)
        if i + 1 < len(starts):
            end = min(hi, starts[i + 1])
        return start, end

    def largest_gap(self, lo: int, hi: int) -> int:
        """The length of the longest free run within ``[lo, hi)`` (0 where none is free)."""
        cursor, best = lo, 0
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        for s in self._starts[i:]:
            if s >= hi:
                break
            if s > cursor:
                best = max(best, s - cursor)
            cursor = max(cursor, self._items[s][0])
        return max(best, hi - cursor)

    def items(self) -> Iterator[tuple[int, int, V]]:
        """``(start, end, value)`` of every interval, by address."""
        items = self._items
        for s in list(self._starts):
            e, v = items[s]
            yield s, e, v

    def values(self) -> list[V]:
        """Every value, by address."""
        return [self._items[s][1] for s in self._starts]

    def clear(self) -> None:
        self._starts.clear()
        self._items.clear()

    def check(self) -> None:
        """Raise :class:`~gpumem.errors.InternalError` unless the index and the intervals agree."""
        if self._starts != sorted(self._items) or len(self._starts) != len(set(self._starts)):
            raise InternalError("interval map index out of sync")
        prev_end = None
        for s in self._starts:
            e = self._items[s][0]
            if e <= s or (prev_end is not None and s < prev_end):
                raise InternalError(f"interval [{s:#x}, {e:#x}) is empty or overlaps the one before")
            prev_end = e
