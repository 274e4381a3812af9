"""The latency model: every call moves the simulated clock by its calibrated cost."""

from __future__ import annotations

import time

import pytest

import gpumem
from gpumem import GiB, InvalidArgumentError, InvalidPointerError, MiB, OutOfMemoryError
from gpumem.sim import LatencyModel, PeriodicSpikes, SimDevice, custom_profile, get_profile

US = 1e-6


@pytest.fixture
def dev():
    with gpumem.open_device("sim:h200-141gb") as d:
        yield d


def _cost_us(dev, fn) -> float:
    t0 = dev.now_s
    fn()
    return (dev.now_s - t0) / US


def test_malloc_free_pair_costs(dev):
    for size, pair_us in ((512, 89.0), (1 * MiB, 89.0), (64 * MiB, 153.0), (1 * GiB, 838.0)):
        ptr = None

        def alloc():
            nonlocal ptr
            ptr = dev.malloc(size)

        malloc_us = _cost_us(dev, alloc)
        free_us = _cost_us(dev, lambda: dev.free(ptr))
        assert malloc_us + free_us == pytest.approx(pair_us, abs=1e-6), size
        assert malloc_us == pytest.approx(pair_us * dev.latency.malloc_share, abs=1e-6)


def test_interpolation_and_extrapolation():
    lat = LatencyModel()
    assert lat.malloc_free_us(0) == 89.0
    assert lat.malloc_free_us(32 * MiB) == pytest.approx(89.0 + 64.0 * (31 / 63))
    assert lat.malloc_free_us(2 * GiB) == pytest.approx(838.0 + (838.0 - 153.0) * GiB / (GiB - 64 * MiB))
    sizes = [1, MiB, 2 * MiB, 64 * MiB, 100 * MiB, GiB, 4 * GiB]
    costs = [lat.malloc_free_us(n) for n in sizes]
    assert costs == sorted(costs)


def test_mem_info_and_other_calls(dev):
    assert _cost_us(dev, dev.mem_info) == pytest.approx(6.5)
    assert _cost_us(dev, dev.synchronize) == pytest.approx(2.0)
    assert _cost_us(dev, dev.properties) == 0.0  # cached, as gpumem's CudaDevice caches it
    gran = dev.granularity_nbytes
    va = handle = None

    def reserve():
        nonlocal va
        va = dev.address_reserve(4 * gran)

    def create():
        nonlocal handle
        handle = dev.mem_create(gran)

    assert _cost_us(dev, reserve) == pytest.approx(13.4)
    assert _cost_us(dev, create) == pytest.approx(10.5)
    assert _cost_us(dev, lambda: dev.mem_map(va, gran, handle)) == pytest.approx(2.0)
    assert _cost_us(dev, lambda: dev.mem_set_access(va, gran)) == pytest.approx(27.2)
    assert _cost_us(dev, lambda: dev.mem_unmap(va, gran)) == pytest.approx(17.0)
    assert _cost_us(dev, lambda: dev.mem_release(handle)) == pytest.approx(11.4)
    assert _cost_us(dev, lambda: dev.address_free(va, 4 * gran)) == pytest.approx(16.2)


def test_copies_cost_launch_plus_bandwidth(dev):
    ptr = dev.malloc(8 * MiB)
    bw = dev.properties().memory_bandwidth_gbps
    n = 4 * MiB
    assert _cost_us(dev, lambda: dev.write(ptr, bytes(n))) == pytest.approx(8.0 + n / (bw * 1e3))
    assert _cost_us(dev, lambda: dev.read(ptr, n)) == pytest.approx(8.0 + n / (bw * 1e3))
    assert _cost_us(dev, lambda: dev.write(ptr, b"")) == 0.0
    dev.free(ptr)


def test_rejected_calls_cost_nothing(dev):
    for bad in (lambda: dev.malloc(-1), lambda: dev.free(0), lambda: dev.read(0x10, 4),
                lambda: dev.free(0x7000)):
        t0 = dev.now_s
        with pytest.raises((InvalidArgumentError, InvalidPointerError)):
            bad()
        assert dev.now_s == t0


def test_an_impossible_malloc_does_not_simulate_for_ages():
    """A request far beyond the device is charged at most the cost of a device-sized one."""
    prof = get_profile("t4-16gb")
    dev = SimDevice(prof, pressure=PeriodicSpikes(nbytes=1 * GiB, period_s=1e-3, spike_s=1e-4))
    t0 = time.perf_counter()
    with pytest.raises(OutOfMemoryError):
        dev.malloc(2**62)
    assert time.perf_counter() - t0 < 2.0
    assert dev.now_s <= prof.latency.malloc_us(prof.total_nbytes) * US + 1e-12


def test_stats_count_calls(dev):
    ptr = dev.malloc(4096)
    dev.write(ptr, b"x")
    dev.read(ptr, 1)
    dev.free(ptr)
    dev.mem_info()
    assert dev.stats.calls == {"malloc": 1, "write": 1, "read": 1, "free": 1, "mem_info": 1}
    assert dev.stats.busy_us == pytest.approx(dev.now_s / US)


def test_custom_latency_model():
    prof = custom_profile("slow-card", 8 * GiB, latency=LatencyModel(mem_get_info_us=100.0,
                                                                     malloc_free_points=((0, 1000.0), (GiB, 1000.0))))
    dev = SimDevice(prof)
    assert _cost_us(dev, dev.mem_info) == pytest.approx(100.0)
    ptr = None

    def alloc():
        nonlocal ptr
        ptr = dev.malloc(MiB)

    assert _cost_us(dev, alloc) + _cost_us(dev, lambda: dev.free(ptr)) == pytest.approx(1000.0)


def test_advance(dev):
    dev.advance(0.25)
    assert dev.now_s == pytest.approx(0.25)
    dev.advance(0)
    assert dev.now_s == pytest.approx(0.25)
    with pytest.raises(InvalidArgumentError):
        dev.advance(-1)
