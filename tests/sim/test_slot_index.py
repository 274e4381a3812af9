"""Note [Finding the newest slot with room] (gpumem/sim/slots.py): the index finds what a walk over every slot,
newest first, finds; and the device places segments where it placed them with the walk it replaced (each slot
with the room searched for a gap)."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumem.errors import InternalError
from gpumem.sim import device as device_module
from gpumem.sim.slots import Slot, SlotIndex
from gpumem.specs import open_device
from gpumem.units import MiB


def _walk(slots, nbytes):
    """The reference: newest first, the first slot with the gap."""
    return next((s for s in reversed(slots) if s.gap_nbytes >= nbytes), None)


class SlotIndexMachine(RuleBasedStateMachine):
    """Random adds, room changes, removals and queries (enough adds to compact the array several times)."""

    @initialize()
    def start(self):
        self.index = SlotIndex()
        self.model: list[Slot] = []  # live slots, oldest first

    @rule(gap=st.integers(0, 40))
    def add(self, gap):
        s = Slot(len(self.model), 40)
        s.gap_nbytes = gap
        self.index.add(s)
        self.model.append(s)

    @precondition(lambda self: self.model)
    @rule(k=st.integers(0, 10 ** 6), gap=st.integers(0, 40))
    def change(self, k, gap):
        s = self.model[k % len(self.model)]
        s.gap_nbytes = gap
        self.index.update(s)

    @precondition(lambda self: self.model)
    @rule(k=st.integers(0, 10 ** 6))
    def remove(self, k):
        s = self.model.pop(k % len(self.model))
        self.index.remove(s)
        assert s.pos == -1

    @rule(nbytes=st.integers(0, 42))
    def query(self, nbytes):
        assert self.index.newest_with_gap(nbytes) is _walk(self.model, nbytes)

    @invariant()
    def books(self):
        self.index.check()
        assert list(self.index) == self.model and len(self.index) == len(self.model)


TestSlotIndexMachine = SlotIndexMachine.TestCase
TestSlotIndexMachine.settings = settings(max_examples=60, stateful_step_count=200, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_a_slot_added_twice_or_broken_books_are_an_internal_error():
    index = SlotIndex()
    s = Slot(0, 32)
    index.add(s)
    with pytest.raises(InternalError):
        index.add(s)
    index._gaps[0] = 99  # noqa: SLF001 (the books broken on purpose)
    with pytest.raises(InternalError):
        index.check()
    gone = Slot(32, 32)
    for call in (index.update, index.remove):  # a slot in no index: refused, not written at position -1
        with pytest.raises(InternalError):
            call(gone)


def _walking_place_segment(self, span):
    """The device's placement before the index: a walk over every slot, newest first, a gap searched in each
    (the reference)."""
    for slot in reversed(list(self._slots)):  # noqa: SLF001
        at = self._space.find_gap(slot.base, slot.base + slot.nbytes, span, self._gran)  # noqa: SLF001
        if at is not None:
            return at, slot
    real = self._slots.newest_with_gap  # noqa: SLF001
    self._slots.newest_with_gap = lambda *a, **k: None  # noqa: SLF001 (a new slot, as the device makes it)
    try:
        return device_module.SimDevice._place_segment(self, span)  # noqa: SLF001
    finally:
        self._slots.newest_with_gap = real  # noqa: SLF001


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from([2, 4, 6, 10, 12, 14, 18, 20, 30, 34, 64, 86]),
                              st.integers(0, 10 ** 6)), min_size=1, max_size=150))
def test_the_device_places_segments_where_the_walk_placed_them(ops):
    """Random mallocs and frees (MiB sizes that leave rooms split in two, so a slot with the room but no gap is
    passed over) on two devices, one placing with the walk: the same addresses, the same books."""
    devs = [open_device("sim:h200-141gb"), open_device("sim:h200-141gb")]
    devs[1]._place_segment = _walking_place_segment.__get__(devs[1])  # noqa: SLF001
    try:
        live: list[list[int]] = [[], []]
        for is_free, mib, k in ops:
            if is_free and live[0]:
                j = k % len(live[0])
                for d, ptrs in zip(devs, live):
                    d.free(ptrs.pop(j))
            else:
                for d, ptrs in zip(devs, live):
                    ptrs.append(d.malloc(mib * MiB))
                assert live[0][-1] == live[1][-1]
        for d in devs:
            d.check_invariants()
    finally:
        for d in devs:
            d.close()


def test_a_slot_with_the_room_split_in_two_is_passed_over():
    """The newest slot has 16 MiB of room in two gaps (10 + 6): a 14 MiB segment goes to the older slot whose 14
    MiB of room is one gap, as the walk put it, not to a new slot."""
    dev = open_device("sim:h200-141gb")
    try:
        a, b = dev.malloc(18 * MiB), dev.malloc(14 * MiB)  # the first slot, full
        c, d, e = dev.malloc(10 * MiB), dev.malloc(10 * MiB), dev.malloc(6 * MiB)  # the second, 6 MiB left on top
        assert c == a - 32 * MiB and d == c + 10 * MiB and e == d + 10 * MiB
        dev.free(d)
        dev.free(b)
        assert dev.malloc(14 * MiB) == b
        dev.check_invariants()
    finally:
        dev.close()


def test_a_slot_holding_many_segments_keeps_its_gap_as_segments_come_and_go():
    """A slot whose large segment was freed while a segment in its leftover room stayed (attacker 26): it takes
    every later segment; each malloc and free keeps its largest gap right (the device's invariants compare it with
    a walk of the slot) without reading the whole slot each time."""
    dev = open_device("sim:h200-141gb")
    try:
        big = dev.malloc(400 * 2 * MiB)  # a 800 MiB segment in a slot of 800 MiB: no room
        kept = dev.malloc(20 * MiB)  # a slot of its own, below
        big2 = dev.malloc(700 * MiB)  # a 704 MiB slot, 4 MiB left above it
        small = dev.malloc(4 * MiB)  # in that leftover
        dev.free(big2)  # the slot keeps 700 MiB of gap below `small`
        ptrs = [dev.malloc(4 * MiB) for _ in range(150)]
        assert all(small - 700 * MiB <= p < small for p in ptrs)  # all in the emptied slot's gap
        dev.check_invariants()
        for p in ptrs[::3]:
            dev.free(p)
        dev.check_invariants()
        ptrs = [p for k, p in enumerate(ptrs) if k % 3] + [dev.malloc(6 * MiB) for _ in range(20)]
        dev.check_invariants()
        for p in ptrs + [small, kept, big]:
            dev.free(p)
        dev.check_invariants()
    finally:
        dev.close()


def test_small_mallocs_on_a_device_of_small_pages_share_pages_of_2_mib():
    """A granularity under 1 MiB (a custom profile) once made small pages of one granularity page, which a small
    request overflowed, breaking the books (attacker 26): small pages are 2 MiB there."""
    from gpumem.sim.device import SimDevice
    from gpumem.sim.profiles import custom_profile

    dev = SimDevice(custom_profile("g4k", 1 << 30, granularity_nbytes=4096))
    try:
        before = dev.accounting()
        a, b = dev.malloc(1 << 20), dev.malloc(1 << 20)
        assert b == a + (1 << 20)  # the second in the first one's page
        dev.check_invariants()
        dev.free(a)
        dev.free(b)
        dev.check_invariants()
        assert dev.accounting() == before
    finally:
        dev.close()
