"""gpumem as RMM's memory resource on a real CUDA device (issue 19, point 4): only where RMM and a GPU are.

Without a GPU these are skipped; ``test_rmm_resource.py`` runs the resource's logic on the simulator.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

rmm = pytest.importorskip("rmm", reason="RMM (rmm-cu13/rmm-cu12) is not installed here")
grr = pytest.importorskip("gpumem.rmm_resource")


@pytest.fixture()
def resource():
    with grr.using(0) as mr:
        yield mr
    gc.collect()
    assert mr.check().ok


def test_install_is_one_resource_per_device_on_the_native_engine(resource):
    assert grr.installed_resource(0) is resource and grr.install(0) is resource
    assert rmm.mr.get_current_device_resource() is resource
    assert "native" in repr(resource)


def test_device_buffers_hold_their_data(resource):
    before = resource.allocator.allocated_nbytes()
    payloads = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()
                for i, n in enumerate((1, 511, 4096, 3 << 20))]
    bufs = [rmm.DeviceBuffer.to_device(p) for p in payloads]
    assert resource.allocator.allocated_nbytes() > before, "RMM did not allocate through gpumem"
    assert [b.tobytes() for b in bufs] == payloads
    del bufs
    gc.collect()
    assert resource.allocator.allocated_nbytes() == before


def test_free_on_another_stream_is_stream_ordered(resource):
    """Note [RMM's stream-ordered contract]: a block freed on a busy stream s2 is not handed out on its
    allocation stream s1 before s2's work at the free has run."""
    cupy = pytest.importorskip("cupy")
    from rmm.pylibrmm.stream import Stream

    s1 = Stream()
    busy = cupy.cuda.Stream(non_blocking=True)
    s2 = Stream(busy)
    nbytes = 8 << 20
    raw = resource.allocate(nbytes, s1)
    with busy:                      # tens of milliseconds of work on s2, queued before the free
        m = cupy.ones((4096, 4096), dtype=cupy.float32)
        for _ in range(30):
            m = m @ m * 1e-4
    resource.deallocate(raw, nbytes, s2)
    again = resource.allocate(nbytes, s1)
    still_busy = not busy.done
    resource.deallocate(again, nbytes, s1)
    busy.synchronize()
    del m
    resource.allocator.empty_cache()   # while s1 and s2 live (Note [Streams outlive the engine's use of them])
    assert still_busy, "the work on s2 ended before the test could look: make it longer"
    assert again != raw, "a block still in use on the stream RMM freed it on was handed out again"
    assert resource.check().ok


def test_cupy_through_rmm_matches_cupys_pool(resource):
    cupy = pytest.importorskip("cupy")
    from rmm.allocators.cupy import rmm_cupy_allocator

    def compute():
        rng = np.random.default_rng(0)
        a = cupy.asarray(rng.standard_normal((512, 384), dtype=np.float32))
        b = cupy.asarray(rng.standard_normal((384, 256), dtype=np.float32))
        v = cupy.asarray(rng.standard_normal(1 << 20))
        return (a @ b).get(), cupy.sort(v).get(), float(cupy.sum(v * v))

    expected = compute()
    before = resource.allocator.peaks()["num_allocs"]
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        got = compute()
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    assert resource.allocator.peaks()["num_allocs"] > before, "CuPy did not allocate through gpumem"
    for e, g in zip(expected, got):
        assert np.array_equal(np.asarray(e), np.asarray(g))


def test_out_of_memory_is_memory_error_and_changes_nothing(resource):
    before = (resource.allocator.allocated_nbytes(), resource.allocator.reserved_nbytes())
    with pytest.raises(MemoryError):
        rmm.DeviceBuffer(size=1 << 50)
    assert (resource.allocator.allocated_nbytes(), resource.allocator.reserved_nbytes()) == before
