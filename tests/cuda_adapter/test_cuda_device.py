"""CudaDevice over fake CUDA libraries: opening, properties, malloc/free, copies, errors, close.

What these prove: the bookkeeping keeps bad input away from CUDA, CUDA's errors
arrive as gpumem exceptions named by CUDA, and close() gives everything back.
What they cannot prove (the real driver's behaviour) the contract suite checks
on the H200 with ``--gpumem-device cuda:0``.
"""

from __future__ import annotations

import logging

import pytest
from cuda_fakes import H200_BANDWIDTH_GBPS, Fakes, GiB, MiB

from gpumem import (
    CudaError,
    DeviceClosedError,
    DeviceKind,
    DeviceNotFoundError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidPointerError,
    MemInfo,
    OutOfMemoryError,
)
from gpumem.cuda import CudaDevice

# -- opening ------------------------------------------------------------------------------------------


def test_open_reads_properties_once(fakes):
    dev = fakes.open()
    props = dev.properties()
    assert props.name == "NVIDIA H200"
    assert props.total_nbytes == fakes.runtime.total_nbytes
    assert props.compute_capability == (9, 0)
    assert props.multiprocessor_count == 132
    assert props.memory_bandwidth_gbps == pytest.approx(H200_BANDWIDTH_GBPS)
    assert props.memory_bandwidth_gbps == pytest.approx(4814.3, abs=0.1)
    assert props.unified_memory is False
    assert props.vmm_supported is True and dev.vmm_supported
    assert props.granularity_nbytes == 2 * MiB == dev.granularity_nbytes
    for _ in range(5):
        assert dev.properties() is props
    assert fakes.runtime.count("cudaGetDeviceProperties") == 1
    assert fakes.runtime.current == 0
    assert dev.spec == "cuda:0" and dev.kind is DeviceKind.CUDA and repr(dev) == "<CudaDevice cuda:0>"


def test_integrated_gpu_has_unified_memory():
    f = Fakes(props={"name": "Orin", "major": 8, "minor": 7, "multiProcessorCount": 16, "integrated": 1,
                     "memoryClockRate": 3_200_000, "memoryBusWidth": 256})
    assert f.open().properties().unified_memory is True


def test_selects_its_device_on_open_and_before_calls():
    f = Fakes(device_count=3)
    dev = f.open(2)
    assert dev.spec == "cuda:2" and f.runtime.current == 2
    f.runtime.current = 0  # someone else switched devices
    dev.malloc(4096)
    assert f.runtime.current == 2


@pytest.mark.parametrize("index", [1, 7])
def test_index_out_of_range_names_the_count(fakes, index):
    with pytest.raises(DeviceNotFoundError, match=r"has 1 \(cuda:0\)"):
        fakes.open(index)


def test_index_out_of_range_with_several_devices():
    with pytest.raises(DeviceNotFoundError, match=r"has 4 \(cuda:0 to cuda:3\)"):
        Fakes(device_count=4).open(4)


def test_no_device_at_all(fakes):
    fakes.runtime.fail["cudaGetDeviceCount"] = "cudaErrorNoDevice"
    with pytest.raises(DeviceNotFoundError, match="no CUDA device"):
        fakes.open(0)


def test_driver_too_old_names_the_extras(fakes):
    fakes.runtime.fail["cudaGetDeviceCount"] = "cudaErrorInsufficientDriver"
    with pytest.raises(CudaError, match=r"gpumem\[cuda12\].*gpumem\[cuda13\]") as info:
        fakes.open(0)
    assert info.value.error_name == "cudaErrorInsufficientDriver"


@pytest.mark.parametrize("index", [-1, True, 0.0, "0", None])
def test_bad_index(fakes, index):
    with pytest.raises(InvalidArgumentError):
        CudaDevice(index, backend=fakes.backend())
    assert fakes.device_calls() == 0


