"""The record of what a device handed out: ``malloc`` ranges, reservations, their mappings, physical chunks.

Every device must refuse the same bad calls (a double free, an overlapping
``cuMemMap``, an unmap of something not mapped, a copy past the end of an
allocation...) *before* any state moves or CUDA is called (Note [Validation
before any device call] in :mod:`gpumem.device`). One :class:`MemoryBook`,
kept by the :class:`~gpumem.device.Device` base class, answers those questions
for both the simulator and the CUDA adapter; each device keeps only what is its
own (simulated bytes and pages, or the driver's handles) in the records'
``native`` fields.

Note [The book follows the device]
----------------------------------
The base class changes the book only after the implementation's ``_do_`` call
succeeded, so the book always says what the device really holds: a failed call
leaves it as it was, and where one request takes several CUDA calls (unmapping
several mappings) the book follows each call that succeeded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .errors import (
    DoubleFreeError,
    InternalError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    MappingOverlapError,
)
from .intervals import IntervalMap

#: How many freed pointers are remembered to tell a double free from a wild pointer.
FREED_MEMORY = 65_536


class Allocation:
    """A ``malloc``'d range ``[start, start + nbytes)``; ``native`` is the device's own data for it."""

    __slots__ = ("start", "nbytes", "native")

    def __init__(self, start: int, nbytes: int, native: Any = None) -> None:
        self.start = start
        self.nbytes = nbytes
        self.native = native


class Physical:
    """A ``cuMemCreate`` chunk: our handle, the device's own object (``native``), and its mappings."""

    __slots__ = ("handle", "native", "released", "map_count")

    def __init__(self, handle: Any, native: Any) -> None:
        self.handle = handle
        self.native = native
        self.released = False
        self.map_count = 0


class Mapping:
    """``nbytes`` of a physical chunk (from ``offset``) mapped at ``va``."""

    __slots__ = ("va", "nbytes", "physical", "offset", "accessible")

    def __init__(self, va: int, nbytes: int, physical: Physical, offset: int) -> None:
        self.va = va
        self.nbytes = nbytes
        self.physical = physical
        self.offset = offset
        self.accessible = False


class Reservation:
    """A reserved virtual range and the mappings inside it."""

    __slots__ = ("start", "nbytes", "mappings", "serial")

    def __init__(self, start: int, nbytes: int, serial: int = 0) -> None:
        self.start = start
        self.nbytes = nbytes
        self.mappings: IntervalMap[Mapping] = IntervalMap()
        self.serial = serial
        """Which of the device's reservations this is, in the order they were made (1, 2, ...): one made again at
        a freed one's address is another."""

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def check_inside(self, va: int, nbytes: int, call: str) -> None:
        """Raise :class:`MappingError` unless ``[va, va + nbytes)`` lies inside this reservation."""
        if va + nbytes > self.end:
            raise MappingError(f"{call}: [{va:#x}, {va + nbytes:#x}) runs past its reservation's end {self.end:#x}")

    def check_unmapped(self, va: int, nbytes: int, call: str) -> None:
        """Raise :class:`MappingOverlapError` if ``[va, va + nbytes)`` overlaps a mapping."""
        hit = self.mappings.first_overlap(va, va + nbytes)
        if hit is not None:
            raise MappingOverlapError(f"{call}: [{va:#x}, {va + nbytes:#x}) overlaps the mapping at {hit[0]:#x}")

    def add(self, va: int, nbytes: int, physical: Physical, offset: int) -> Mapping:
        """Record a mapping (after :meth:`check_unmapped` and the device's own call succeeded)."""
        m = Mapping(va, nbytes, physical, offset)
        self.mappings.add(va, va + nbytes, m)
        physical.map_count += 1
        return m

    def remove(self, m: Mapping) -> None:
        """Forget a mapping (after the device unmapped it)."""
        self.mappings.remove(m.va)
        m.physical.map_count -= 1

    def covering(self, va: int, nbytes: int, call: str) -> list[Mapping]:
        """The mappings that tile ``[va, va + nbytes)`` from ``va`` with no hole, or :class:`MappingError`."""
        tiles, hole = self.mappings.tiling(va, va + nbytes)
        if hole is not None:
            raise MappingError(f"{call}: {hole:#x} is not mapped")
        return [m for _, _, m in tiles]

    def whole_mappings(self, va: int, nbytes: int, call: str) -> list[Mapping]:
        """Like :meth:`covering`, but the range must start and end on mapping boundaries (for unmap)."""
        maps = self.covering(va, nbytes, call)
        if maps[0].va != va or maps[-1].va + maps[-1].nbytes != va + nbytes:
            raise MappingError(f"{call}: [{va:#x}, {va + nbytes:#x}) does not cover whole mappings")
        return maps


