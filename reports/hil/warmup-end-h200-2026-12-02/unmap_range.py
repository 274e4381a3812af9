"""Can one ``cuMemUnmap`` cover several adjacent mappings, each of its own ``cuMemCreate``, and what does it cost
against one call per mapping? (The give-back at the warm-up's end unmaps about 6,300 one-page chunks one by one.)
Run on a CUDA machine with cuda-bindings: ``python reports/hil/warmup-end-h200-2026-12-02/unmap_range.py``."""

from __future__ import annotations

import time

from cuda.bindings import driver as cu


def check(result):
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


def main(n_pages: int = 2048, rounds: int = 3) -> None:
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    page = check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = check(cu.cuMemAddressReserve(n_pages * page, 0, 0, 0))
    base = int(va)
    for rnd in range(rounds):
        for how in ("one call per mapping", "one call for the range"):
            handles = [check(cu.cuMemCreate(page, prop, 0)) for _ in range(n_pages)]
            for i, h in enumerate(handles):
                check(cu.cuMemMap(base + i * page, page, 0, h, 0))
            check(cu.cuMemSetAccess(base, n_pages * page, [access], 1))
            check(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            try:
                if how == "one call per mapping":
                    for i in range(n_pages):
                        check(cu.cuMemUnmap(base + i * page, page))
                else:
                    check(cu.cuMemUnmap(base, n_pages * page))
                ok = "ok"
            except RuntimeError as exc:
                ok = str(exc)
                for i in range(n_pages):   # unmap what is left one by one
                    cu.cuMemUnmap(base + i * page, page)
            t1 = time.perf_counter()
            for h in handles:
                check(cu.cuMemRelease(h))
            t2 = time.perf_counter()
            print(f"round {rnd + 1}: {n_pages} pages of {page >> 20} MiB, {how}: {ok}; unmap {1e6 * (t1 - t0) / n_pages:.1f} "
                  f"us a page, release {1e6 * (t2 - t1) / n_pages:.1f} us a page")
    check(cu.cuMemAddressFree(va, n_pages * page))


if __name__ == "__main__":
    main()