def test_bandwidth_from_attributes_when_props_lack_the_clock():
    """CUDA 13 removed memoryClockRate from cudaDeviceProp: the attribute gives it."""
    f = Fakes(props={"name": b"NVIDIA H200", "major": 9, "minor": 0, "multiProcessorCount": 132, "integrated": 0},
              attributes={36: 3_201_000, 37: 6016})
    assert f.open().properties().memory_bandwidth_gbps == pytest.approx(H200_BANDWIDTH_GBPS)


def test_bandwidth_from_nvml_when_the_attribute_fails_too():
    f = Fakes(props={"name": b"NVIDIA H200", "major": 9, "minor": 0, "multiProcessorCount": 132, "integrated": 0,
                     "memoryBusWidth": 6016})
    assert f.open().properties().memory_bandwidth_gbps == pytest.approx(H200_BANDWIDTH_GBPS)


def test_bandwidth_unknown_is_zero_and_logged(caplog):
    f = Fakes(nvml=False, props={"name": b"X", "major": 9, "minor": 0, "multiProcessorCount": 1, "integrated": 0})
    with caplog.at_level(logging.WARNING, logger="gpumem.cuda.device"):
        assert f.open().properties().memory_bandwidth_gbps == 0.0
    assert "memory_bandwidth_gbps is 0.0" in caplog.text


# -- mem_info, malloc, free --------------------------------------------------------------------------------


def test_mem_info(dev, fakes):
    assert dev.mem_info() == MemInfo(fakes.runtime.total_nbytes, fakes.runtime.total_nbytes)
    dev.malloc(3 * MiB)
    assert dev.mem_info().free_nbytes == fakes.runtime.total_nbytes - 3 * MiB


def test_malloc_write_read_free(dev, fakes):
    p = dev.malloc(1000)
    assert p % 256 == 0
    dev.write(p, b"hello")
    dev.write(p + 995, bytearray(b"world"))
    assert dev.read(p, 5) == b"hello"
    assert dev.read(p + 995, 5) == b"world"
    assert dev.allocation_ranges() == [(p, 1000)] and dev.n_allocations == 1
    dev.free(p)
    assert dev.n_allocations == 0 and fakes.runtime.allocations == {}


def test_write_accepts_memoryview_and_numpy(dev):
    import numpy as np

    p = dev.malloc(64)
    dev.write(p, memoryview(b"abcdefgh")[2:6])
    dev.write(p + 8, np.arange(4, dtype=np.uint16))
    assert dev.read(p, 4) == b"cdef"
    assert dev.read(p + 8, 8) == np.arange(4, dtype=np.uint16).tobytes()


def test_empty_copies_touch_nothing(dev, fakes):
    before = fakes.device_calls()
    assert dev.read(12345, 0) == b""
    dev.write(12345, b"")
    assert fakes.device_calls() == before


def test_double_free_and_wild_pointers_never_reach_cuda(dev, fakes):
    p = dev.malloc(4096)
    dev.free(p)
    before = fakes.runtime.count("cudaFree")
    with pytest.raises(DoubleFreeError):
        dev.free(p)
    with pytest.raises(InvalidPointerError) as info:
        dev.free(p + 0x100000)
    assert not isinstance(info.value, DoubleFreeError)
    q = dev.malloc(4096)
    with pytest.raises(InvalidPointerError, match="not its start"):
        dev.free(q + 256)  # an interior pointer
    assert fakes.runtime.count("cudaFree") == before
    dev.free(q)


def test_a_reused_address_is_not_a_double_free(dev, fakes):
    p = dev.malloc(4096)
    host = fakes.runtime.allocations[p]
    dev.free(p)

    def same_address_again(nbytes):  # CUDA may hand a freed address out again
        fakes.runtime.allocations[p] = host
        return p

    fakes.runtime.malloc = same_address_again
    assert dev.malloc(4096) == p
    dev.free(p)  # live again, so not a double free
    with pytest.raises(DoubleFreeError):
        dev.free(p)


