"""Real CuPy programs running on gpumem's allocator (only on a real CUDA device)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from gpumem.allocator import CachingAllocator
from hil.sanitizer import SANITIZER_ENV_VAR

pytestmark = pytest.mark.cuda


def test_cupy_array_work_matches_numpy(device):
    cupy = pytest.importorskip("cupy")
    import gpumem.cupy_allocator as gca

    alloc = CachingAllocator(device, "gpumem")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 384)).astype(np.float32)
    b = rng.standard_normal((384, 256)).astype(np.float32)
    v = rng.standard_normal(1 << 20)
    plans = cupy.fft.config.get_plan_cache()
    plan_cache_size = plans.get_size()
    plans.set_size(0)  # no cuFFT plan (each holds a work area from gpumem) outlives its call; restored below
    with gca.using(alloc):
        ga, gb, gv = cupy.asarray(a), cupy.asarray(b), cupy.asarray(v)
        assert alloc.stats.num_allocs >= 3, "CuPy did not allocate through gpumem"
        prod = cupy.asnumpy(ga @ gb)
        fft = cupy.asnumpy(cupy.fft.rfft(gv))
        total = float(cupy.sum(gv * gv))
        srt = cupy.asnumpy(cupy.sort(gv))
        for _ in range(50):  # churn: temporaries of changing shapes
            n = int(rng.integers(1, 1 << 18))
            x = cupy.arange(n, dtype=cupy.float64)
            assert float(x.sum()) == n * (n - 1) / 2
        del ga, gb, gv, x
        gc.collect()
    plans.set_size(plan_cache_size)
    np.testing.assert_allclose(prod, a @ b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(fft, np.fft.rfft(v), rtol=1e-6, atol=1e-6)
    assert total == pytest.approx(float(np.sum(v * v)), rel=1e-9)
    np.testing.assert_array_equal(srt, np.sort(v))
    cupy.cuda.get_current_stream().synchronize()
    gc.collect()
    live = {ptr for ptr, _ in alloc.live_blocks()}
    held = _blocks_cupy_still_holds(gca, alloc)
    assert live == held, (f"gpumem's live blocks {sorted(live)} are not the ones CuPy still holds {sorted(held)}: "
                          "a block CuPy dropped was not returned, or one CuPy still uses was freed")
    if not os.environ.get(SANITIZER_ENV_VAR):  # under compute-sanitizer, see Note [Python frames under the sanitizer]
        assert not held, f"CuPy still holds blocks of {sorted(n for _, n in alloc.live_blocks())} bytes"
    alloc.close()


def _blocks_cupy_still_holds(gca, alloc) -> set[int]:
    """The blocks of ``alloc`` whose owner (kept by CuPy's memory object, freeing the block when it goes) is alive."""
    return {o.ptr for o in gc.get_objects() if type(o) is gca._BlockOwner and o.allocator is alloc}


def test_cupy_on_the_native_engine(device_spec):
    """gpumem.cupy_allocator.install() on a GPU puts the native engine over the driver in CuPy (issue 19): the
    block's size in mem.size, one engine per device, stream-ordered frees, CuPy's OutOfMemoryError, and the
    engine consistent after array work."""
    cupy = pytest.importorskip("cupy")
    import gpumem.cupy_allocator as gca
    from gpumem.native import engine, native_module

    if not device_spec.startswith("cuda") or engine() != "native":
        pytest.skip("needs a CUDA device and gpumem's native engine")
    index = int(device_spec.partition(":")[2] or 0)
    rng = np.random.default_rng(1)
    v = rng.standard_normal(1 << 18)
    plans = cupy.fft.config.get_plan_cache()
    plan_cache_size = plans.get_size()
    plans.set_size(0)
    with cupy.cuda.Device(index), gca.using() as alloc:
        assert type(alloc) is native_module().CudaAllocator
        hook = cupy.cuda.get_allocator()
        assert type(hook) is native_module().CupyAllocator
        before = alloc.allocated_nbytes()
        for n in (1, 16, 511, 513, 4097, 3 << 20):
            p = cupy.cuda.alloc(n)
            assert p.mem.size == alloc.block_size(p.ptr) and p.mem.size % 512 == 0 and p.mem.size >= n
            assert p.device_id == index and type(p.mem._owner).__name__ == "CupyBlock" and p.mem._owner.ptr == p.ptr
        del p
        assert cupy.cuda.alloc(0).ptr == 0
        gv = cupy.asarray(v)
        np.testing.assert_allclose(cupy.asnumpy(cupy.fft.rfft(gv)), np.fft.rfft(v), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(cupy.asnumpy(cupy.sort(gv)), np.sort(v))
        side = cupy.cuda.Stream(non_blocking=True)
        with side:   # a block allocated on a side stream is that stream's (stream-ordered free)
            s = cupy.arange(1 << 20, dtype=cupy.float32)
            assert float(s.sum()) == pytest.approx((1 << 20) * ((1 << 20) - 1) / 2, rel=1e-6)
        side.synchronize()
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as oom:
            cupy.empty(1 << 50, dtype=cupy.uint8)
        assert type(oom.value.__cause__).__name__ == "OutOfMemoryError"
        del gv, s
        gc.collect()
        cupy.cuda.get_current_stream().synchronize()
        assert alloc.allocated_nbytes() == before, "a block CuPy dropped was not given back"
        checks = gca.check_installed(raise_on_problem=True)
        assert [c.engine for c in checks] == ["native"] and checks[0].device == index
    plans.set_size(plan_cache_size)


def test_cupy_hook_cache_hits_have_the_blocks_size_and_usable_memory(device_spec):
    """The hot path of the native hook (issue 19): a cache hit hands CuPy the block's size read under the
    allocation's lock, also for a block over several pages that fell empty and stayed mapped (Note [A quiet
    commit] in gpumem.allocator.backing); the memory is usable and the engine consistent after."""
    cupy = pytest.importorskip("cupy")
    import gpumem.cupy_allocator as gca
    from gpumem.native import engine

    if not device_spec.startswith("cuda") or engine() != "native":
        pytest.skip("needs a CUDA device and gpumem's native engine")
    index = int(device_spec.partition(":")[2] or 0)
    with cupy.cuda.Device(index), gca.using() as alloc:
        for n in (1, 700, 4097, 3 << 20, 64 << 20):
            for _ in range(3):   # the first may grow; the next ones are cache hits
                p = cupy.cuda.alloc(n)
                assert p.mem.size == alloc.block_size(p.ptr) and p.mem.size % 512 == 0 and p.mem.size >= n
                del p
        calls = None
        for _ in range(4):   # 64 MiB over pages mapped and empty: memory usable end to end, and once the
            a = cupy.ones(64 << 18, dtype=cupy.float32)   # sum's own buffers are grown, no device call
            assert float(a.sum()) == float(64 << 18)
            del a
            cupy.cuda.get_current_stream().synchronize()
            if calls is None:
                calls = alloc.peaks()["device_calls"]
        assert alloc.peaks()["device_calls"] == calls
        gca.check_installed(raise_on_problem=True)


def test_cupy_hook_reads_cupys_current_stream_and_device(device_spec):
    """Note [CuPy's stream in C]: on CuPy 14 the hook reads the stream through cupy_backends' get_stream_ptr
    with the device it found (the current context's); both are what CuPy's own functions say, on the null
    stream and in a side stream, on every device."""
    cupy = pytest.importorskip("cupy")
    import gpumem.cupy_allocator as gca
    from gpumem.native import engine

    if not device_spec.startswith("cuda") or engine() != "native":
        pytest.skip("needs a CUDA device and gpumem's native engine")
    hook = gca.native_hook()
    if int(cupy.__version__.split(".")[0]) >= 14:
        assert hook.reads_stream_by_device()
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        with cupy.cuda.Device(d):
            assert hook.current_device() == d == cupy.cuda.runtime.getDevice()
            assert hook.current_stream() == cupy.cuda.get_current_stream().ptr
            side = cupy.cuda.Stream(non_blocking=True)
            with side:
                assert hook.current_stream() == side.ptr == cupy.cuda.get_current_stream().ptr
            assert hook.current_stream() == cupy.cuda.get_current_stream().ptr
