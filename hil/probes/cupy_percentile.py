"""CuPy's TestQuantile::test_percentile_memory_access (v14.2.0) under gpumem's allocator: the allocator's
memptr.mem.size must be the allocation's size, a multiple of 512 (issue 19)."""
import cupy
import numpy
from cupy import cuda

import gpumem.cupy_allocator as gca

results = {}
with gca.using() as alloc:
    original_allocator = cuda.get_allocator()
    for dtype in (numpy.float16, numpy.float32, numpy.float64):
        sizes = []

        def controlled_allocator(size):
            memptr = original_allocator(size)
            base_size = memptr.mem.size
            sizes.append(base_size)  # a size that is no multiple of 512 fails the check after the run
            item_size = dtype().itemsize
            shape = (base_size // item_size,)
            x = cupy.ndarray(memptr=memptr, shape=shape, dtype=dtype)
            x.fill(cupy.nan)
            return memptr

        cuda.set_allocator(controlled_allocator)
        try:
            a = cupy.array([[10, 7, 4], [3, 2, 1]], dtype)
            q = cupy.array((0, 100), dtype)
            out = cupy.percentile(a, q, axis=None, method="linear")
        finally:
            cuda.set_allocator(original_allocator)
        expected = numpy.percentile(cupy.asnumpy(a), cupy.asnumpy(q), axis=None, method="linear")
        ok = bool(numpy.allclose(cupy.asnumpy(out), expected)) and all(s % 512 == 0 for s in sizes)
        results[numpy.dtype(dtype).name] = (ok, sorted(set(sizes))[:4])
for k, (ok, sizes) in results.items():
    print(f"test_percentile_memory_access[{k}]: {'PASSED' if ok else 'FAILED'} (mem.size seen: {sizes})")
print("all passed" if all(ok for ok, _ in results.values()) else "SOME FAILED")
