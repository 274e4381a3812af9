"""Free memory under a running kernel on a real GPU, with and without the allocator's stream fences.

A CuPy kernel sums a 4 MiB block for about 50 ms on a non-default stream while the block is freed
and its memory goes back to the device: ``--path steal`` (its pages are stolen by the next
allocation) or ``--path release`` (``empty_cache()``). With the allocator as it is, the memory goes
back only once the kernel is done (Note [Stream-ordered frees] in :mod:`gpumem.allocator.fences`).
``--old`` switches the fences off, as the allocator was before issue 6, so the pages are unmapped
while the kernel still reads them: run it under ``compute-sanitizer --tool memcheck`` to see the
invalid reads it makes (it may also kill the context). Prints one JSON line::

    python -m hil.probes.inflight --path release [--old] [--device cuda:0]

The pytest twin is ``tests/allocator/test_inflight_kernel.py`` (fences on only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.fences import StreamFences
from gpumem.allocator.policy import GrowthRule, get_policy
from gpumem.units import MiB

#: gpumem's policy with one-page chunks and no slack: a freed page is stolen at once when another block
#: needs one under the limit (the default grows by chunks and creates within its slack instead).
PAGE_STEALS = dataclasses.replace(get_policy("gpumem"), name="gpumem-pages", growth=GrowthRule.PAGES, page_slack=0.0)

SLOW_SUM_SOURCE = r"""
// Sums x[0..n) again and again until spin_cycles have passed (volatile: every pass really loads x).
extern "C" __global__ void slow_sum(const double* x, long long n, long long spin_cycles, double* out) {
    __shared__ double part[256];
    const volatile double* vx = x;
    long long start = clock64();
    double s;
    do {
        s = 0.0;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) s += vx[i];
    } while (clock64() - start < spin_cycles);
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int t = 0; t < blockDim.x; ++t) total += part[t];
        out[0] = total;
    }
}
"""
BLOCK_NBYTES = 4 * MiB
N = BLOCK_NBYTES // 8
EXPECTED = float(N * (N - 1) // 2)  # exact in float64: every partial sum is an integer below 2**53
SPIN_CYCLES = 100_000_000  # about 50 ms at 2 GHz


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hil.probes.inflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=["steal", "release"], required=True,
                        help="how the freed block's memory goes back to the device")
    parser.add_argument("--old", action="store_true", help="switch the stream fences off (the pre-issue-6 allocator)")
    parser.add_argument("--device", default="cuda:0", help="a CUDA device spec (default cuda:0)")
    args = parser.parse_args(argv)
    try:
        import cupy  # noqa: PLC0415 - a real-GPU probe
    except ImportError as exc:
        print(f"python -m hil.probes.inflight: needs CuPy, which could not be imported ({exc}); install it "
              f"with: pip install \"gpumem[cuda13]\" (or \"gpumem[cuda12]\" for CUDA 12.x)", file=sys.stderr)
        return 2

    if args.old:
        StreamFences.done = lambda self, stream, number: True  # type: ignore[method-assign]
        StreamFences.wait = lambda self, stream, number: None  # type: ignore[method-assign]
    device = open_device(args.device)
    limit = 12 * MiB if args.path == "steal" else None
    # the Python engine: --old switches its fences off; the steal path needs page steals (PAGE_STEALS)
    alloc = CachingAllocator(device, PAGE_STEALS if args.path == "steal" else "gpumem", limit=limit, engine="python")
    stream = device.stream_create()
    result: dict[str, object] = {"path": args.path, "old": args.old, "device": args.device}
    block = alloc.allocate(BLOCK_NBYTES, stream)
    out = alloc.allocate(8, stream)
    device.write(block, np.arange(N, dtype=np.float64).tobytes())
    device.write(out, np.zeros(1).tobytes())

    def array(ptr: int, n: int):
        mem = cupy.cuda.UnownedMemory(ptr, n * 8, alloc)
        return cupy.ndarray((n,), dtype=cupy.float64, memptr=cupy.cuda.MemoryPointer(mem, 0))

    cstream = cupy.cuda.ExternalStream(stream)
    with cstream:
        cupy.RawKernel(SLOW_SUM_SOURCE, "slow_sum")((1,), (256,), (array(block, N), np.int64(N), np.int64(SPIN_CYCLES),
                                                           array(out, 1)))
        done = cstream.record()
    result["kernel_running_at_free"] = not done.done
    if args.path == "steal":
        keep = alloc.allocate(2 * MiB, stream)
        steals = alloc.backing.n_steals
        alloc.free(block)
        alloc.allocate(8 * MiB, stream)
        result["pages_stolen"] = alloc.backing.n_steals - steals
        del keep
    else:
        alloc.free(block)
        result["released_nbytes"] = alloc.empty_cache()
    result["kernel_done_when_memory_went_back"] = done.done
    try:
        device.synchronize()
        total = float(np.frombuffer(device.read(out, 8), dtype=np.float64)[0])
        result.update(context_healthy=True, sum=total, sum_right=total == EXPECTED)
    except Exception as exc:  # noqa: BLE001 - the point of --old is to show what breaks
        result.update(context_healthy=False, error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(result))
    return 0 if result.get("sum_right") else 1


if __name__ == "__main__":
    sys.exit(main())
