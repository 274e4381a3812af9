"""Contract: bad input raises the specific gpumem error and changes nothing.

Each test sets up a :class:`Canary` (allocations with known data and the free bytes)
before the bad call and checks afterwards that free memory did not move (exactly on a
simulated device, within a few MiB on a real one) and that the data is intact.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpumem import (
    DoubleFreeError,
    GpumemError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    MappingOverlapError,
    MiB,
    OutOfMemoryError,
    PhysicalHandle,
    UnsupportedOperationError,
)
from gpumem.units import align_up

BAD_SIZES = [-1, 0, 1.5, 2.0, "10", True, False, None, b"10", [10]]


@pytest.mark.parametrize("nbytes", BAD_SIZES, ids=repr)
def test_malloc_bad_size(device, canary, nbytes):
    with pytest.raises(InvalidArgumentError):
        device.malloc(nbytes)
    canary.assert_unchanged()


def test_double_free(device, canary):
    for size in (512, 3 * MiB):
        ptr = device.malloc(size)
        device.free(ptr)
        free_before = device.mem_info().free_nbytes
        with pytest.raises(DoubleFreeError):
            device.free(ptr)
        canary.assert_unchanged(free_nbytes=free_before)
    canary.assert_unchanged()


def test_free_unknown_pointer(device, canary):
    for ptr in (canary.large_ptr + 1, canary.large_ptr + 4096, canary.small_ptr + 256, 0x10000):
        with pytest.raises(InvalidPointerError) as info:
            device.free(ptr)
        assert not isinstance(info.value, DoubleFreeError), f"{ptr:#x} was never allocated"
    canary.assert_unchanged()


@pytest.mark.parametrize("ptr", [0, -5, 1.5, "0x1000", None, True], ids=repr)
def test_free_bad_pointer_value(device, canary, ptr):
    with pytest.raises(InvalidArgumentError):
        device.free(ptr)
    canary.assert_unchanged()


def test_out_of_bounds_write_and_read(device, canary, rng):
    cases = [
        (canary.small_ptr, canary.SMALL + 1),                 # one byte too many
        (canary.small_ptr + canary.SMALL - 10, 11),           # runs past the end
        (canary.small_ptr + canary.SMALL, 1),                 # starts at the end
        (canary.large_ptr + canary.LARGE - 1, 2),
        (canary.large_ptr + canary.LARGE, 16),                # inside the last page, past the allocation
        (0x10000, 8),                                         # never allocated
    ]
    for ptr, n in cases:
        with pytest.raises(InvalidPointerError):
            device.write(ptr, rng.randbytes(n))
        with pytest.raises(InvalidPointerError):
            device.read(ptr, n)
    canary.assert_unchanged()


def test_use_after_free(device, canary):
    for size in (1000, 4 * MiB):
        ptr = device.malloc(size)
        device.write(ptr, b"live")
        device.free(ptr)
        free_before = device.mem_info().free_nbytes
        with pytest.raises(InvalidPointerError):
            device.write(ptr, b"dead")
        with pytest.raises(InvalidPointerError):
            device.read(ptr, 4)
        canary.assert_unchanged(free_nbytes=free_before)


@pytest.mark.parametrize("data", ["text", 5, None, [1, 2, 3], np.zeros((8, 8))[:, ::2]],
                         ids=["str", "int", "None", "list", "non-contiguous"])
def test_write_bad_data(device, canary, data):
    with pytest.raises(InvalidArgumentError):
        device.write(canary.small_ptr, data)
    canary.assert_unchanged()


@pytest.mark.parametrize("nbytes", [-1, 1.5, "4", None], ids=repr)
def test_read_bad_size(device, canary, nbytes):
    with pytest.raises(InvalidArgumentError):
        device.read(canary.small_ptr, nbytes)
    canary.assert_unchanged()


@pytest.mark.parametrize("ptr", [0, -4096, "0x1000", 1.0], ids=repr)
def test_read_write_bad_pointer_value(device, canary, ptr):
    with pytest.raises(InvalidArgumentError):
        device.read(ptr, 4)
    with pytest.raises(InvalidArgumentError):
        device.write(ptr, b"abcd")
    canary.assert_unchanged()


def test_malloc_more_than_total(device, canary, slack):
    total = device.properties().total_nbytes
    request = total + device.granularity_nbytes
    with pytest.raises(OutOfMemoryError) as info:
        device.malloc(request)
    err = info.value
    assert err.requested_nbytes == request
    assert err.total_nbytes == total
    assert abs(err.free_nbytes - canary.free_nbytes) <= slack, (err.free_nbytes, canary.free_nbytes)
    assert isinstance(err, MemoryError) and isinstance(err, GpumemError)
    assert str(request) in str(err)
    canary.assert_unchanged()


@pytest.mark.requires_vmm
def test_mem_create_more_than_total(device, canary, slack):
    total = device.properties().total_nbytes
    request = align_up(total + 1, device.granularity_nbytes)
    with pytest.raises(OutOfMemoryError) as info:
        device.mem_create(request)
    assert info.value.requested_nbytes == request
    assert info.value.total_nbytes == total
    canary.assert_unchanged()


def test_vmm_unsupported(device, canary):
    if device.vmm_supported:
        pytest.skip(f"{device.spec} supports VMM")
    gran = device.granularity_nbytes
    with pytest.raises(UnsupportedOperationError):
        device.address_reserve(gran)
    with pytest.raises(UnsupportedOperationError):
        device.mem_create(gran)
    canary.assert_unchanged()


# -- virtual memory management -----------------------------------------------------------------------------
@pytest.mark.requires_vmm
def test_vmm_non_granular_sizes(device, vmm, canary):
    gran = vmm.gran
    va = vmm.reserve(4)
    h = vmm.create(1)
    before = device.mem_info().free_nbytes
    calls = {
        "reserve gran+1": lambda: device.address_reserve(gran + 1),
        "reserve gran/2": lambda: device.address_reserve(gran // 2),
        "reserve 0": lambda: device.address_reserve(0),
        "reserve -gran": lambda: device.address_reserve(-gran),
        "reserve 1.5*gran": lambda: device.address_reserve(gran * 1.5),
        "reserve bad alignment": lambda: device.address_reserve(gran, 3 * gran),
        "create gran+1": lambda: device.mem_create(gran + 1),
        "create 4096": lambda: device.mem_create(4096),
        "create 0": lambda: device.mem_create(0),
        "create None": lambda: device.mem_create(None),
        "map 4096": lambda: device.mem_map(va, 4096, h),
        "map unaligned va": lambda: device.mem_map(va + 4096, gran, h),
        "map beyond chunk": lambda: device.mem_map(va, 2 * gran, h),
        "map not a handle": lambda: device.mem_map(va, gran, 1),
        "set_access 4096": lambda: device.mem_set_access(va, 4096),
        "unmap gran-1": lambda: device.mem_unmap(va, gran - 1),
        "address_free gran+1": lambda: device.address_free(va, gran + 1),
    }
    wrong = {}
    for name, call in calls.items():
        try:
            call()
        except InvalidArgumentError:
            continue
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "no exception"
    assert not wrong, f"expected InvalidArgumentError: {wrong}"
    canary.assert_unchanged(free_nbytes=before)


@pytest.mark.requires_vmm
def test_map_overlapping_an_existing_mapping(device, vmm, canary, rng):
    gran = vmm.gran
    va = vmm.reserve(6)
    big = vmm.create(2)
    vmm.map(va + gran, big)                # occupies [va+gran, va+3*gran)
    data = rng.randbytes(4096)
    device.write(va + gran, data)
    small, other_big = vmm.create(1), vmm.create(2)
    before = device.mem_info().free_nbytes
    for at, h in ((va + gran, small), (va + 2 * gran, small), (va, other_big), (va + 2 * gran, other_big),
                  (va + gran, big)):
        with pytest.raises(MappingOverlapError):
            device.mem_map(at, h.nbytes, h)
    assert device.read(va + gran, 4096) == data
    canary.assert_unchanged(free_nbytes=before)
    # the free neighbours still map
    vmm.map(va, small)
    vmm.map(va + 3 * gran, other_big)


@pytest.mark.requires_vmm
def test_map_outside_a_reservation(device, vmm, canary):
    gran = vmm.gran
    va = vmm.reserve(4)
    h1, h2 = vmm.create(1), vmm.create(2)
    inside_malloc = canary.large_ptr  # 3 MiB + 123 bytes: covers a whole granule from its aligned start
    aligned_in_malloc = align_up(inside_malloc, gran)
    before = device.mem_info().free_nbytes
    cases = [
        (va + 4 * gran + 1024 * gran, h1),     # far beyond the reservation
        (va + 3 * gran, h2),                   # starts inside, runs past the end
        (va + 4 * gran, h1),                   # just past the end
    ]
    if aligned_in_malloc + gran <= inside_malloc + canary.LARGE:
        cases.append((aligned_in_malloc, h1))  # malloc'd memory is no reservation
    for at, h in cases:
        with pytest.raises(MappingError) as info:
            device.mem_map(at, h.nbytes, h)
        assert not isinstance(info.value, MappingOverlapError), f"{at:#x}: nothing is mapped there"
    canary.assert_unchanged(free_nbytes=before)


@pytest.mark.requires_vmm
def test_unmap_what_is_not_mapped(device, vmm, canary):
    gran = vmm.gran
    va = vmm.reserve(4)
    h = vmm.create(2)
    vmm.map(va, h)
    before = device.mem_info().free_nbytes
    for at, n in ((va + 2 * gran, gran), (va + 3 * gran, gran), (va, gran), (va + gran, gran),
                  (va, 3 * gran), (va + 8 * gran, gran)):
        with pytest.raises(MappingError):
            device.mem_unmap(at, n)
    canary.assert_unchanged(free_nbytes=before)
    vmm.unmap(va, 2 * gran)
    with pytest.raises(MappingError):
        device.mem_unmap(va, 2 * gran)
    with pytest.raises(MappingError):
        device.mem_set_access(va, 2 * gran)


@pytest.mark.requires_vmm
def test_address_free_misuse(device, vmm, canary):
    gran = vmm.gran
    va = vmm.reserve(4)
    h = vmm.create(1)
    vmm.map(va + gran, h)
    before = device.mem_info().free_nbytes
    for at, n in ((va, 4 * gran), (va, 2 * gran), (va + gran, 3 * gran), (canary.large_ptr, 2 * gran)):
        with pytest.raises(MappingError):
            device.address_free(at, n)
    canary.assert_unchanged(free_nbytes=before)
    vmm.unmap(va + gran, gran)
    vmm.address_free(va)
    with pytest.raises(MappingError):
        device.address_free(va, 4 * gran)  # already freed


@pytest.mark.requires_vmm
def test_release_unknown_or_released_handle(device, vmm, canary):
    gran = vmm.gran
    h = vmm.create(1)
    vmm.release(h)
    before = device.mem_info().free_nbytes
    for handle in (h, PhysicalHandle(987_654_321, gran)):
        with pytest.raises(InvalidPointerError):
            device.mem_release(handle)
    va = vmm.reserve(1)
    with pytest.raises(InvalidPointerError):
        device.mem_map(va, gran, h)  # a released handle maps no more
    with pytest.raises(InvalidArgumentError):
        device.mem_release(42)  # not a PhysicalHandle at all
    canary.assert_unchanged(free_nbytes=before)


@pytest.mark.requires_vmm
def test_data_access_outside_accessible_mappings(device, vmm, canary):
    gran = vmm.gran
    va = vmm.reserve(4)
    h1, h2 = vmm.create(1), vmm.create(1)
    vmm.map(va, h1)
    vmm.map(va + gran, h2, access=False)   # mapped, access not set yet
    device.write(va, b"ok")
    before = device.mem_info().free_nbytes
    for ptr, n in ((va + gran, 16),              # no access set
                   (va + gran - 8, 16),          # runs from an accessible into an inaccessible mapping
                   (va + 2 * gran, 16),          # reserved, nothing mapped
                   (va + gran - 8, gran + 16)):  # runs into the unmapped hole
        with pytest.raises(InvalidPointerError):
            device.read(ptr, n)
        with pytest.raises(InvalidPointerError):
            device.write(ptr, b"\0" * n)
    assert device.read(va, 2) == b"ok"
    canary.assert_unchanged(free_nbytes=before)
    device.mem_set_access(va + gran, gran)
    device.write(va + gran - 8, b"x" * 16)
    assert device.read(va + gran - 8, 16) == b"x" * 16
    vmm.unmap(va, gran)
    with pytest.raises(InvalidPointerError):
        device.read(va, 2)