@pytest.mark.parametrize("bad", [0, -4096, 1.5, "0x1000", None, True])
def test_bad_pointers_are_argument_errors(dev, fakes, bad):
    before = fakes.device_calls()
    with pytest.raises(InvalidArgumentError):
        dev.free(bad)
    with pytest.raises(InvalidArgumentError):
        dev.read(bad, 4)
    with pytest.raises(InvalidArgumentError):
        dev.write(bad, b"x")
    assert fakes.device_calls() == before


@pytest.mark.parametrize("bad", [0, -1, 2.0, "8", None, False])
def test_bad_sizes_are_argument_errors(dev, fakes, bad):
    before = fakes.device_calls()
    with pytest.raises(InvalidArgumentError):
        dev.malloc(bad)
    assert fakes.device_calls() == before


def test_write_refuses_non_bytes(dev):
    p = dev.malloc(64)
    with pytest.raises(InvalidArgumentError):
        dev.write(p, "text")
    with pytest.raises(InvalidArgumentError):
        dev.write(p, [1, 2, 3])


def test_copies_outside_allocations_never_reach_cuda(dev, fakes):
    p = dev.malloc(1000)
    q = dev.malloc(1000)
    before = fakes.runtime.count("cudaMemcpy")
    with pytest.raises(InvalidPointerError, match="runs past the end"):
        dev.read(p + 900, 101)
    with pytest.raises(InvalidPointerError, match="runs past the end"):
        dev.write(p, bytes(1001))
    with pytest.raises(InvalidPointerError, match="not inside any allocation"):
        dev.read(max(p, q) + 0x10_0000_0000, 4)
    with pytest.raises(InvalidPointerError, match="not inside any allocation"):
        dev.read(min(p, q) - 4096, 4)
    dev.free(p)
    with pytest.raises(InvalidPointerError):
        dev.read(p, 4)
    assert fakes.runtime.count("cudaMemcpy") == before


# -- CUDA errors -------------------------------------------------------------------------------------------


def test_out_of_memory_names_the_cuda_error(dev, fakes):
    dev.malloc(100 * MiB)
    fakes.runtime.fail["cudaMalloc"] = "cudaErrorMemoryAllocation"
    with pytest.raises(OutOfMemoryError) as info:
        dev.malloc(300 * MiB)
    err = info.value
    assert err.requested_nbytes == 300 * MiB
    assert err.free_nbytes == fakes.runtime.total_nbytes - 100 * MiB
    assert err.total_nbytes == fakes.runtime.total_nbytes
    assert err.device == "cuda:0"
    assert "cudaErrorMemoryAllocation" in err.hint and "cudaErrorMemoryAllocation" in str(err)
    assert dev.n_allocations == 1


def test_real_oom_from_capacity(dev, fakes):
    with pytest.raises(OutOfMemoryError, match="cudaErrorMemoryAllocation"):
        dev.malloc(2 * GiB)
    assert dev.n_allocations == 0


def test_any_error_for_more_than_the_device_has_is_oom(dev, fakes):
    """Whichever error CUDA picks for an impossible size, the caller learns it is out of memory."""
    fakes.runtime.fail["cudaMalloc"] = "cudaErrorInvalidValue"
    with pytest.raises(OutOfMemoryError, match="cudaErrorInvalidValue") as info:
        dev.malloc(fakes.runtime.total_nbytes + 2 * MiB)
    assert info.value.total_nbytes == fakes.runtime.total_nbytes
    fakes.runtime.fail["cudaMalloc"] = "cudaErrorInvalidValue"
    with pytest.raises(CudaError):  # a size that fits: the error stays what it is
        dev.malloc(64)


def test_size_beyond_size_t_is_oom_without_calling_cuda(dev, fakes):
    before = fakes.runtime.count("cudaMalloc")
    with pytest.raises(OutOfMemoryError):
        dev.malloc(2**64)
    assert fakes.runtime.count("cudaMalloc") == before


