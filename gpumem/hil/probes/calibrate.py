"""Measure, on a real CUDA device, what the simulator must reproduce.

Prints JSON: how cudaMemGetInfo's free bytes move for cudaMalloc of various sizes
(the physical granularity and any packing of small allocations), and the cost of
each device call (runtime and driver virtual-memory calls), so the simulator's
latency model can be calibrated. Run: ``python -m gpumem.hil.probes.calibrate [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _median_us(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        import cupy
        from cupy.cuda import runtime
        from cuda.bindings import driver
    except ImportError as exc:
        print(f"python -m gpumem.hil.probes.calibrate: needs CuPy and cuda-bindings, which could not be imported "
              f"({exc}); install them with: pip install \"gpumem[cuda13]\" (or \"gpumem[cuda12]\" for CUDA 12.x)",
              file=sys.stderr)
        raise SystemExit(2) from None

    runtime.setDevice(0)
    cupy.cuda.Device(0).use()
    runtime.free(runtime.malloc(512))  # make sure the context exists
    result: dict = {}
    free0, total = runtime.memGetInfo()
    result["total"] = total
    result["free_after_context"] = free0

    # Granularity and packing of cudaMalloc.
    packing = {}
    for size in (512, 4096, 64 * 1024, 1 << 20, (1 << 20) + 1, 2 << 20, (2 << 20) + 512, 3 << 20, 5 << 20, 64 << 20):
        ptrs = []
        f_before = runtime.memGetInfo()[0]
        deltas = []
        for _ in range(8):
            ptrs.append(runtime.malloc(size))
            deltas.append(f_before - runtime.memGetInfo()[0])
        packing[str(size)] = {"cumulative_free_drop": deltas, "ptr_mod_2MiB": [p % (2 << 20) for p in ptrs], "ptr_mod_512": [p % 512 for p in ptrs]}
        for p in ptrs:
            runtime.free(p)
        packing[str(size)]["free_after_all_freed_drop"] = f_before - runtime.memGetInfo()[0]
    result["malloc_packing"] = packing

    costs = {}
    for size in (512, 1 << 20, 64 << 20, 1 << 30):
        costs[f"malloc_free_{size}"] = _median_us(lambda: runtime.free(runtime.malloc(size)), 50 if size < (1 << 30) else 10)
    costs["memGetInfo"] = _median_us(runtime.memGetInfo, 2000)
    costs["getDeviceProperties"] = _median_us(lambda: runtime.getDeviceProperties(0), 20)

    # Driver VMM.
    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(err))
        return res[1] if isinstance(res, tuple) and len(res) == 2 else res

    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = check(driver.cuMemGetAllocationGranularity(prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    result["vmm_granularity"] = int(gran)
    access = driver.CUmemAccessDesc()
    access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = check(driver.cuMemAddressReserve(1 << 30, 0, 0, 0))
    n = 64
    t_create, t_map, t_access, t_unmap, t_release = [], [], [], [], []
    f_before = runtime.memGetInfo()[0]
    handles = []
    for i in range(n):
        t0 = time.perf_counter_ns(); h = check(driver.cuMemCreate(gran, prop, 0)); t1 = time.perf_counter_ns()
        check(driver.cuMemMap(int(va) + i * gran, gran, 0, h, 0)); t2 = time.perf_counter_ns()
        check(driver.cuMemSetAccess(int(va) + i * gran, gran, [access], 1)); t3 = time.perf_counter_ns()
        handles.append(h)
        t_create.append((t1 - t0) / 1e3); t_map.append((t2 - t1) / 1e3); t_access.append((t3 - t2) / 1e3)
    result["vmm_free_drop_for_64_chunks"] = f_before - runtime.memGetInfo()[0]
    for i, h in enumerate(handles):
        t0 = time.perf_counter_ns(); check(driver.cuMemUnmap(int(va) + i * gran, gran)); t1 = time.perf_counter_ns()
        check(driver.cuMemRelease(h)); t2 = time.perf_counter_ns()
        t_unmap.append((t1 - t0) / 1e3); t_release.append((t2 - t1) / 1e3)
    t0 = time.perf_counter_ns(); check(driver.cuMemAddressFree(va, 1 << 30)); t_free = (time.perf_counter_ns() - t0) / 1e3
    t0 = time.perf_counter_ns(); va2 = check(driver.cuMemAddressReserve(1 << 40, 0, 0, 0)); t_res = (time.perf_counter_ns() - t0) / 1e3
    check(driver.cuMemAddressFree(va2, 1 << 40))
    med = statistics.median
    costs.update(cuMemCreate_2MiB=med(t_create), cuMemMap_2MiB=med(t_map), cuMemSetAccess_2MiB=med(t_access),
                 cuMemUnmap_2MiB=med(t_unmap), cuMemRelease_2MiB=med(t_release), cuMemAddressFree_1GiB=t_free,
                 cuMemAddressReserve_1TiB=t_res)
    # big chunk create/map cost
    h = check(driver.cuMemCreate(64 * gran, prop, 0)); va = check(driver.cuMemAddressReserve(64 * gran, 0, 0, 0))
    t0 = time.perf_counter_ns(); check(driver.cuMemMap(va, 64 * gran, 0, h, 0)); t1 = time.perf_counter_ns()
    check(driver.cuMemSetAccess(va, 64 * gran, [access], 1)); t2 = time.perf_counter_ns()
    check(driver.cuMemUnmap(va, 64 * gran)); t3 = time.perf_counter_ns()
    check(driver.cuMemRelease(h)); check(driver.cuMemAddressFree(va, 64 * gran))
    costs.update(cuMemMap_128MiB=(t1 - t0) / 1e3, cuMemSetAccess_128MiB=(t2 - t1) / 1e3, cuMemUnmap_128MiB=(t3 - t2) / 1e3)
    try:
        import pynvml
        pynvml.nvmlInit()
        hdl = pynvml.nvmlDeviceGetHandleByIndex(0)
        costs["nvmlDeviceGetMemoryInfo"] = _median_us(lambda: pynvml.nvmlDeviceGetMemoryInfo(hdl), 500)
        mi = pynvml.nvmlDeviceGetMemoryInfo(hdl)
        result["nvml_total"] = mi.total
        result["nvml_used"] = mi.used
    except Exception as exc:  # noqa: BLE001 - report, this is a probe
        result["nvml_error"] = repr(exc)
    props = runtime.getDeviceProperties(0)
    result["props"] = {k: (v.decode(errors='replace') if isinstance(v, bytes) else v) for k, v in props.items() if isinstance(v, (int, float, bytes, str))}
    result["costs_us"] = costs
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
