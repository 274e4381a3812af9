"""A kernel still reading a block while the allocator frees it and gives its memory away (issue 6,
point 3), on a real GPU.

On the H200, a kernel reading a mapped page followed at once by ``cuMemUnmap`` returned success and
the next synchronize returned ``CUDA_ERROR_ILLEGAL_ADDRESS``: the context was dead. The allocator now
records an event when the memory goes back and waits for it (Note [Stream-ordered frees] in
:mod:`gpumem.allocator.fences`). Here a CuPy RawKernel sums a 4 MiB block for about 50 ms (it spins
on ``clock64`` and re-reads the buffer until then) on a non-default stream while the block is freed
and (a) its pages are stolen by the next allocation, (b) ``empty_cache()`` runs. Afterwards the
context is healthy (synchronize succeeds) and the sum is right.

The simulator twin of these tests is ``tests/allocator/test_allocator_streams.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpumem.allocator import CachingAllocator
from hil.probes.inflight import BLOCK_NBYTES, EXPECTED, N, PAGE_STEALS, SLOW_SUM_SOURCE, SPIN_CYCLES
from gpumem.units import MiB

pytestmark = pytest.mark.cuda

# the kernel and its figures are the probe's, so the test and `python -m hil.probes.inflight`
# run the very same scenario


def _array(cupy, ptr: int, n: int, owner: object):
    mem = cupy.cuda.UnownedMemory(ptr, n * 8, owner)
    return cupy.ndarray((n,), dtype=cupy.float64, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _start_reader(cupy, device, alloc: CachingAllocator, stream: int):
    """Allocate and fill the block, launch the slow sum on ``stream``; return (block, out, done event)."""
    block = alloc.allocate(BLOCK_NBYTES, stream)
    out = alloc.allocate(8, stream)
    device.write(block, np.arange(N, dtype=np.float64).tobytes())
    device.write(out, np.zeros(1).tobytes())
    kernel = cupy.RawKernel(SLOW_SUM_SOURCE, "slow_sum")
    cstream = cupy.cuda.ExternalStream(stream)
    with cstream:
        kernel((1,), (256,), (_array(cupy, block, N, alloc), np.int64(N), np.int64(SPIN_CYCLES),
                              _array(cupy, out, 1, alloc)))
        done = cstream.record()
    assert not done.done, "the kernel finished before the test could free its block"
    return block, out, done


def _finish(cupy, device, alloc: CachingAllocator, out: int, done) -> None:
    device.synchronize()  # CUDA_ERROR_ILLEGAL_ADDRESS here if memory went away under the kernel
    assert done.done
    total = np.frombuffer(device.read(out, 8), dtype=np.float64)[0]
    assert total == EXPECTED, f"the kernel read wrong data: {total} != {EXPECTED}"
    alloc.free(out)


def test_steal_under_a_running_kernel(device):
    cupy = pytest.importorskip("cupy")
    # 12 MiB: the block (2 pages), `out` and `keep` (1 page each) and 2 new pages of `other`; the
    # other 2 pages of `other` must be stolen from the block (no room to create them instead)
    if not device.vmm_supported or device.granularity_nbytes != 2 * MiB:
        pytest.skip("the steal path needs virtual memory management with 2 MiB pages")
    # one-page chunks, no slack, the Python engine (whose backing counts steals): the steal path itself
    alloc = CachingAllocator(device, PAGE_STEALS, limit=12 * MiB, engine="python")
    stream = device.stream_create()
    try:
        block, out, done = _start_reader(cupy, device, alloc, stream)
        keep = alloc.allocate(2 * MiB, stream)  # a live page above the block: it is not the range's top
        steals = alloc.backing.n_steals
        alloc.free(block)
        other = alloc.allocate(8 * MiB, stream)  # 4 pages: 2 created, 2 stolen from the freed block
        assert alloc.backing.n_steals == steals + 2, "the scenario did not steal the block's pages"
        assert done.done, "a page was stolen before the kernel reading it was done"
        _finish(cupy, device, alloc, out, done)
        alloc.free(other)
        alloc.free(keep)
        alloc.check_consistency()
    finally:
        alloc.close()
        device.stream_destroy(stream)


@pytest.mark.parametrize("policy", ["gpumem", "pytorch"])
def test_empty_cache_under_a_running_kernel(device, policy):
    cupy = pytest.importorskip("cupy")
    alloc = CachingAllocator(device, policy)
    stream = device.stream_create()
    try:
        block, out, done = _start_reader(cupy, device, alloc, stream)
        alloc.free(block)
        released = alloc.empty_cache()
        assert released > 0, "empty_cache gave nothing back: the scenario tests nothing"
        assert done.done, "memory went back to the device before the kernel reading it was done"
        _finish(cupy, device, alloc, out, done)
        alloc.check_consistency()
    finally:
        alloc.close()
        device.stream_destroy(stream)
