"""Bookkeeping of virtual-memory reservations and their mappings, shared by every device.

Both the simulated GPU and the CUDA adapter must refuse the same bad VMM calls
(an overlapping ``cuMemMap``, an unmap of something not mapped...) *before* any
state moves or CUDA is called (Note [Validation before any device call] in
:mod:`gpumem.device`). A :class:`Reservation` keeps its mappings sorted by address
and answers those questions; each device adds only what is its own (simulated
data, or the driver's handles).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from .errors import MappingError, MappingOverlapError


@dataclass
class Mapping:
    """``nbytes`` of a physical chunk (from ``offset``) mapped at ``va``."""

    va: int
    nbytes: int
    physical: Any
    """The device's record of the chunk; it must have an int ``map_count``."""
    offset: int
    accessible: bool = False


@dataclass
class Reservation:
    """A reserved virtual range and the mappings inside it, sorted by address."""

    start: int
    nbytes: int
    starts: list[int] = field(default_factory=list)
    mappings: dict[int, Mapping] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def check_inside(self, va: int, nbytes: int, call: str) -> None:
        """Raise :class:`MappingError` unless ``[va, va + nbytes)`` lies inside this reservation."""
        if va + nbytes > self.end:
            raise MappingError(f"{call}: [{va:#x}, {va + nbytes:#x}) runs past its reservation's end {self.end:#x}")

    def check_unmapped(self, va: int, nbytes: int, call: str) -> None:
        """Raise :class:`MappingOverlapError` if ``[va, va + nbytes)`` overlaps a mapping."""
        i = bisect.bisect_right(self.starts, va) - 1
        if i >= 0:
            prev = self.mappings[self.starts[i]]
            if prev.va + prev.nbytes > va:
                raise MappingOverlapError(f"{call}: [{va:#x}, {va + nbytes:#x}) overlaps the mapping at {prev.va:#x}")
        if i + 1 < len(self.starts) and self.starts[i + 1] < va + nbytes:
            raise MappingOverlapError(f"{call}: [{va:#x}, {va + nbytes:#x}) overlaps the mapping at "
                                      f"{self.starts[i + 1]:#x}")

    def add(self, va: int, nbytes: int, physical: Any, offset: int) -> Mapping:
        """Record a mapping (after :meth:`check_unmapped` and the device's own call succeeded)."""
        m = Mapping(va, nbytes, physical, offset)
        bisect.insort(self.starts, va)
        self.mappings[va] = m
        physical.map_count += 1
        return m

    def remove(self, m: Mapping) -> None:
        """Forget a mapping (after the device unmapped it)."""
        del self.starts[bisect.bisect_left(self.starts, m.va)]
        del self.mappings[m.va]
        m.physical.map_count -= 1

    def covering(self, va: int, nbytes: int, call: str) -> list[Mapping]:
        """The mappings that tile ``[va, va + nbytes)`` from ``va`` with no hole, or :class:`MappingError`."""
        i = bisect.bisect_right(self.starts, va) - 1
        out: list[Mapping] = []
        cursor, end = va, va + nbytes
        while cursor < end:
            if i < 0 or i >= len(self.starts):
                raise MappingError(f"{call}: {cursor:#x} is not mapped")
            m = self.mappings[self.starts[i]]
            if not m.va <= cursor < m.va + m.nbytes:
                raise MappingError(f"{call}: {cursor:#x} is not mapped")
            out.append(m)
            cursor = m.va + m.nbytes
            i += 1
        return out

    def whole_mappings(self, va: int, nbytes: int, call: str) -> list[Mapping]:
        """Like :meth:`covering`, but the range must start and end on mapping boundaries (for unmap)."""
        maps = self.covering(va, nbytes, call)
        if maps[0].va != va or maps[-1].va + maps[-1].nbytes != va + nbytes:
            raise MappingError(f"{call}: [{va:#x}, {va + nbytes:#x}) does not cover whole mappings")
        return maps
