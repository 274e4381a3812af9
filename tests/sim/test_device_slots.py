"""Note [Where the driver places a segment] (gpumem/sim/device.py): where the simulated device puts ``malloc``'d
segments, and that the slots and the upward range of reservations and small pages never meet."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpumem.errors import OutOfMemoryError
from gpumem.sim.device import SEGMENT_SLOT_NBYTES, _VA_BASE, _VA_LIMIT
from gpumem.specs import open_device
from gpumem.units import MiB


@pytest.fixture
def dev():
    d = open_device("sim:h200-141gb")
    yield d
    d.close()


def test_slots_go_down_and_a_slots_room_fills_up(dev):
    a = dev.malloc(14 * MiB)
    b = dev.malloc(14 * MiB)  # the room of a's slot, right above it
    c = dev.malloc(18 * MiB)  # no room left: a new slot below
    d = dev.malloc(86 * MiB)  # three slots' worth, below
    assert a == _VA_LIMIT - SEGMENT_SLOT_NBYTES and b == a + 14 * MiB
    assert c == a - SEGMENT_SLOT_NBYTES and d == c - 3 * SEGMENT_SLOT_NBYTES
    for p in (a, b, c, d):
        dev.free(p)
    dev.check_invariants()
    assert dev.malloc(40 * MiB) == _VA_LIMIT - 2 * SEGMENT_SLOT_NBYTES  # all given back: from the top again


def test_an_emptied_slots_range_is_reused_from_its_top(dev):
    top = dev.malloc(20 * MiB)
    mid = dev.malloc(20 * MiB)
    low = dev.malloc(20 * MiB)
    dev.free(mid)  # not the lowest: its range is kept for later slots
    dev.check_invariants()
    assert dev.malloc(20 * MiB) == mid
    dev.free(top)
    dev.free(low)
    dev.check_invariants()


def test_a_reservation_space_used_up_and_given_back_leaves_malloc_working(dev):
    """Attacker 25: every reserve and free moved the bump cursor up for good, and a segment needing a new slot was
    then refused as "virtual address space exhausted" with nearly every address free."""
    n = _VA_LIMIT - _VA_BASE
    va = dev.address_reserve(n)
    dev.address_free(va, n)
    assert dev.malloc(2 * MiB) == _VA_LIMIT - SEGMENT_SLOT_NBYTES
    dev.check_invariants()


def test_reservations_never_land_among_the_slots(dev):
    """Attacker 25: once the bump cursor reached the lowest slot, a reservation's fallback search took the room of a
    slot and a range an emptied slot gave back, and the next segment overlapped it (an InternalError, and the
    device's books broken)."""
    a = dev.malloc(2 * MiB)
    dev.malloc(40 * MiB)
    dev.free(a)  # the top slot is given back; the 40 MiB one keeps 24 MiB of room
    dev.address_reserve(dev._slot_low - dev._va_cursor)
    for n in (2 * MiB, 24 * MiB):  # no room below the slots: refused, not put in a slot's room or range
        with pytest.raises(OutOfMemoryError, match="address space exhausted"):
            dev.address_reserve(n)
    dev.check_invariants()
    assert dev.malloc(32 * MiB) == a  # the range the top slot gave back
    dev.check_invariants()


def test_no_room_for_a_new_slot_is_a_clear_error_and_changes_nothing(dev):
    dev.malloc(2 * MiB)
    dev.address_reserve(dev._slot_low - dev._va_cursor)  # the reservations reach the lowest slot
    before = (list(dev._slot_ranges), dev._slot_low, len(dev._slots), dev.accounting())
    with pytest.raises(OutOfMemoryError, match="address space exhausted"):
        dev.malloc(64 * MiB)
    assert (list(dev._slot_ranges), dev._slot_low, len(dev._slots), dev.accounting()) == before
    dev.check_invariants()


_SIZES = st.sampled_from([512, MiB + 512, 2 * MiB, 12 * MiB, 14 * MiB, 20 * MiB, 32 * MiB, 32 * MiB + 2 * MiB,
                          86 * MiB, 250 * MiB])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["malloc", "free", "reserve", "unreserve"]), _SIZES, st.integers(0, 99)),
                max_size=80))
def test_any_sequence_keeps_the_books(ops):
    d = open_device("sim:h200-141gb")
    try:
        live, reserved = [], []
        for kind, n, k in ops:
            if kind == "malloc":
                live.append(d.malloc(n))
            elif kind == "free" and live:
                d.free(live.pop(k % len(live)))
            elif kind == "reserve":
                size = -(-n // (2 * MiB)) * 2 * MiB * 64
                reserved.append((d.address_reserve(size), size))
            elif kind == "unreserve" and reserved:
                d.address_free(*reserved.pop(k % len(reserved)))
            d.check_invariants()
        spans = sorted([(p, p + 1) for p in live] + [(va, va + n) for va, n in reserved])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        for p in live:
            d.free(p)
        for va, n in reserved:
            d.address_free(va, n)
        d.check_invariants()
        assert not d._slots and not d._slot_ranges and d._slot_low == _VA_LIMIT
    finally:
        d.close()