def test_other_runtime_errors_are_cuda_errors(dev, fakes):
    # (a sticky error such as cudaErrorIllegalAddress loses the device instead: test_cuda_streams.py)
    p = dev.malloc(64)
    fakes.runtime.fail["cudaMemcpy"] = "cudaErrorInvalidValue"
    with pytest.raises(CudaError) as info:
        dev.read(p, 4)
    assert info.value.call == "cudaMemcpy"
    assert info.value.error_name == "cudaErrorInvalidValue"
    assert "invalid argument" in str(info.value)
    fakes.runtime.fail["cudaFree"] = "cudaErrorInvalidValue"
    with pytest.raises(CudaError):
        dev.free(p)
    assert dev.allocation_ranges() == [(p, 64)]  # still ours: CUDA did not free it
    dev.free(p)
    fakes.runtime.fail["cudaDeviceSynchronize"] = "cudaErrorInvalidResourceHandle"
    with pytest.raises(CudaError, match="cudaDeviceSynchronize failed: cudaErrorInvalidResourceHandle"):
        dev.synchronize()
    dev.synchronize()


def test_mem_info_error(dev, fakes):
    fakes.runtime.fail["cudaMemGetInfo"] = "cudaErrorInvalidValue"
    with pytest.raises(CudaError, match="cudaMemGetInfo"):
        dev.mem_info()


# -- close -------------------------------------------------------------------------------------------------


def test_close_frees_everything_and_is_idempotent(fakes):
    dev = fakes.open()
    ptrs = [dev.malloc(n) for n in (256, 5 * MiB, 1)]
    dev.free(ptrs[0])
    va = dev.address_reserve(8 * MiB)
    h1, h2, h3 = dev.mem_create(2 * MiB), dev.mem_create(4 * MiB), dev.mem_create(2 * MiB)
    dev.mem_map(va, 2 * MiB, h1)
    dev.mem_map(va + 2 * MiB, 4 * MiB, h2)
    dev.mem_set_access(va, 6 * MiB)
    dev.mem_release(h1)
    dev.address_reserve(2 * MiB)
    assert fakes.runtime.used_nbytes > 0
    dev.close()
    assert fakes.runtime.allocations == {}
    assert fakes.driver.mappings == {} and fakes.driver.handles == {} and fakes.driver.reservations == {}
    assert fakes.runtime.used_nbytes == 0
    n_calls = fakes.device_calls()
    dev.close()
    assert dev.closed and fakes.device_calls() == n_calls
    del h3


def test_calls_after_close_raise(fakes):
    dev = fakes.open()
    p = dev.malloc(64)
    dev.close()
    before = fakes.device_calls()
    for call in (lambda: dev.malloc(64), dev.mem_info, dev.synchronize, lambda: dev.free(p),
                 lambda: dev.read(p, 1), lambda: dev.write(p, b"x"), lambda: dev.address_reserve(2 * MiB),
                 lambda: dev.mem_create(2 * MiB), dev.other_processes):
        with pytest.raises(DeviceClosedError):
            call()
    assert fakes.device_calls() == before
    assert dev.properties().name == "NVIDIA H200"  # cached, like the simulator's


def test_close_goes_on_after_cuda_errors(fakes, caplog):
    dev = fakes.open()
    p, q = dev.malloc(64), dev.malloc(64)
    fakes.runtime.fail["cudaFree"] = "cudaErrorIllegalAddress"
    with caplog.at_level(logging.WARNING, logger="gpumem.cuda.device"):
        dev.close()
    assert "cudaFree" in caplog.text
    assert len(fakes.runtime.allocations) == 1  # the one CUDA refused; the other was freed
    del p, q


def test_context_manager(fakes):
    with fakes.open() as dev:
        dev.malloc(64)
    assert dev.closed and fakes.runtime.allocations == {}


def test_failed_open_leaves_nothing_to_close(fakes):
    fakes.runtime.fail["cudaGetDeviceProperties"] = "cudaErrorInvalidDevice"
    with pytest.raises(CudaError):
        fakes.open()
