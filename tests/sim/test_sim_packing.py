"""The cudaMalloc page model, as measured on the H200 (sim/calibrate.py, reports/hil/).

Up to 1 MiB, allocations are packed 512-B aligned into shared 2 MiB pages; larger ones take
whole 2 MiB pages of their own; everything comes back when freed.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

import gpumem
from gpumem import MiB, OutOfMemoryError
from gpumem.sim import SimDevice, Step, custom_profile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALIBRATIONS = sorted(glob.glob(os.path.join(REPO, "reports", "hil", "calibration-h200-*.json")))


@pytest.fixture
def h200():
    with gpumem.open_device("sim:h200-141gb") as dev:
        yield dev


def _free(dev) -> int:
    return dev.mem_info().free_nbytes


def _drops(dev, size: int, count: int = 8):
    base = _free(dev)
    ptrs, drops = [], []
    for _ in range(count):
        ptrs.append(dev.malloc(size))
        drops.append(base - _free(dev))
    return base, ptrs, drops


def test_eight_512_byte_mallocs_take_one_page(h200):
    base, ptrs, drops = _drops(h200, 512)
    assert drops == [2 * MiB] * 8
    assert [p - ptrs[0] for p in ptrs] == [512 * i for i in range(8)]
    assert ptrs[0] % (2 * MiB) == 0
    for p in ptrs:
        h200.free(p)
    assert _free(h200) == base


def test_two_1mib_mallocs_share_a_page(h200):
    base, ptrs, drops = _drops(h200, 1 * MiB, 4)
    assert drops == [2 * MiB, 2 * MiB, 4 * MiB, 4 * MiB]
    assert ptrs[1] == ptrs[0] + 1 * MiB
    for p in ptrs:
        h200.free(p)
    assert _free(h200) == base


@pytest.mark.parametrize("size, pages", [(1 * MiB + 1, 1), (2 * MiB, 1), (2 * MiB + 512, 2), (3 * MiB, 2),
                                         (5 * MiB, 3), (64 * MiB, 32)])
def test_large_mallocs_take_whole_pages(h200, size, pages):
    base, ptrs, drops = _drops(h200, size, 3)
    assert drops == [pages * 2 * MiB * (i + 1) for i in range(3)]
    assert all(p % (2 * MiB) == 0 for p in ptrs)
    for p in ptrs:
        h200.free(p)
    assert _free(h200) == base


@pytest.mark.skipif(not CALIBRATIONS, reason="no H200 calibration record in reports/hil")
def test_reproduces_the_h200_calibration_record():
    record = json.load(open(CALIBRATIONS[-1]))
    dev = gpumem.open_device("sim:h200-141gb")
    assert dev.properties().total_nbytes == record["total"]
    assert dev.mem_info().free_nbytes == record["free_after_context"]
    for size_text, measured in record["malloc_packing"].items():
        size = int(size_text)
        base, ptrs, drops = _drops(dev, size, len(measured["cumulative_free_drop"]))
        assert drops == measured["cumulative_free_drop"], size
        if "ptr_mod_512" in measured:
            assert [p % 512 for p in ptrs] == measured["ptr_mod_512"], size
        for p in ptrs:
            dev.free(p)
        assert base - _free(dev) == measured["free_after_all_freed_drop"], size
    if "vmm_free_drop_for_64_chunks" in record:
        gran = record.get("vmm_granularity", 2 * MiB)
        assert dev.properties().granularity_nbytes == gran
        base = _free(dev)
        handles = [dev.mem_create(gran) for _ in range(64)]
        assert base - _free(dev) == record["vmm_free_drop_for_64_chunks"]
        for h in handles:
            dev.mem_release(h)
    dev.close()


def test_small_mallocs_reuse_gaps_first_fit(h200):
    base = _free(h200)
    ptrs = [h200.malloc(1000) for _ in range(6)]  # spans of 1024 B
    assert [p - ptrs[0] for p in ptrs] == [1024 * i for i in range(6)]
    h200.free(ptrs[2])
    assert h200.malloc(700) == ptrs[2]            # fits the freed gap
    h200.free(ptrs[4])
    big_gap = h200.malloc(1024)
    assert big_gap == ptrs[4]
    assert _free(h200) == base - 2 * MiB
    # a small malloc that fits no gap opens a second page
    h200.malloc(1 * MiB)                          # fill the page with small allocations
    h200.malloc(1 * MiB - 6 * 1024)
    assert _free(h200) == base - 2 * MiB
    before = _free(h200)
    extra = h200.malloc(512)
    assert before - _free(h200) == 2 * MiB and extra % (2 * MiB) == 0


def test_freeing_everything_returns_everything(h200):
    base = _free(h200)
    sizes = [1, 511, 512, 513, 4096, 65_536, 1 * MiB, 1 * MiB + 1, 3 * MiB, 5 * MiB, 64 * MiB] * 3
    ptrs = [h200.malloc(n) for n in sizes]
    assert _free(h200) < base
    assert h200.n_allocations == len(sizes)
    for p in ptrs[::2] + ptrs[1::2]:
        h200.free(p)
    assert _free(h200) == base
    assert h200.process_used_nbytes == 0 and h200.n_allocations == 0
    h200.check_invariants()


def test_oom_between_free_and_total():
    prof = custom_profile("small-64mib", 64 * MiB, base="t4-16gb", context_nbytes=4 * MiB)
    dev = SimDevice(prof)
    free = _free(dev)  # 60 MiB = 30 pages
    ptrs = [dev.malloc(20 * MiB), dev.malloc(20 * MiB)]
    with pytest.raises(OutOfMemoryError) as info:
        dev.malloc(20 * MiB + 1)  # 22 MiB of pages, 20 MiB free
    err = info.value
    assert (err.requested_nbytes, err.free_nbytes, err.total_nbytes) == (20 * MiB + 1, 20 * MiB, 64 * MiB)
    assert _free(dev) == 20 * MiB
    ptrs.append(dev.malloc(20 * MiB))  # exactly what is left
    assert _free(dev) == 0
    with pytest.raises(OutOfMemoryError):
        dev.malloc(1)  # no page left for a small allocation
    for p in ptrs:
        dev.free(p)
    assert _free(dev) == free


def test_a_tenant_makes_malloc_fail():
    prof = custom_profile("small-64mib", 64 * MiB, base="t4-16gb", context_nbytes=4 * MiB)
    dev = SimDevice(prof, pressure=Step(nbytes=50 * MiB, at_s=0.001))
    p = dev.malloc(20 * MiB)  # before the tenant arrives
    dev.advance(0.002)
    assert dev.tenant_nbytes == 0  # 50 MiB did not fit next to our 20 MiB
    dev.free(p)
    dev2 = SimDevice(prof, pressure=Step(nbytes=50 * MiB, at_s=0.001))
    dev2.advance(0.002)
    assert dev2.tenant_nbytes == 50 * MiB
    with pytest.raises(OutOfMemoryError) as info:
        dev2.malloc(20 * MiB)
    assert info.value.free_nbytes == 10 * MiB
    assert dev2.process_used_nbytes == 0
