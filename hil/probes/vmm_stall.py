"""Does a virtual-memory call wait for the work queued on the GPU? Timed from the CPU on a real device.

Issue 18: a steal (``cuMemUnmap`` + ``cuMemMap`` + ``cuMemSetAccess``) costs 70-290 µs live against
about 65 µs timed on an idle device (``reports/sim-unmap-stall.md``). This probe queues a spin kernel of
known length (``--spin-ms``, timed on the GPU's own clock, ``%globaltimer``) and, while it runs, times
each driver call from the CPU, against the same call on an idle device. After every busy call it
queries the kernel's end event at once: *not ready* proves the call returned before the queued work
ended; *ready* together with a call time near the kernel's remaining time means the call waited for it.

Three queues are tried (``--queues``): ``one`` (one kernel on one non-default stream), ``deep`` (four
kernels of a quarter each on one stream) and ``streams`` (one kernel on each of three streams). The
calls: ``unmap_untouched`` (a mapping the kernel does not use), ``unmap_touched`` (the 2 MiB page the
kernel wrote at its start; it never reads it again, so an unmap that does not wait is safe),
``map`` (a fresh handle into a reserved range), ``set_access``, ``steal`` (unmap + map + set access, as
the allocator's steal), ``create``, ``release``, ``reserve``, ``address_free``, ``event_query``,
``stream_query``.

A second part asks whether the GPU pauses while page tables change: a kernel of fixed work (passes
over a 1 GiB buffer) is timed by events alone and with steals made as fast as the CPU can while it
runs (``pause`` in the JSON). A third (``--interleave N``) queues N short kernels with VMM calls made
between their launches, as an allocator makes them, and compares the queue's GPU time with and without
the calls (``interleave``): a pause between kernels would show there, not in the second part.

Needs CuPy (the kernels, streams, events) and cuda-bindings (the driver calls)::

    python -m hil.probes.vmm_stall --repeats 25 --json build/vmm-stall.json
    python -m hil.probes.vmm_stall --held-mappings 3000 --interleave 3000 --json build/vmm-stall-3000.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from gpumem.errors import CudaError
from gpumem.units import GiB, MiB

log = logging.getLogger(__name__)

PROG = "python -m hil.probes.vmm_stall"

KERNELS_SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Writes touch[0] once at its start (when touch is not null), then spins until ns nanoseconds have passed.
extern "C" __global__ void spin(unsigned long long* touch, unsigned long long ns) {
    unsigned long long t0 = now_ns();
    if (touch != 0 && threadIdx.x == 0) touch[0] += 1ull;
    while (now_ns() - t0 < ns) { }
}
// A fixed amount of memory work: passes read-modify-writes over x[0..n).
extern "C" __global__ void sweep(float* x, long long n, int passes) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (int p = 0; p < passes; ++p)
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
            x[i] = x[i] * 0.999f + 1.0f;
}
"""

CALLS = ("unmap_untouched", "unmap_touched", "map", "set_access", "steal", "create", "release", "reserve",
         "address_free", "event_query", "stream_query")
QUEUES = ("one", "deep", "streams")
PAGE_NBYTES = 2 * MiB
#: passes of the fixed-work kernel over its 1 GiB (about 20 ms on an H200)
PAUSE_PASSES = 40


