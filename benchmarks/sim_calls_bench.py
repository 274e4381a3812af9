"""CPU cost of each simulated device call the caching allocator makes, in µs of host time per call.

Times the public :class:`gpumem.Device` methods of a ``sim:h200-141gb`` device (the cost a caller
pays, validation, bookkeeping and simulated time included), each in a loop of ``--n`` calls, best
of ``--repeat`` rounds, and prints a table. The simulated device's own clock is not what is
measured here: this is how fast the simulator runs, not how long the calls would take on a GPU.

Run: ``python benchmarks/sim_calls_bench.py [--n 2000] [--repeat 5] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import gpumem
from gpumem.sim import SimDevice, get_profile


def _loop_us(n: int, setup: Callable[[], object], body: Callable[[object], None],
             teardown: Callable[[object], None]) -> float:
    """µs per call of ``body(state)`` run ``n`` times (setup and teardown untimed)."""
    state = setup()
    t0 = time.perf_counter_ns()
    body(state)
    dt = time.perf_counter_ns() - t0
    teardown(state)
    return dt / 1e3 / n


def measure(n: int, repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` µs per call for each row of the table."""
    dev = SimDevice(get_profile("h200-141gb"))
    gran = dev.granularity_nbytes
    k = 32  # mappings per range for the multi-mapping rows
    rows: dict[str, list[float]] = {}

    def add(name: str, us: float) -> None:
        rows.setdefault(name, []).append(us)

    for _ in range(repeat):
        # mem_create / mem_release
        handles: list = []
        t0 = time.perf_counter_ns()
        for _i in range(n):
            handles.append(dev.mem_create(gran))
        add("mem_create", (time.perf_counter_ns() - t0) / 1e3 / n)
        # map, set access, unmap one page at a time
        va = dev.address_reserve(n * gran)
        mem_map, set_access, unmap = dev.mem_map, dev.mem_set_access, dev.mem_unmap
        t0 = time.perf_counter_ns()
        for i, h in enumerate(handles):
            mem_map(va + i * gran, gran, h)
        add("mem_map", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for i in range(n):
            set_access(va + i * gran, gran)
        add("mem_set_access (1 mapping)", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for i in range(n):
            unmap(va + i * gran, gran)
        add("mem_unmap (1 mapping)", (time.perf_counter_ns() - t0) / 1e3 / n)
        # one call over k mappings
        m = n // k
        for i, h in enumerate(handles[:m * k]):
            mem_map(va + i * gran, gran, h)
        t0 = time.perf_counter_ns()
        for j in range(m):
            set_access(va + j * k * gran, k * gran)
        add(f"mem_set_access ({k} mappings)", (time.perf_counter_ns() - t0) / 1e3 / m)
        t0 = time.perf_counter_ns()
        for j in range(m):
            unmap(va + j * k * gran, k * gran)
        add(f"mem_unmap ({k} mappings)", (time.perf_counter_ns() - t0) / 1e3 / m)
        t0 = time.perf_counter_ns()
        for h in handles:
            dev.mem_release(h)
        add("mem_release", (time.perf_counter_ns() - t0) / 1e3 / n)
        dev.address_free(va, n * gran)
        # address space
        vas = []
        t0 = time.perf_counter_ns()
        for _i in range(n):
            vas.append(dev.address_reserve(64 * gran))
        add("address_reserve", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for v in vas:
            dev.address_free(v, 64 * gran)
        add("address_free", (time.perf_counter_ns() - t0) / 1e3 / n)
        # events and streams (idle streams: what an allocator sees between kernels)
        record, query, sync, destroy = dev.event_record, dev.event_query, dev.event_synchronize, dev.event_destroy
        t0 = time.perf_counter_ns()
        events = [record(7) for _i in range(n)]
        add("event_record", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for ev in events:
            query(ev)
        add("event_query", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for ev in events:
            sync(ev)
        add("event_synchronize", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for ev in events:
            destroy(ev)
        add("event_destroy", (time.perf_counter_ns() - t0) / 1e3 / n)
        ssync = dev.stream_synchronize
        t0 = time.perf_counter_ns()
        for _i in range(n):
            ssync(7)
        add("stream_synchronize", (time.perf_counter_ns() - t0) / 1e3 / n)
        info = dev.mem_info
        t0 = time.perf_counter_ns()
        for _i in range(n):
            info()
        add("mem_info", (time.perf_counter_ns() - t0) / 1e3 / n)
        props = dev.properties
        t0 = time.perf_counter_ns()
        for _i in range(n):
            props()
        add("properties", (time.perf_counter_ns() - t0) / 1e3 / n)
        t0 = time.perf_counter_ns()
        for _i in range(n):
            pass
        add("(empty loop)", (time.perf_counter_ns() - t0) / 1e3 / n)
    dev.close()
    return {name: min(samples) for name, samples in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per timed loop (default 2000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept (default 5)")
    parser.add_argument("--json", default=None, help="also write the figures there")
    args = parser.parse_args(argv)
    if args.n < 32 or args.repeat < 1:
        parser.error("--n must be at least 32 and --repeat at least 1")
    results = measure(args.n, args.repeat)
    print(f"gpumem {gpumem.__version__}: simulated device calls on sim:h200-141gb, "
          f"µs of host CPU per call (best of {args.repeat} x {args.n})")
    print("| call | µs/call |")
    print("|---|---:|")
    for name, us in results.items():
        print(f"| {name} | {us:.3f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
