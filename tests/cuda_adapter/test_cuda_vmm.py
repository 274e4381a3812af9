"""CudaDevice's virtual memory management over a fake driver: the record, the checks, the errors."""

from __future__ import annotations

import pytest
from cuda_fakes import Fakes, MiB

from gpumem import (
    BackendUnavailableError,
    CudaError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    MappingOverlapError,
    OutOfMemoryError,
    PhysicalHandle,
    UnsupportedOperationError,
)
from gpumem.cuda import VmmUnavailableError

G = 2 * MiB


def test_reserve_create_map_access_copy_unmap_release_free(dev, fakes):
    va = dev.address_reserve(8 * G)
    assert va % G == 0
    h = dev.mem_create(2 * G)
    assert isinstance(h, PhysicalHandle) and h.nbytes == 2 * G and isinstance(h.handle, int)
    dev.mem_map(va + 2 * G, 2 * G, h)
    with pytest.raises(InvalidPointerError, match="no access set"):
        dev.write(va + 2 * G, b"x")
    dev.mem_set_access(va + 2 * G, 2 * G)
    dev.write(va + 4 * G - 3, b"end")
    assert dev.read(va + 4 * G - 3, 3) == b"end"
    assert dev.mapping_ranges() == [(va + 2 * G, 2 * G, h.handle)]
    dev.check_invariants()
    dev.mem_unmap(va + 2 * G, 2 * G)
    dev.mem_release(h)
    dev.address_free(va, 8 * G)
    assert fakes.driver.reservations == {} and fakes.driver.handles == {} and fakes.driver.mappings == {}
    assert fakes.runtime.used_nbytes == 0
    dev.check_invariants()


def test_driver_gets_ints_and_the_drivers_own_handle(dev, fakes):
    va = dev.address_reserve(2 * G)
    h = dev.mem_create(G)
    dev.mem_map(va + G, G, h)
    (name, (mva, size, offset, handle, flags)) = fakes.driver.calls[-1]
    assert name == "cuMemMap" and mva == va + G and size == G and offset == 0 and flags == 0
    assert int(handle) in fakes.driver.handles  # the driver's object, not our PhysicalHandle
    assert not isinstance(handle, PhysicalHandle)


def test_overlapping_map_never_reaches_the_driver(dev, fakes):
    va = dev.address_reserve(8 * G)
    h1, h2 = dev.mem_create(2 * G), dev.mem_create(2 * G)
    dev.mem_map(va + 2 * G, 2 * G, h1)
    before = fakes.driver.count("cuMemMap")
    for at in (va + G * 3, va + G, va + 2 * G):
        with pytest.raises(MappingOverlapError):
            dev.mem_map(at, 2 * G, h2)
    assert fakes.driver.count("cuMemMap") == before
    dev.mem_map(va, 2 * G, h2)  # touching is fine
    dev.check_invariants()


def test_map_outside_or_past_a_reservation(dev, fakes):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(2 * G)
    before = fakes.device_calls()
    with pytest.raises(MappingError, match="runs past"):
        dev.mem_map(va + 3 * G, 2 * G, h)
    with pytest.raises(MappingError, match="not inside an address reservation"):
        dev.mem_map(va + 64 * G, G, h)
    with pytest.raises(MappingError, match="not inside an address reservation"):
        dev.mem_map(va - 64 * G, G, h)
    assert fakes.device_calls() == before


def test_map_argument_checks(dev, fakes):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(2 * G)
    before = fakes.device_calls()
    with pytest.raises(InvalidArgumentError, match="granularity"):
        dev.mem_map(va + 4096, G, h)
    with pytest.raises(InvalidArgumentError, match="granularity"):
        dev.mem_map(va, G, h, offset=4096)
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        dev.mem_map(va, 2 * G, h, offset=G)
    with pytest.raises(InvalidArgumentError, match="PhysicalHandle"):
        dev.mem_map(va, G, h.handle)
    with pytest.raises(InvalidPointerError, match="unknown or released"):
        dev.mem_map(va, G, PhysicalHandle(h.handle + 1, 2 * G))
    with pytest.raises(InvalidPointerError, match="unknown or released"):
        dev.mem_map(va, G, PhysicalHandle(h.handle, 4 * G))  # a forged size
    with pytest.raises(InvalidArgumentError):
        dev.mem_map(va, G + 1, h)
    assert fakes.device_calls() == before
    dev.mem_map(va, G, h, offset=G)
    dev.check_invariants()


