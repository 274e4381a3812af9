"""SimDevice specifics the contract suite cannot see: introspection, close, address space, offsets."""

from __future__ import annotations

import pytest

import gpumem
from gpumem import DeviceClosedError, GiB, MiB, OutOfMemoryError
from gpumem.units import TiB
from gpumem.sim import SimDevice, get_profile


@pytest.fixture
def dev():
    with gpumem.open_device("sim:a100-80gb") as d:
        yield d


def test_close_gives_everything_back(dev):
    gran = dev.granularity_nbytes
    dev.malloc(64 * MiB)
    dev.malloc(512)
    va = dev.address_reserve(4 * gran)
    h = dev.mem_create(2 * gran)
    dev.mem_map(va, 2 * gran, h)
    assert dev.process_used_nbytes == 64 * MiB + 2 * MiB + 2 * gran
    dev.close()
    assert dev.process_used_nbytes == 0 and dev.n_allocations == 0
    assert dev.allocation_ranges() == [] and dev.mapping_ranges() == []
    with pytest.raises(DeviceClosedError):
        dev.mem_info()


def test_introspection(dev):
    a = dev.malloc(100)
    b = dev.malloc(3 * MiB)
    gran = dev.granularity_nbytes
    va = dev.address_reserve(2 * gran)
    h = dev.mem_create(gran)
    dev.mem_map(va + gran, gran, h)
    assert sorted(dev.allocation_ranges()) == sorted([(a, 100), (b, 3 * MiB)])
    assert dev.mapping_ranges() == [(va + gran, gran, h.handle)]
    assert dev.n_allocations == 2
    assert dev.accounting() == (1 + 2 + 1, 0, 3)
    dev.check_invariants()
    dev.mem_unmap(va + gran, gran)
    dev.mem_release(h)
    dev.address_free(va, 2 * gran)
    dev.free(a)
    dev.free(b)
    assert dev.accounting() == (0, 0, 0)


def test_terabyte_reservations_fit(dev):
    """The H200 calibration reserved 1 TiB of address space; the simulator must allow it too."""
    dev.malloc(GiB)
    va = dev.address_reserve(TiB)
    va2 = dev.address_reserve(TiB)
    assert va2 >= va + TiB
    dev.address_free(va, TiB)
    dev.address_free(va2, TiB)


def test_address_space_wraps_around_to_free_gaps():
    dev = SimDevice(get_profile("t4-16gb"))
    huge = 60 * TiB
    a = dev.address_reserve(huge)
    b = dev.address_reserve(huge)
    with pytest.raises(OutOfMemoryError):
        dev.address_reserve(huge)  # the address space is used up
    dev.address_free(a, huge)
    c = dev.address_reserve(huge)  # found again in the freed gap
    assert c == a
    ptr = dev.malloc(4 * MiB)
    assert not (c <= ptr < c + huge or b <= ptr < b + huge)
    dev.check_invariants()


def test_mapping_with_an_offset_shares_the_chunk(dev):
    gran = dev.granularity_nbytes
    va1, va2 = dev.address_reserve(3 * gran), dev.address_reserve(gran)
    h = dev.mem_create(3 * gran)
    dev.mem_map(va1, 3 * gran, h)
    dev.mem_map(va2, gran, h, offset=2 * gran)
    dev.mem_set_access(va1, 3 * gran)
    dev.mem_set_access(va2, gran)
    dev.write(va1 + 2 * gran + 10, b"shared")
    assert dev.read(va2 + 10, 6) == b"shared"


def test_set_access_and_unmap_across_adjacent_mappings(dev):
    gran = dev.granularity_nbytes
    va = dev.address_reserve(4 * gran)
    handles = [dev.mem_create(gran) for _ in range(3)]
    for i, h in enumerate(handles):
        dev.mem_map(va + i * gran, gran, h)
    dev.mem_set_access(va, 3 * gran)  # one call over three mappings
    dev.write(va + gran - 3, b"abcdef")
    assert dev.read(va + gran - 3, 6) == b"abcdef"
    dev.mem_unmap(va, 3 * gran)
    assert dev.mapping_ranges() == []


def test_double_free_is_remembered_only_for_freed_starts(dev):
    p = dev.malloc(512)
    q = dev.malloc(512)
    dev.free(p)
    r = dev.malloc(512)
    assert r == p  # a gap is reused...
    dev.free(r)  # ...and freeing the new allocation is no double free
    with pytest.raises(gpumem.DoubleFreeError):
        dev.free(r)
    dev.free(q)


def test_check_invariants_raises_internal_error_not_assertion_error():
    from gpumem import InternalError

    dev = SimDevice(get_profile("a100-80gb"))
    dev.malloc(3 * MiB)
    dev.check_invariants()
    dev._process_pages += 1  # noqa: SLF001 - corrupt the accounting on purpose
    with pytest.raises(InternalError, match="pages"):
        dev.check_invariants()
    dev._process_pages -= 1  # noqa: SLF001
    va = dev.address_reserve(4 * MiB)
    h = dev.mem_create(2 * MiB)
    dev.mem_map(va, 2 * MiB, h)
    dev._book.physicals[h.handle].map_count = 5  # noqa: SLF001
    with pytest.raises(InternalError, match="mappings counted"):
        dev.check_invariants()