class MemoryBook:
    """Live allocations, recently freed pointers, reservations with their mappings, and physical chunks."""

    def __init__(self, owner: object = None) -> None:
        self._owner = owner
        self.allocations: IntervalMap[Allocation] = IntervalMap()
        self.freed: OrderedDict[int, None] = OrderedDict()
        self.reservations: IntervalMap[Reservation] = IntervalMap()
        self.physicals: dict[int, Physical] = {}
        self.next_handle = 1

    @property
    def spec(self) -> str:
        """The owning device's spec, for messages."""
        return str(getattr(self._owner, "spec", ""))

    # -- malloc ------------------------------------------------------------------------------------------
    def add_allocation(self, alloc: Allocation) -> None:
        self.allocations.add(alloc.start, alloc.start + alloc.nbytes, alloc)
        self.freed.pop(alloc.start, None)

    def allocation_to_free(self, ptr: int) -> Allocation:
        """The live allocation starting at ``ptr``, or :class:`DoubleFreeError` / :class:`InvalidPointerError`."""
        alloc = self.allocations.get(ptr)
        if alloc is None:
            if ptr in self.freed:
                raise DoubleFreeError(f"double free of {ptr:#x} on {self.spec}")
            raise InvalidPointerError(f"free of {ptr:#x}, which {self.spec} never allocated (or not its start)")
        return alloc

    def forget_allocation(self, alloc: Allocation) -> None:
        self.allocations.remove(alloc.start)
        self.freed[alloc.start] = None
        if len(self.freed) > FREED_MEMORY:
            self.freed.popitem(last=False)

    # -- virtual memory ------------------------------------------------------------------------------------
    def reservation(self, va: int, nbytes: int, call: str) -> Reservation:
        """The reservation holding ``[va, va + nbytes)``, or :class:`MappingError`."""
        hit = self.reservations.find(va)
        if hit is None:
            raise MappingError(f"{call}: {va:#x} is not inside an address reservation on {self.spec}")
        r = hit[2]
        if va + nbytes > r.start + r.nbytes:
            r.check_inside(va, nbytes, call)  # raises
        return r

    def reservation_to_free(self, va: int, nbytes: int) -> Reservation:
        r = self.reservations.get(va)
        if r is None:
            raise MappingError(f"address_free: {va:#x} is not the base of a reservation on {self.spec}")
        if r.nbytes != nbytes:
            raise MappingError(f"address_free: reservation at {va:#x} is {r.nbytes} bytes, not {nbytes}")
        if r.mappings:
            raise MappingError(f"address_free: reservation at {va:#x} still has {len(r.mappings)} mapping(s)")
        return r

    def add_physical(self, handle_type: Any, nbytes: int, native: Any) -> Physical:
        handle = handle_type(self.next_handle, nbytes)
        self.next_handle += 1
        phys = self.physicals[handle.handle] = Physical(handle, native)
        return phys

    def physical(self, handle: Any, handle_type: type, call: str) -> Physical:
        """The live (unreleased) chunk of ``handle``; a non-handle is an :class:`InvalidArgumentError`."""
        if not isinstance(handle, handle_type):
            raise InvalidArgumentError(f"{call}: handle must be a PhysicalHandle, got {type(handle).__name__}")
        phys = self.physicals.get(handle.handle)
        if phys is None or (phys.handle is not handle and phys.handle != handle) or phys.released:
            raise InvalidPointerError(f"{call}: unknown or released physical handle {handle.handle}")
        return phys

    # -- data ------------------------------------------------------------------------------------------------
    def locate(self, ptr: int, nbytes: int, call: str) -> list[tuple[Any, int, int]]:
        """Where ``[ptr, ptr + nbytes)`` lives: ``(record, offset in it, length)`` pieces, the record an
        :class:`Allocation` (one piece) or the :class:`Physical` behind each mapping crossed.

        Raises :class:`InvalidPointerError` unless the range lies inside one live allocation or
        inside contiguous mappings that all have access set.
        """
        hit = self.allocations.find(ptr)
        if hit is not None:
            start, end, alloc = hit
            if ptr + nbytes > end:
                raise InvalidPointerError(f"{call}: [{ptr:#x}, {ptr + nbytes:#x}) runs past the end of the "
                                          f"{alloc.nbytes}-byte allocation at {start:#x}")
            return [(alloc, ptr - start, nbytes)]
        hit_r = self.reservations.find(ptr)
        if hit_r is not None:
            r = hit_r[2]
            try:
                r.check_inside(ptr, nbytes, call)
                maps = r.covering(ptr, nbytes, call)
            except MappingError as exc:
                raise InvalidPointerError(str(exc)) from None
            pieces = []
            cursor, end = ptr, ptr + nbytes
            for m in maps:
                if not m.accessible:
                    raise InvalidPointerError(f"{call}: mapping at {m.va:#x} has no access set (mem_set_access)")
                take = min(end, m.va + m.nbytes) - cursor
                pieces.append((m.physical, m.offset + cursor - m.va, take))
                cursor += take
            return pieces
        raise InvalidPointerError(f"{call}: {ptr:#x} is not inside any allocation or mapping on {self.spec}")

    # -- the whole book ----------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.allocations.clear()
        self.freed.clear()
        self.reservations.clear()
        self.physicals.clear()

    def check(self) -> None:
        """Raise :class:`~gpumem.errors.InternalError` if the book contradicts itself."""
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise InternalError(f"{self.spec}: {what}")

        self.allocations.check()
        self.reservations.check()
        counts: dict[int, int] = {}
        for start, end, r in self.reservations.items():
            require(r.start == start and r.end == end, f"reservation at {start:#x} recorded at {r.start:#x}")
            r.mappings.check()
            for s, e, m in r.mappings.items():
                require(m.va == s and s >= r.start and e <= r.end, f"mapping at {s:#x} escapes its reservation")
                require(m.physical is self.physicals.get(m.physical.handle.handle),
                        f"mapping at {s:#x} uses a chunk the book does not hold")
                counts[m.physical.handle.handle] = counts.get(m.physical.handle.handle, 0) + 1
        for hid, phys in self.physicals.items():
            require(phys.map_count == counts.get(hid, 0),
                    f"chunk {hid}: {phys.map_count} mappings counted, {counts.get(hid, 0)} found")
            require(not (phys.released and phys.map_count == 0), f"released, unmapped chunk {hid} kept")
        for start, _, alloc in self.allocations.items():
            require(alloc.start == start, f"allocation at {start:#x} recorded at {alloc.start:#x}")
            require(self.reservations.find(start) is None, f"allocation at {start:#x} inside a reservation")