def test_granularity_and_alignment_checks(dev, fakes):
    before = fakes.device_calls()
    for bad in (G + 1, 0, -G, 1.0):
        with pytest.raises(InvalidArgumentError):
            dev.address_reserve(bad)
        with pytest.raises(InvalidArgumentError):
            dev.mem_create(bad)
    for bad_alignment in (3 * G, G // 2, -G):
        with pytest.raises(InvalidArgumentError):
            dev.address_reserve(4 * G, bad_alignment)
    assert fakes.device_calls() == before
    va = dev.address_reserve(4 * G, 8 * G)
    assert va % (8 * G) == 0
    assert fakes.driver.calls[-1][1][:2] == (4 * G, 8 * G)


def test_unmap_must_cover_whole_mappings(dev, fakes):
    va = dev.address_reserve(8 * G)
    h = dev.mem_create(4 * G)
    dev.mem_map(va, 4 * G, h)
    before = fakes.device_calls()
    with pytest.raises(MappingError, match="whole mappings"):
        dev.mem_unmap(va, 2 * G)
    with pytest.raises(MappingError, match="whole mappings"):
        dev.mem_unmap(va + 2 * G, 2 * G)
    with pytest.raises(MappingError, match="not mapped"):
        dev.mem_unmap(va + 4 * G, 2 * G)
    with pytest.raises(MappingError, match="not mapped"):
        dev.mem_unmap(va, 6 * G)
    with pytest.raises(MappingError, match="not inside"):
        dev.mem_unmap(va + 100 * G, G)
    assert fakes.device_calls() == before


def test_set_access_is_one_call_and_unmap_one_per_mapping_across_several_mappings(dev, fakes):
    va = dev.address_reserve(8 * G)
    hs = [dev.mem_create(G) for _ in range(3)]
    for i, h in enumerate(hs):
        dev.mem_map(va + i * G, G, h)
    dev.mem_set_access(va, 3 * G)
    assert [c[1][:2] for c in fakes.driver.calls if c[0] == "cuMemSetAccess"] == [(va, 3 * G)]
    dev.write(va + G - 2, b"span")  # one copy across two mappings
    assert dev.read(va + G - 2, 4) == b"span"
    dev.mem_unmap(va, 3 * G)
    assert [c[1] for c in fakes.driver.calls if c[0] == "cuMemUnmap"] == [(va + i * G, G) for i in range(3)]
    assert dev.mapping_ranges() == []
    dev.check_invariants()


def test_set_access_needs_mappings_without_holes(dev, fakes):
    va = dev.address_reserve(8 * G)
    h1, h2 = dev.mem_create(G), dev.mem_create(G)
    dev.mem_map(va, G, h1)
    dev.mem_map(va + 2 * G, G, h2)
    with pytest.raises(MappingError, match="not mapped"):
        dev.mem_set_access(va, 3 * G)
    assert fakes.driver.count("cuMemSetAccess") == 0
    dev.mem_set_access(va, G)
    with pytest.raises(InvalidPointerError, match="not mapped"):
        dev.read(va, 2 * G)  # runs into the hole
    with pytest.raises(InvalidPointerError, match="no access"):
        dev.read(va + 2 * G, 1)


def test_release_while_mapped_keeps_memory_until_unmapped(dev, fakes):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(2 * G)
    dev.mem_map(va, 2 * G, h)
    dev.mem_set_access(va, 2 * G)
    dev.mem_release(h)
    assert fakes.runtime.used_nbytes == 2 * G
    dev.write(va, b"still here")  # the mapping is still good
    assert dev.read(va, 10) == b"still here"
    before = fakes.device_calls()
    with pytest.raises(InvalidPointerError):
        dev.mem_release(h)
    with pytest.raises(InvalidPointerError):
        dev.mem_map(va + 2 * G, G, h)
    assert fakes.device_calls() == before
    dev.check_invariants()
    dev.mem_unmap(va, 2 * G)
    assert fakes.runtime.used_nbytes == 0
    dev.check_invariants()


def test_address_free_checks(dev, fakes):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(G)
    dev.mem_map(va, G, h)
    before = fakes.device_calls()
    with pytest.raises(MappingError, match="still has 1 mapping"):
        dev.address_free(va, 4 * G)
    with pytest.raises(MappingError, match="not 4194304"):
        dev.address_free(va, 2 * G)
    with pytest.raises(MappingError, match="not the base"):
        dev.address_free(va + G, 2 * G)
    assert fakes.device_calls() == before
    dev.mem_unmap(va, G)
    dev.address_free(va, 4 * G)
    with pytest.raises(MappingError):
        dev.address_free(va, 4 * G)
    dev.mem_release(h)


def test_mem_create_out_of_memory_names_the_driver_error(dev, fakes):
    with pytest.raises(OutOfMemoryError) as info:
        dev.mem_create(1024 * G)  # the fake device has 1 GiB
    assert "CUDA_ERROR_OUT_OF_MEMORY" in info.value.hint and info.value.requested_nbytes == 1024 * G
    assert info.value.total_nbytes == fakes.runtime.total_nbytes
    fakes.driver.fail["cuMemCreate"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(OutOfMemoryError, match="CUDA_ERROR_INVALID_VALUE"):
        dev.mem_create(1024 * G)  # more than the device has: out of memory whatever the code
    fakes.driver.fail["cuMemAddressReserve"] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(OutOfMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        dev.address_reserve(G)
    assert dev.reservation_ranges() == []
    dev.check_invariants()


def test_driver_errors_change_nothing(dev, fakes):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(2 * G)
    fakes.driver.fail["cuMemMap"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(CudaError) as info:
        dev.mem_map(va, 2 * G, h)
    assert (info.value.call, info.value.error_name) == ("cuMemMap", "CUDA_ERROR_INVALID_VALUE")
    assert dev.mapping_ranges() == []
    dev.mem_map(va, 2 * G, h)
    fakes.driver.fail["cuMemSetAccess"] = "CUDA_ERROR_NOT_SUPPORTED"
    with pytest.raises(CudaError, match="CUDA_ERROR_NOT_SUPPORTED"):
        dev.mem_set_access(va, 2 * G)
    with pytest.raises(InvalidPointerError, match="no access"):
        dev.read(va, 1)
    fakes.driver.fail["cuMemRelease"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(CudaError):
        dev.mem_release(h)
    dev.mem_map(va + 2 * G, G, h)  # still ours and unreleased
    fakes.driver.fail["cuMemCreate"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(CudaError):
        dev.mem_create(G)
    dev.check_invariants()


def test_unmap_failing_midway_keeps_the_record_true(dev, fakes):
    va = dev.address_reserve(4 * G)
    h1, h2 = dev.mem_create(G), dev.mem_create(G)
    dev.mem_map(va, G, h1)
    dev.mem_map(va + G, G, h2)
    real = fakes.driver.cuMemUnmap
    calls = []

    def second_fails(v, n):
        calls.append(v)
        if len(calls) == 2:
            return (fakes.driver.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return real(v, n)

    fakes.driver.cuMemUnmap = second_fails
    with pytest.raises(CudaError):
        dev.mem_unmap(va, 2 * G)
    assert dev.mapping_ranges() == [(va + G, G, h2.handle)]
    dev.check_invariants()
    fakes.driver.cuMemUnmap = real
    dev.mem_unmap(va + G, G)


def test_device_without_vmm_support():
    f = Fakes(vmm=False)
    dev = f.open()
    assert dev.vmm_supported is False and dev.granularity_nbytes == 2 * MiB
    for call in (lambda: dev.address_reserve(G), lambda: dev.mem_create(G)):
        with pytest.raises(UnsupportedOperationError, match="does not support virtual memory") as info:
            call()
        assert not isinstance(info.value, BackendUnavailableError)
    dev.malloc(64)  # plain allocation still works


def test_missing_cuda_bindings_names_the_extras():
    f = Fakes(vmm=None)
    dev = f.open()
    assert dev.vmm_supported is False
    with pytest.raises(VmmUnavailableError, match=r"gpumem\[cuda12\]") as info:
        dev.address_reserve(G)
    assert isinstance(info.value, UnsupportedOperationError) and isinstance(info.value, BackendUnavailableError)
    with pytest.raises(UnsupportedOperationError):  # before any argument check, as on the simulator
        dev.mem_map(-1, 0, None)


def test_driver_that_cannot_load_disables_vmm(fakes):
    def no_libcuda(flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    fakes.driver.cuInit = no_libcuda
    dev = fakes.open()
    assert dev.vmm_supported is False
    with pytest.raises(UnsupportedOperationError, match="cuInit"):
        dev.address_reserve(G)


def test_other_granularity_is_respected():
    f = Fakes()
    f.driver.gran = 4 * G
    dev = f.open()
    assert dev.granularity_nbytes == 4 * G
    with pytest.raises(InvalidArgumentError):
        dev.mem_create(2 * G)
    dev.mem_create(4 * G)


@pytest.mark.parametrize("ordinal", [0, 2])
def test_set_access_names_every_device_that_can_reach_this_one(ordinal):
    """cuMemMap'd memory is readable only by the devices cuMemSetAccess names: a copy to another GPU
    failed with cudaErrorInvalidValue on two H200s until the peers were named too (Note [Peers read
    mapped memory]). A device that cannot reach this one is left out."""
    f = Fakes(device_count=3)
    blocked = 1 if ordinal == 0 else 0
    f.driver.no_peer_access.add((blocked, ordinal))
    dev = f.open(ordinal)
    va = dev.address_reserve(2 * G)
    h = dev.mem_create(2 * G)
    dev.mem_map(va, 2 * G, h)
    dev.mem_set_access(va, 2 * G)
    others = tuple(d for d in range(3) if d not in (ordinal, blocked))
    assert f.driver.access_ids == [(ordinal, *others)]
    dev.write(va, b"ok")
    assert dev.read(va, 2) == b"ok"


def test_one_gpu_set_access_names_only_itself(dev, fakes):
    va = dev.address_reserve(2 * G)
    dev.mem_map(va, 2 * G, dev.mem_create(2 * G))
    dev.mem_set_access(va, 2 * G)
    assert fakes.driver.access_ids == [(0,)]


@pytest.mark.parametrize("call", ["cuDeviceCanAccessPeer", "cuDeviceGetCount"])
def test_a_peer_query_that_fails_leaves_the_peer_out_and_keeps_vmm(call, caplog):
    """A failed peer query once turned virtual memory off for the whole device (the Python adapter
    treated it as "VMM unavailable"); the native backend skips the peer. Both now keep VMM and warn."""
    from gpumem.allocator import CachingAllocator

    f = Fakes(device_count=2)
    f.driver.fail[call] = "CUDA_ERROR_INVALID_VALUE"
    with caplog.at_level("WARNING", logger="gpumem.cuda.vmm"):
        dev = f.open(0)
    assert dev.vmm_supported
    assert CachingAllocator(dev).uses_vmm
    assert any("no access" in r.getMessage() or "no peer" in r.getMessage() for r in caplog.records)
    va = dev.address_reserve(2 * G)
    dev.mem_map(va, 2 * G, dev.mem_create(2 * G))
    dev.mem_set_access(va, 2 * G)
    assert f.driver.access_ids == [(0,)]
