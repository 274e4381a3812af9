"""Contract: virtual memory management (reserve, create, map, set access, unmap, release, free).

Mappings always use offset 0 into their chunk: CUDA's cuMemMap requires it.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.requires_vmm


def test_reserve_is_granular_and_aligned(device, vmm):
    va = vmm.reserve(4)
    assert isinstance(va, int) and va > 0 and va % vmm.gran == 0
    va2 = vmm.reserve(1)
    assert va2 + vmm.gran <= va or va + 4 * vmm.gran <= va2, "reservations overlap"


def test_reserve_with_alignment(device, vmm):
    align = 16 * vmm.gran
    va = device.address_reserve(2 * vmm.gran, align)
    vmm.reservations.append((va, 2 * vmm.gran))
    assert va % align == 0


def test_full_cycle_across_two_chunks(device, vmm, rng):
    gran = vmm.gran
    va = vmm.reserve(4)
    h1, h2 = vmm.create(1), vmm.create(1)
    vmm.map(va, h1)
    vmm.map(va + gran, h2)
    # data that straddles the two separately created chunks
    data = rng.randbytes(8192)
    device.write(va + gran - 4096, data)
    assert device.read(va + gran - 4096, 8192) == data
    whole = rng.randbytes(2 * gran)
    device.write(va, whole)
    assert device.read(va, 2 * gran) == whole
    assert device.read(va + gran, gran) == whole[gran:]
    vmm.unmap(va, gran)
    vmm.unmap(va + gran, gran)
    vmm.release(h1)
    vmm.release(h2)
    vmm.address_free(va)


def test_data_lives_in_the_chunk(device, vmm, rng):
    """Unmap a chunk and map it at another address: its data comes along."""
    gran = vmm.gran
    va1, va2 = vmm.reserve(2), vmm.reserve(3)
    h = vmm.create(2)
    vmm.map(va1, h)
    data = rng.randbytes(2 * gran)
    device.write(va1, data)
    vmm.unmap(va1, 2 * gran)
    vmm.map(va2 + gran, h)
    assert device.read(va2 + gran, 2 * gran) == data
    assert device.read(va2 + gran + 12345, 100) == data[12345:12445]


def test_same_chunk_mapped_twice(device, vmm, rng):
    gran = vmm.gran
    va1, va2 = vmm.reserve(1), vmm.reserve(1)
    h = vmm.create(1)
    vmm.map(va1, h)
    vmm.map(va2, h)
    data = rng.randbytes(1000)
    device.write(va1 + 10, data)
    assert device.read(va2 + 10, 1000) == data


def test_remap_elsewhere_then_unmap_the_old_mapping(device, vmm, rng, slack):
    """What a stream-ordered steal needs: a chunk mapped at a second address while still mapped at the first
    keeps one copy of the data, takes no more memory, and survives the unmap of the first mapping; its
    memory goes back only when the last mapping of the released chunk goes."""
    gran = vmm.gran
    before = device.mem_info().free_nbytes
    old_va, new_va = vmm.reserve(2), vmm.reserve(2)
    h = vmm.create(2)
    vmm.map(old_va, h)
    data = rng.randbytes(4096)
    device.write(old_va + gran, data)
    vmm.map(new_va, h)
    assert before - device.mem_info().free_nbytes <= 2 * gran + slack, "a second mapping took memory"
    vmm.unmap(old_va, 2 * gran)
    assert device.read(new_va + gran, 4096) == data, "unmapping the old address lost the data"
    vmm.release(h)
    assert before - device.mem_info().free_nbytes >= 2 * gran - slack
    vmm.unmap(new_va, 2 * gran)
    assert abs(device.mem_info().free_nbytes - before) <= slack


def test_mem_info_reflects_mem_create(device, vmm, slack):
    size_gran = 8
    before = device.mem_info().free_nbytes
    h = vmm.create(size_gran)
    assert h.nbytes == size_gran * vmm.gran
    during = device.mem_info().free_nbytes
    assert before - during >= size_gran * vmm.gran - slack
    if slack == 0:
        assert before - during == size_gran * vmm.gran
    vmm.release(h)
    assert abs(device.mem_info().free_nbytes - before) <= slack


def test_release_while_mapped_keeps_memory_until_unmapped(device, vmm, rng, slack):
    gran = vmm.gran
    before = device.mem_info().free_nbytes
    va = vmm.reserve(2)
    h = vmm.create(2)
    vmm.map(va, h)
    data = rng.randbytes(4096)
    device.write(va + gran, data)
    vmm.release(h)
    assert device.read(va + gran, 4096) == data, "a released chunk stays usable while mapped"
    assert before - device.mem_info().free_nbytes >= 2 * gran - slack
    vmm.unmap(va, 2 * gran)
    assert abs(device.mem_info().free_nbytes - before) <= slack
    vmm.address_free(va)


def test_reservations_take_no_memory(device, vmm, slack):
    before = device.mem_info().free_nbytes
    vmm.reserve(512)
    assert abs(device.mem_info().free_nbytes - before) <= slack


def test_address_free_then_reserve_again(device, vmm):
    va = vmm.reserve(4)
    vmm.address_free(va)
    va2 = vmm.reserve(4)
    assert va2 % vmm.gran == 0
