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
