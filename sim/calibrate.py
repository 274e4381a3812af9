"""Measure, on a real CUDA device, what the simulator must reproduce.

Prints a table and JSON: how cudaMemGetInfo's free bytes move for cudaMalloc of
various sizes (the physical granularity and any packing of small allocations),
and the cost of each device call the allocator makes (runtime calls, and the
driver's virtual-memory, event and stream calls through cuda-bindings), each
timed over several repetitions (median and 90th percentile, in µs, Python
binding overhead included: see ``null_call`` in the table), so the simulator's
latency model (:mod:`gpumem.sim.latency`) can be calibrated.

Run: ``python -m sim.calibrate [--out FILE] [--repeat N]``.

Note [What each virtual-memory figure times]
--------------------------------------------
Each sample times one driver call alone, with the state it needs built
untimed around it: ``cuMemCreate_<size>`` a chunk of that size (then
released, timed as ``cuMemRelease_<size>``); ``cuMemMap_1page`` one 2 MiB
chunk into a fresh spot of a reservation; ``cuMemSetAccess_1page`` one
mapped page; ``cuMemSetAccess_32maps`` one call over 32 adjacent one-page
mappings (each its own chunk, as the allocator maps them);
``cuMemSetAccess_64MiB_1map`` one call over one 64 MiB mapping of one
64 MiB chunk; ``cuMemUnmap_1page`` / ``cuMemUnmap_64MiB_1map`` unmapping
those; ``cuMemUnmap_32maps`` one call over the 32 one-page mappings, if the
driver accepts a range spanning several mappings (the JSON says if not).
The simulator's size-dependent costs (a fixed cost per call plus a cost per
mapping or per byte) are fitted from these pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

_MiB = 1 << 20


def _summary(samples: list[float]) -> dict[str, Any]:
    """Median, 90th percentile, min and count of samples in µs."""
    ordered = sorted(samples)
    n = len(ordered)
    p90 = ordered[min(n - 1, int(round(0.9 * (n - 1))))]
    return {"median_us": round(statistics.median(ordered), 3), "p90_us": round(p90, 3),
            "min_us": round(ordered[0], 3), "n": n}


def _time_us(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1e3, out


def _repeat_us(fn: Callable[[], Any], repeat: int) -> dict[str, Any]:
    fn()  # warm-up
    return _summary([_time_us(fn)[0] for _ in range(repeat)])


def _malloc_packing(runtime: Any) -> dict[str, Any]:
    packing = {}
    for size in (512, 4096, 64 * 1024, 1 << 20, (1 << 20) + 1, 2 << 20, (2 << 20) + 512, 3 << 20, 5 << 20, 64 << 20):
        ptrs = []
        f_before = runtime.memGetInfo()[0]
        deltas = []
        for _ in range(8):
            ptrs.append(runtime.malloc(size))
            deltas.append(f_before - runtime.memGetInfo()[0])
        packing[str(size)] = {"cumulative_free_drop": deltas, "ptr_mod_2MiB": [p % (2 << 20) for p in ptrs],
                              "ptr_mod_512": [p % 512 for p in ptrs]}
        for p in ptrs:
            runtime.free(p)
        packing[str(size)]["free_after_all_freed_drop"] = f_before - runtime.memGetInfo()[0]
    return packing


class _Driver:
    """The driver calls the probe makes, with errors raised."""

    def __init__(self, driver: Any, device: int) -> None:
        self.d = driver
        self.device = device
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self.prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [access]
        self.gran = int(self.check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def check(self, res: Any) -> Any:
        err = res[0] if isinstance(res, tuple) else res
        if err != self.d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(err))
        if isinstance(res, tuple):
            return res[1] if len(res) == 2 else res[1:]
        return None

    def create(self, nbytes: int) -> Any:
        return self.check(self.d.cuMemCreate(nbytes, self.prop, 0))

    def release(self, h: Any) -> None:
        self.check(self.d.cuMemRelease(h))

    def reserve(self, nbytes: int) -> int:
        return int(self.check(self.d.cuMemAddressReserve(nbytes, 0, 0, 0)))

    def free_va(self, va: int, nbytes: int) -> None:
        self.check(self.d.cuMemAddressFree(va, nbytes))

    def map(self, va: int, nbytes: int, h: Any) -> None:
        self.check(self.d.cuMemMap(va, nbytes, 0, h, 0))

    def set_access(self, va: int, nbytes: int) -> None:
        self.check(self.d.cuMemSetAccess(va, nbytes, self.access, 1))

    def unmap(self, va: int, nbytes: int) -> None:
        self.check(self.d.cuMemUnmap(va, nbytes))


def _vmm_costs(drv: _Driver, repeat: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The virtual-memory calls (Note [What each virtual-memory figure times])."""
    gran = drv.gran
    costs: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    # cuMemCreate / cuMemRelease by size
    for nbytes, label, n in ((gran, "2MiB", repeat), (32 * _MiB, "32MiB", repeat), (256 * _MiB, "256MiB", repeat),
                             (1 << 30, "1GiB", max(5, repeat // 2))):
        drv.release(drv.create(nbytes))  # warm-up
        t_create, t_release = [], []
        for _ in range(n):
            dt, h = _time_us(lambda: drv.create(nbytes))
            t_create.append(dt)
            t_release.append(_time_us(lambda: drv.release(h))[0])
        costs[f"cuMemCreate_{label}"] = _summary(t_create)
        costs[f"cuMemRelease_{label}"] = _summary(t_release)

    # one page: map, set access, unmap, each timed alone, in a reservation of many pages
    npages = max(repeat, 32)
    va = drv.reserve(npages * gran)
    handles = [drv.create(gran) for _ in range(npages)]
    t_map, t_access, t_unmap = [], [], []
    for i, h in enumerate(handles):
        t_map.append(_time_us(lambda: drv.map(va + i * gran, gran, h))[0])
        t_access.append(_time_us(lambda: drv.set_access(va + i * gran, gran))[0])
    for i in range(npages):
        t_unmap.append(_time_us(lambda: drv.unmap(va + i * gran, gran))[0])
    costs["cuMemMap_1page"] = _summary(t_map)
    costs["cuMemSetAccess_1page"] = _summary(t_access)
    costs["cuMemUnmap_1page"] = _summary(t_unmap)

    # one call over 32 one-page mappings (each page its own chunk, as the allocator maps them)
    k = 32
    t_access32, t_unmap32 = [], []
    unmap_many_error = None
    for _ in range(max(5, repeat // 4)):
        for i in range(k):
            drv.map(va + i * gran, gran, handles[i])
        t_access32.append(_time_us(lambda: drv.set_access(va, k * gran))[0])
        try:
            t_unmap32.append(_time_us(lambda: drv.unmap(va, k * gran))[0])
        except RuntimeError as exc:
            unmap_many_error = str(exc)
            for i in range(k):
                drv.unmap(va + i * gran, gran)
    costs["cuMemSetAccess_32maps"] = _summary(t_access32)
    if t_unmap32:
        costs["cuMemUnmap_32maps"] = _summary(t_unmap32)
    notes["cuMemUnmap_over_several_mappings"] = "accepted" if unmap_many_error is None else \
        f"refused: {unmap_many_error}"
    for h in handles:
        drv.release(h)
    drv.free_va(va, npages * gran)

    # one 64 MiB mapping of one 64 MiB chunk
    big = 64 * _MiB
    t_map64, t_access64, t_unmap64 = [], [], []
    va = drv.reserve(big)
    h = drv.create(big)
    for _ in range(max(5, repeat // 2)):
        t_map64.append(_time_us(lambda: drv.map(va, big, h))[0])
        t_access64.append(_time_us(lambda: drv.set_access(va, big))[0])
        t_unmap64.append(_time_us(lambda: drv.unmap(va, big))[0])
    drv.release(h)
    drv.free_va(va, big)
    costs["cuMemMap_64MiB_1map"] = _summary(t_map64)
    costs["cuMemSetAccess_64MiB_1map"] = _summary(t_access64)
    costs["cuMemUnmap_64MiB_1map"] = _summary(t_unmap64)

    # address space
    t_res, t_free = [], []
    for nbytes, label in ((1 << 30, "1GiB"), (1 << 40, "1TiB")):
        t_res, t_free = [], []
        for _ in range(max(5, repeat // 2)):
            dt, va = _time_us(lambda: drv.reserve(nbytes))
            t_res.append(dt)
            t_free.append(_time_us(lambda: drv.free_va(va, nbytes))[0])
        costs[f"cuMemAddressReserve_{label}"] = _summary(t_res)
        costs[f"cuMemAddressFree_{label}"] = _summary(t_free)
    return costs, notes


def _event_costs(drv: _Driver, repeat: int) -> dict[str, Any]:
    """Events and streams, as the allocator uses them: create + record on a stream, query, destroy."""
    d = drv.d
    costs: dict[str, Any] = {}
    stream = drv.check(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)))
    flags = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    t_create, t_record, t_query, t_sync, t_destroy, t_wait = [], [], [], [], [], []
    for _ in range(repeat + 1):
        dt, ev = _time_us(lambda: drv.check(d.cuEventCreate(flags)))
        t_create.append(dt)
        t_record.append(_time_us(lambda: drv.check(d.cuEventRecord(ev, stream)))[0])
        t_query.append(_time_us(lambda: d.cuEventQuery(ev))[0])  # NOT_READY is an answer, not an error
        t_wait.append(_time_us(lambda: drv.check(d.cuStreamWaitEvent(0, ev, 0)))[0])
        t_sync.append(_time_us(lambda: drv.check(d.cuEventSynchronize(ev)))[0])
        t_destroy.append(_time_us(lambda: drv.check(d.cuEventDestroy(ev)))[0])
    for name, samples in (("cuEventCreate", t_create), ("cuEventRecord", t_record), ("cuEventQuery", t_query),
                          ("cuStreamWaitEvent", t_wait), ("cuEventSynchronize_idle", t_sync),
                          ("cuEventDestroy", t_destroy)):
        costs[name] = _summary(samples[1:])  # the first round is the warm-up
    costs["cuStreamSynchronize_idle"] = _repeat_us(lambda: drv.check(d.cuStreamSynchronize(stream)), repeat)
    costs["cuCtxSynchronize_idle"] = _repeat_us(lambda: drv.check(d.cuCtxSynchronize()), repeat)
    t_sc, t_sd = [], []
    for _ in range(max(5, repeat // 2)):
        dt, s = _time_us(lambda: drv.check(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))))
        t_sc.append(dt)
        t_sd.append(_time_us(lambda: drv.check(d.cuStreamDestroy(s)))[0])
    costs["cuStreamCreate"] = _summary(t_sc)
    costs["cuStreamDestroy"] = _summary(t_sd)
    drv.check(d.cuStreamDestroy(stream))
    costs["cuMemGetInfo"] = _repeat_us(lambda: drv.check(d.cuMemGetInfo()), repeat * 4)
    costs["null_call"] = _repeat_us(lambda: drv.check(d.cuCtxGetDevice()), repeat * 4)
    return costs


def _table(costs: dict[str, Any]) -> str:
    lines = ["| call | median µs | p90 µs | min µs | n |", "|---|---:|---:|---:|---:|"]
    for name, s in costs.items():
        if isinstance(s, dict):
            lines.append(f"| {name} | {s['median_us']:.2f} | {s['p90_us']:.2f} | {s['min_us']:.2f} | {s['n']} |")
        else:
            lines.append(f"| {name} | {s:.2f} | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON record there")
    parser.add_argument("--repeat", type=int, default=30, help="samples per call (default 30)")
    args = parser.parse_args()
    if args.repeat < 3:
        parser.error("--repeat must be at least 3")
    try:
        import cupy
        from cupy.cuda import runtime
        from cuda.bindings import driver
    except ImportError as exc:
        print(f"python -m sim.calibrate: needs CuPy and cuda-bindings, which could not be imported "
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
    result["malloc_packing"] = _malloc_packing(runtime)

    costs: dict[str, Any] = {}
    for size in (512, 1 << 20, 64 << 20, 1 << 30):
        costs[f"malloc_free_{size}"] = _repeat_us(lambda: runtime.free(runtime.malloc(size)),
                                                  args.repeat if size < (1 << 30) else max(5, args.repeat // 3))
    costs["memGetInfo"] = _repeat_us(runtime.memGetInfo, args.repeat * 4)
    costs["getDeviceProperties"] = _repeat_us(lambda: runtime.getDeviceProperties(0), max(5, args.repeat // 3))

    drv = _Driver(driver, 0)
    result["vmm_granularity"] = drv.gran
    notes: dict[str, Any] = {}
    try:
        vmm, notes = _vmm_costs(drv, args.repeat)
        costs.update(vmm)
    except Exception as exc:  # noqa: BLE001 - report what failed, keep what was measured
        notes["vmm_error"] = repr(exc)
    try:
        costs.update(_event_costs(drv, args.repeat))
    except Exception as exc:  # noqa: BLE001 - likewise
        notes["event_error"] = repr(exc)
    result["notes"] = notes
    try:
        import pynvml
        pynvml.nvmlInit()
        hdl = pynvml.nvmlDeviceGetHandleByIndex(0)
        costs["nvmlDeviceGetMemoryInfo"] = _repeat_us(lambda: pynvml.nvmlDeviceGetMemoryInfo(hdl), args.repeat * 4)
        mi = pynvml.nvmlDeviceGetMemoryInfo(hdl)
        result["nvml_total"] = mi.total
        result["nvml_used"] = mi.used
    except Exception as exc:  # noqa: BLE001 - report, this is a probe
        result["nvml_error"] = repr(exc)
    props = runtime.getDeviceProperties(0)
    result["props"] = {k: (v.decode(errors='replace') if isinstance(v, bytes) else v) for k, v in props.items()
                       if isinstance(v, (int, float, bytes, str))}
    result["driver_version"] = drv.check(driver.cuDriverGetVersion())
    result["repeat"] = args.repeat
    result["costs_us"] = costs
    print(_table(costs))
    print(json.dumps(notes))
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
