"""The simulated device's slots of address space for ``malloc``'d segments, found newest first by their gaps.

Note [Finding the newest slot with room]
    The device puts a segment in the newest slot with a gap that can take it (Note [Where the driver places a
    segment] in :mod:`gpumem.sim.device`). A walk over the slots, newest first, looking for a gap in each whose
    room (bytes no segment holds) was enough, made each ``malloc`` cost a Python step per slot and a gap search
    per slot whose room was split in two: a ``gpumem fit`` of a 7B decode (36,000 segments made and freed, 300
    slots alive, 20,000 such searches in vain) spent a quarter of its time there. Each slot now keeps its
    largest gap (``gap_nbytes``, computed again when a segment comes or goes, a handful of segments per slot),
    and :class:`SlotIndex` keeps those in an array in creation order: the newest slot that can take ``span``
    bytes is one vectorised search, and the gap search in it always succeeds. Everything in a slot is a
    segment of whole pages at page-aligned addresses, so a gap of ``span`` bytes exists exactly where the walk's
    aligned search found one: the same slot, the same address. Positions are handed out in creation order and
    never reused until the array is full, when it is compacted (order kept).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import InternalError

__all__ = ["Slot", "SlotIndex"]


class Slot:
    """A slot of address space holding ``malloc``'d segments (Note [Where the driver places a segment] in
    :mod:`gpumem.sim.device`)."""

    __slots__ = ("base", "nbytes", "n_live", "gap_nbytes", "pos")

    def __init__(self, base: int, nbytes: int) -> None:
        self.base = base
        self.nbytes = nbytes
        self.n_live = 0
        self.gap_nbytes = nbytes
        """The longest run of bytes within it that no segment holds (what :class:`SlotIndex` searches by)."""
        self.pos = -1
        """Its position in the :class:`SlotIndex` that holds it (creation order), -1 when in none."""


class SlotIndex:
    """Slots in creation order, each one's largest gap in an array (Note [Finding the newest slot with room])."""

    _FIRST_CAPACITY = 64

    def __init__(self) -> None:
        self._gaps = np.full(self._FIRST_CAPACITY, -1, dtype=np.int64)
        """``_gaps[pos]``: the largest gap of the slot at ``pos`` (-1: none there)."""
        self._slots: list[Slot | None] = []
        """The slot at each position handed out (None: removed)."""
        self._n_live = 0
        self._gap_bound = -1
        """At least the largest gap (a search for more finds nothing without looking)."""

    def __len__(self) -> int:
        return self._n_live

    def __iter__(self) -> Iterator[Slot]:
        """The slots, oldest first."""
        return (s for s in self._slots if s is not None)

    def add(self, slot: Slot) -> None:
        """Add ``slot`` as the newest."""
        if slot.pos >= 0:
            raise InternalError("the slot is in an index already")
        if len(self._slots) == len(self._gaps):
            self._compact()
        slot.pos = len(self._slots)
        self._slots.append(slot)
        self._n_live += 1
        self._gaps[slot.pos] = slot.gap_nbytes
        self._gap_bound = max(self._gap_bound, slot.gap_nbytes)

    def update(self, slot: Slot) -> None:
        """``slot.gap_nbytes`` changed."""
        if slot.pos < 0:
            raise InternalError("the slot is in no index")
        self._gaps[slot.pos] = slot.gap_nbytes
        self._gap_bound = max(self._gap_bound, slot.gap_nbytes)

    def remove(self, slot: Slot) -> None:
        if slot.pos < 0:
            raise InternalError("the slot is in no index")
        self._gaps[slot.pos] = -1
        self._slots[slot.pos] = None
        slot.pos = -1
        self._n_live -= 1

    def clear(self) -> None:
        for s in self._slots:
            if s is not None:
                s.pos = -1
        self.__init__()  # type: ignore[misc]

    def newest_with_gap(self, nbytes: int) -> Slot | None:
        """The newest slot whose largest gap is at least ``nbytes``, or None."""
        if nbytes > self._gap_bound:
            return None
        found = np.flatnonzero(self._gaps[:len(self._slots)] >= nbytes)
        if found.size:
            return self._slots[found[-1]]
        self._gap_bound = int(self._gaps.max())  # every gap was seen: the bound made exact
        return None

    def check(self) -> None:
        """Raise :class:`~gpumem.errors.InternalError` where the array does not hold each slot's gap and position."""
        gaps = self._gaps.tolist()
        live = [(pos, s) for pos, s in enumerate(self._slots) if s is not None]
        ok = (len(live) == self._n_live and len(self._slots) <= len(gaps)
              and all(s.pos == pos and gaps[pos] == s.gap_nbytes >= 0 for pos, s in live)
              and all(gaps[pos] == -1 for pos, s in enumerate(self._slots) if s is None)
              and all(v == -1 for v in gaps[len(self._slots):]) and self._gap_bound >= max(gaps))
        if not ok:
            raise InternalError("the slot index does not hold its slots' gaps")

    def _compact(self) -> None:
        """Positions handed out anew (creation order kept), the array doubled where more than half is live."""
        live = [s for s in self._slots if s is not None]
        cap = self._FIRST_CAPACITY
        while cap < 2 * len(live) + 1:
            cap *= 2
        gaps = np.full(cap, -1, dtype=np.int64)
        for pos, s in enumerate(live):
            s.pos = pos
            gaps[pos] = s.gap_nbytes
        self._gaps, self._slots = gaps, live