@dataclasses.dataclass
class CallTiming:
    """One call under one queue: CPU microseconds idle and busy, and whether the busy calls returned early."""

    call: str
    queue: str
    idle_us: list[float] = dataclasses.field(default_factory=list)
    busy_us: list[float] = dataclasses.field(default_factory=list)
    #: per busy call: the kernel's end event was still pending right after the call returned
    returned_before_end: list[bool] = dataclasses.field(default_factory=list)
    #: per busy call: queued time left when the call started (µs; from the launch time and --spin-ms)
    queued_left_us: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Medians and counts, for the JSON and the table."""
        return {
            "call": self.call, "queue": self.queue, "n": len(self.busy_us),
            "idle_median_us": round(statistics.median(self.idle_us), 1),
            "busy_median_us": round(statistics.median(self.busy_us), 1),
            "busy_max_us": round(max(self.busy_us), 1),
            "queued_left_median_us": round(statistics.median(self.queued_left_us), 1),
            "returned_before_end": sum(self.returned_before_end),
        }


class Probe:
    """The device, one reservation of scratch pages, the kernels and streams; every timed call."""

    def __init__(self, cupy: Any, driver: Any, ordinal: int, spin_ms: float) -> None:
        from gpumem.cuda.vmm import VmmDriver  # noqa: PLC0415 - needs cuda-bindings

        self.cupy = cupy
        self.driver = driver
        cupy.cuda.runtime.setDevice(ordinal)
        cupy.zeros(1)  # makes the primary context current on this thread for the driver calls
        self.vmm = VmmDriver(driver, ordinal)
        if not self.vmm.supported():
            raise CudaError("cuDeviceGetAttribute", "CUDA_ERROR_NOT_SUPPORTED",
                            f"CUDA device {ordinal} does not support virtual memory management")
        self.spin_ns = int(spin_ms * 1e6)
        self.range_nbytes = 8 * PAGE_NBYTES
        self.va = self.vmm.address_reserve(self.range_nbytes, PAGE_NBYTES)
        module = cupy.RawModule(code=KERNELS_SOURCE)
        self.spin = module.get_function("spin")
        self.sweep = module.get_function("sweep")
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        self.held_va = 0
        self.held_nbytes = 0

    def hold_mappings(self, count: int) -> None:
        """Map ``count`` more 2 MiB chunks, each its own mapping, in a reservation of their own, and keep them
        for the probe's life: a training run under gpumem holds thousands (run 4: 2,500-3,200), and a call's
        cost may grow with them."""
        if count <= 0:
            return
        nbytes = count * PAGE_NBYTES
        self.held_va = self.vmm.address_reserve(nbytes, PAGE_NBYTES)
        self.held_nbytes = nbytes
        for i in range(count):
            handle = self.vmm.create(PAGE_NBYTES)
            self.vmm.map(self.held_va + i * PAGE_NBYTES, PAGE_NBYTES, handle)
            self.vmm.release(handle)  # the memory stays until it is unmapped
        self.vmm.set_access(self.held_va, nbytes)

    def close(self) -> None:
        """Give the scratch reservation (and the held mappings) back."""
        self.cupy.cuda.runtime.deviceSynchronize()
        self.vmm.address_free(self.va, self.range_nbytes)
        if self.held_nbytes:
            for i in range(self.held_nbytes // PAGE_NBYTES):
                self.vmm.unmap(self.held_va + i * PAGE_NBYTES, PAGE_NBYTES)
            self.vmm.address_free(self.held_va, self.held_nbytes)

    # -- pages -----------------------------------------------------------------------------------------
    def page(self, index: int) -> int:
        return self.va + index * PAGE_NBYTES

    def mapped_page(self, index: int) -> Any:
        handle = self.vmm.create(PAGE_NBYTES)
        self.vmm.map(self.page(index), PAGE_NBYTES, handle)
        self.vmm.set_access(self.page(index), PAGE_NBYTES)
        return handle

    def drop(self, index: int, handle: Any) -> None:
        self.vmm.unmap(self.page(index), PAGE_NBYTES)
        self.vmm.release(handle)

    # -- the queue -------------------------------------------------------------------------------------
    def launch(self, queue: str, touch_ptr: int) -> tuple[list[Any], int]:
        """Queue ``queue``'s kernels; returns the end events and the CPU time (ns) the queued work should end."""
        import numpy as np  # noqa: PLC0415

        t0 = time.perf_counter_ns()
        ends = []
        if queue == "one":
            plan = [(self.streams[0], self.spin_ns, touch_ptr)]
        elif queue == "deep":
            plan = [(self.streams[0], self.spin_ns // 4, touch_ptr if i == 0 else 0) for i in range(4)]
        else:
            plan = [(s, self.spin_ns, touch_ptr if i == 0 else 0) for i, s in enumerate(self.streams)]
        for stream, ns, touch in plan:
            self.spin((1,), (32,), (np.uint64(touch), np.uint64(ns)), stream=stream)
        for stream in {id(s): s for s, _, _ in plan}.values():
            ends.append(stream.record())
        return ends, t0 + self.spin_ns

    def event_done(self, event: Any) -> bool:
        err = self.driver.cuEventQuery(event.ptr)[0]
        return err == self.driver.CUresult.CUDA_SUCCESS

    # -- one call --------------------------------------------------------------------------------------
    def prepared(self, call: str, queue_ends: list[Any], stream: Any) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(timed, cleanup)`` for ``call``: setup is done here, before the work is queued, so that no setup
        call can wait for the queue; ``queue_ends`` is filled with the queue's end events afterwards."""
        vmm = self.vmm
        if call == "unmap_untouched":
            handle = self.mapped_page(1)
            return (lambda: vmm.unmap(self.page(1), PAGE_NBYTES)), (lambda: vmm.release(handle))
        if call == "unmap_touched":  # page 0 is mapped by the caller (the kernel writes it)
            return (lambda: vmm.unmap(self.page(0), PAGE_NBYTES)), (lambda: None)
        if call == "map":
            handle = vmm.create(PAGE_NBYTES)
            return (lambda: vmm.map(self.page(2), PAGE_NBYTES, handle)), (lambda: self.drop(2, handle))
        if call == "set_access":
            handle = vmm.create(PAGE_NBYTES)
            vmm.map(self.page(2), PAGE_NBYTES, handle)
            return (lambda: vmm.set_access(self.page(2), PAGE_NBYTES)), (lambda: self.drop(2, handle))
        if call == "steal":
            handle = self.mapped_page(3)

            def steal() -> None:
                vmm.unmap(self.page(3), PAGE_NBYTES)
                vmm.map(self.page(4), PAGE_NBYTES, handle)
                vmm.set_access(self.page(4), PAGE_NBYTES)
            return steal, (lambda: self.drop(4, handle))
        if call == "create":
            box: list[Any] = []
            return (lambda: box.append(vmm.create(PAGE_NBYTES))), (lambda: vmm.release(box[0]))
        if call == "release":
            handle = vmm.create(PAGE_NBYTES)
            return (lambda: vmm.release(handle)), (lambda: None)
        if call == "reserve":
            box = []
            return ((lambda: box.append(vmm.address_reserve(PAGE_NBYTES, PAGE_NBYTES))),
                    (lambda: vmm.address_free(box[0], PAGE_NBYTES)))
        if call == "address_free":
            va = vmm.address_reserve(PAGE_NBYTES, PAGE_NBYTES)
            return (lambda: vmm.address_free(va, PAGE_NBYTES)), (lambda: None)
        if call == "event_query":
            idle_event = stream.record()
            return (lambda: self.driver.cuEventQuery((queue_ends[0] if queue_ends else idle_event).ptr)), (lambda: None)
        if call == "stream_query":
            return (lambda: self.driver.cuStreamQuery(stream.ptr)), (lambda: None)
        raise ValueError(f"{PROG}: unknown call {call!r}")

    def time_once(self, call: str, queue: str | None, out: CallTiming) -> None:
        """One idle (``queue`` None) or busy timing of ``call``, appended to ``out``."""
        sync = self.cupy.cuda.runtime.deviceSynchronize
        sync()
        touched = self.mapped_page(0) if call == "unmap_touched" else None
        ends: list[Any] = []
        end_cpu_ns = 0
        timed, cleanup = self.prepared(call, ends, self.streams[0])
        if queue is not None:
            launched, end_cpu_ns = self.launch(queue, self.page(0) if touched is not None else 0)
            ends.extend(launched)
            time.sleep(0.002)  # the first kernel has started (and written its page) by now
        t0 = time.perf_counter_ns()
        timed()
        t1 = time.perf_counter_ns()
        pending = any(not self.event_done(e) for e in ends)
        sync()
        cleanup()
        if touched is not None:
            self.vmm.release(touched)
        if queue is None:
            out.idle_us.append((t1 - t0) / 1e3)
        else:
            out.busy_us.append((t1 - t0) / 1e3)
            out.returned_before_end.append(pending)
            out.queued_left_us.append(max(0.0, (end_cpu_ns - t0) / 1e3))

    # -- does the GPU pause while page tables change? ----------------------------------------------------
    def pause_test(self, repeats: int) -> dict[str, Any]:
        """A fixed-work kernel timed by events, alone and with steals made while it runs."""
        import numpy as np  # noqa: PLC0415

        n = GiB // 4
        x = self.cupy.zeros(n, dtype=self.cupy.float32)
        stream = self.streams[1]
        handle = self.mapped_page(5)
        at = 5
        alone, stormed, steals = [], [], []
        for rep in range(2 * repeats + 1):
            self.cupy.cuda.runtime.deviceSynchronize()
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record(stream)
            self.sweep((264,), (1024,), (x, np.int64(n), np.int32(PAUSE_PASSES)), stream=stream)
            end.record(stream)
            count = 0
            if rep % 2 == 1:
                while not self.event_done(end):
                    self.vmm.unmap(self.page(at), PAGE_NBYTES)
                    at = 11 - at  # pages 5 and 6 in turn
                    self.vmm.map(self.page(at), PAGE_NBYTES, handle)
                    self.vmm.set_access(self.page(at), PAGE_NBYTES)
                    count += 1
            end.synchronize()
            ms = self.cupy.cuda.get_elapsed_time(start, end)
            if rep == 0:
                continue  # warm-up
            (stormed if rep % 2 == 1 else alone).append(ms)
            if rep % 2 == 1:
                steals.append(count)
        self.drop(at, handle)
        del x
        return {"kernel_alone_median_ms": round(statistics.median(alone), 3),
                "kernel_with_steals_median_ms": round(statistics.median(stormed), 3),
                "steals_during_kernel_median": statistics.median(steals),
                "kernel_alone_ms": [round(v, 3) for v in alone],
                "kernel_with_steals_ms": [round(v, 3) for v in stormed], "steals_during_kernel": steals}

    # -- do VMM calls between launches delay the queued kernels? -----------------------------------------
    def interleave_test(self, n_kernels: int, every: int, repeats: int) -> dict[str, Any]:
        """``n_kernels`` short fixed-work kernels (about 30 µs each) queued back to back on one stream, the CPU
        making VMM calls on scratch pages after every ``every``-th launch, as an allocator does between a
        program's launches. The GPU time of the whole queue (its first to its last event) against the same
        queue with no calls tells whether the calls cost the GPU time (a pause between kernels) or only the
        CPU's; the queue is longer than the CPU's launches and calls, so the CPU stays ahead."""
        import numpy as np  # noqa: PLC0415

        n = 16 * MiB // 4 * 4  # 64 MiB of floats
        x = self.cupy.zeros(n, dtype=self.cupy.float32)
        stream = self.streams[2]
        vmm = self.vmm
        handle = self.mapped_page(5)
        state = {"at": 5}

        def steal() -> None:
            vmm.unmap(self.page(state["at"]), PAGE_NBYTES)
            state["at"] = 11 - state["at"]  # pages 5 and 6 in turn
            vmm.map(self.page(state["at"]), PAGE_NBYTES, handle)
            vmm.set_access(self.page(state["at"]), PAGE_NBYTES)

        def unmap_map() -> None:
            vmm.unmap(self.page(state["at"]), PAGE_NBYTES)
            vmm.map(self.page(state["at"]), PAGE_NBYTES, handle)

        def set_access() -> None:
            vmm.set_access(self.page(state["at"]), PAGE_NBYTES)

        variants: dict[str, Callable[[], None] | None] = {"none": None, "steal": steal, "unmap_map": unmap_map,
                                                          "set_access": set_access}
        gpu_ms: dict[str, list[float]] = {k: [] for k in variants}
        cpu_ms: dict[str, list[float]] = {k: [] for k in variants}
        for rep in range(repeats + 1):
            for name, call in variants.items():
                self.cupy.cuda.runtime.deviceSynchronize()
                start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
                start.record(stream)
                t0 = time.perf_counter_ns()
                for k in range(n_kernels):
                    self.sweep((264,), (1024,), (x, np.int64(n), np.int32(1)), stream=stream)
                    if call is not None and k % every == every - 1:
                        call()
                t1 = time.perf_counter_ns()
                end.record(stream)
                pending = not self.event_done(end)
                end.synchronize()
                if rep == 0:
                    continue  # warm-up
                if not pending:
                    log.warning("interleave %s: the queue drained before the CPU finished launching", name)
                gpu_ms[name].append(self.cupy.cuda.get_elapsed_time(start, end))
                cpu_ms[name].append((t1 - t0) / 1e6)
        self.drop(state["at"], handle)
        del x
        return {"n_kernels": n_kernels, "calls_every": every, "n_call_groups": n_kernels // every,
                "gpu_median_ms": {k: round(statistics.median(v), 3) for k, v in gpu_ms.items()},
                "cpu_launch_median_ms": {k: round(statistics.median(v), 3) for k, v in cpu_ms.items()},
                "gpu_ms": gpu_ms, "cpu_launch_ms": cpu_ms}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the summaries."""
    lines = ["| call | queue | idle median µs | busy median µs | busy max µs | queued left at call, median µs "
             "| returned before the queued work ended |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['queue']} | {r['idle_median_us']} | {r['busy_median_us']} | "
                     f"{r['busy_max_us']} | {r['queued_left_median_us']} | {r['returned_before_end']}/{r['n']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=25, help="timings of each call, idle and busy (default 25)")
    parser.add_argument("--spin-ms", type=float, default=20.0, help="length of the queued work in ms (default 20)")
    parser.add_argument("--queues", default=",".join(QUEUES), help=f"comma list of {', '.join(QUEUES)}")
    parser.add_argument("--calls", default=",".join(CALLS), help="comma list of the calls to time (default: all)")
    parser.add_argument("--no-pause-test", action="store_true", help="skip the fixed-work kernel test")
    parser.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="also queue N short kernels with VMM calls between launches (0: skip)")
    parser.add_argument("--interleave-every", type=int, default=10, metavar="K",
                        help="the calls come after every K-th launch (default 10)")
    parser.add_argument("--held-mappings", type=int, default=0, metavar="N",
                        help="map N more 2 MiB chunks (each its own mapping) before timing, as a training run "
                             "holds thousands (default 0)")
    parser.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    queues = [q for q in args.queues.split(",") if q]
    calls = [c for c in args.calls.split(",") if c]
    bad = [q for q in queues if q not in QUEUES] + [c for c in calls if c not in CALLS]
    if bad:
        parser.error(f"unknown queue or call: {', '.join(bad)} (queues: {', '.join(QUEUES)}; calls: {', '.join(CALLS)})")
    if args.repeats < 1 or args.spin_ms <= 2.5:
        parser.error("--repeats must be >= 1 and --spin-ms > 2.5 (the probe waits 2 ms after the launch)")
    if args.held_mappings < 0 or args.interleave < 0 or args.interleave_every < 1:
        parser.error("--held-mappings and --interleave must be >= 0, --interleave-every >= 1")
    try:
        import cupy  # noqa: PLC0415 - a real-GPU probe
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError as exc:
        print(f"{PROG}: needs CuPy and cuda-bindings, which could not be imported ({exc}); install them with: "
              f"pip install \"gpumem[cuda13]\"", file=sys.stderr)
        return 2
    probe = Probe(cupy, driver, args.device, args.spin_ms)
    probe.hold_mappings(args.held_mappings)
    timings: list[CallTiming] = []
    for queue in queues:
        for call in calls:
            out = CallTiming(call, queue)
            for _ in range(args.repeats):
                probe.time_once(call, None, out)
                probe.time_once(call, queue, out)
            timings.append(out)
            log.info("%s/%s done", queue, call)
    rows = [t.summary() for t in timings]
    result: dict[str, Any] = {"device": cupy.cuda.runtime.getDeviceProperties(args.device)["name"].decode(),
                              "driver_version": int(driver.cuDriverGetVersion()[1]), "spin_ms": args.spin_ms,
                              "held_mappings": args.held_mappings,
                              "repeats": args.repeats, "rows": rows,
                              "raw": [dataclasses.asdict(t) for t in timings]}
    if not args.no_pause_test:
        result["pause"] = probe.pause_test(max(5, args.repeats // 2))
    if args.interleave:
        result["interleave"] = probe.interleave_test(args.interleave, args.interleave_every, 5)
    probe.close()
    print(table(rows))
    if "pause" in result:
        p = result["pause"]
        print(f"\nfixed-work kernel: alone {p['kernel_alone_median_ms']} ms, with steals "
              f"{p['kernel_with_steals_median_ms']} ms ({p['steals_during_kernel_median']} steals during it)")
    if "interleave" in result:
        q = result["interleave"]
        print(f"\n{q['n_kernels']} short kernels, calls after every {q['calls_every']}th launch: GPU ms "
              f"{q['gpu_median_ms']}, CPU launch ms {q['cpu_launch_median_ms']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
