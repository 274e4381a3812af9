"""The cost of the memory-first warm-up's steal on large holdings: multi-GB allocations and frees, warm
against not warm, on both engines, side by side in one run.

While a step plan's warm-up is on (Note [A memory-first warm-up] in ``gpumem/allocator/plan.py``) the
engine grows in small chunks (one page up to 8 GiB held, 1/4096 of what is held past it) and, past the
peak touched, steals idle chunks stream-ordered. Each steal used to list every idle chunk (a scan of every
empty page) and sort them: with thousands of small chunks, large operations got slow (attacker 14, F1:
200 multi-GB operations at ~35 GB held, 12.0 s warm against 0.39 s not warm; Note [An index of idle
chunks] in ``gpumem/allocator/backing.py``). The program here is that kind: on a simulated H200,
allocations of 0.5, 1, 2 or 4 GiB (plus one under 1 MiB in four) on streams 0/7/9, a random live one
freed when the live bytes would pass the target held, or with probability 1/2 once half of it is live;
after each allocation optionally a kernel of ``--lag-ms`` on its stream (the GPU behind, so fences are
pending). The warm-up begins with ``start_plan_warmup()`` before the first allocation and, with no mark,
stays on for the run (fewer than ``WARMUP_ALLOCS`` allocations).

Columns: the CPU seconds of the op loop (``time.process_time``: other jobs on a shared machine disturb it
less than wall time; it includes the simulated device, which runs in Python), the ratio warm / not warm
(``cold``), the device calls and event calls (the stats), peak reserved, and the CPU µs per call: the
warm-up makes several times the calls (its one-page chunks), which its time cannot go below. Warm and
not warm rows run the same operations; the Python and native engines must decide the same (the ``same``
column compares pointers and stats with the first engine's).

Usage::

    python -m benchmarks.warmup_steal_bench [--held-gib 8,16,35] [--ops 200] [--engines native,python]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from dataclasses import dataclass

from gpumem import sim
from gpumem.allocator import CachingAllocator

GIB = 1 << 30
LARGE_NBYTES = (GIB // 2, GIB, 2 * GIB, 4 * GIB)
"""The multi-GB sizes of the program's large allocations."""


@dataclass(frozen=True)
class Op:
    """One operation of the program: an allocation (``nbytes`` > 0, id ``key``) or the free of ``key``."""

    key: int
    nbytes: int
    stream: int


@dataclass
class Result:
    """One run of the program through one engine."""

    cpu_s: float
    device_calls: int
    event_calls: int
    peak_reserved_nbytes: int
    decided: tuple


def program(held_nbytes: int, n_ops: int, seed: int) -> list[Op]:
    """The operations: allocate while the live bytes stay under ``held_nbytes`` (else, or with probability
    1/2 once half of it is live, free a random live allocation)."""
    rng = random.Random(seed)
    live: dict[int, int] = {}
    live_nbytes = 0
    ops: list[Op] = []
    key = 0
    while len(ops) < n_ops:
        nbytes = rng.choice(LARGE_NBYTES) if rng.random() < 0.75 else rng.randrange(512, 1 << 20)
        if live and (live_nbytes + nbytes > held_nbytes or (2 * live_nbytes > held_nbytes and rng.random() < 0.5)):
            k = rng.choice(sorted(live))
            live_nbytes -= live.pop(k)
            ops.append(Op(k, 0, 0))
            continue
        key += 1
        live[key] = nbytes
        live_nbytes += nbytes
        ops.append(Op(key, nbytes, rng.choice((0, 7, 9))))
    return ops


def run(ops: list[Op], engine: str, warm: bool, lag_s: float) -> Result:
    """Runs ``ops`` through a fresh allocator on a simulated H200 (``warm``: after ``start_plan_warmup()``)."""
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(dev, "gpumem", engine=engine)
    if alloc.engine != engine:
        raise RuntimeError(f"the {engine} engine is not available here")
    if warm and not alloc.start_plan_warmup():
        raise RuntimeError("the default policy did not begin the warm-up")
    ptrs: dict[int, int] = {}
    out: list[int] = []
    allocate, free = alloc.allocate, alloc.free
    t0 = time.process_time()
    for op in ops:
        if op.nbytes:
            p = allocate(op.nbytes, op.stream)
            ptrs[op.key] = p
            out.append(p)
            if lag_s:
                dev.launch(op.stream, lag_s)
        else:
            free(ptrs.pop(op.key))
    cpu_s = time.process_time() - t0
    if warm and not alloc.step_plan_info().warmup:
        raise RuntimeError("the warm-up ended during the run: the rows would not compare warm with not warm")
    stats = alloc.snapshot_stats()
    result = Result(cpu_s, stats.device_calls, stats.event_calls, stats.peak_reserved_nbytes,
                    (tuple(out), stats.as_dict()))
    for p in ptrs.values():
        free(p)
    alloc.close()
    dev.close()
    return result


def per_call_us(result: Result) -> float:
    """CPU µs of the run per device and event call: what is left once the calls themselves (the simulated
    device runs in Python) are what the time is spent on."""
    return result.cpu_s * 1e6 / max(1, result.device_calls + result.event_calls)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.warmup_steal_bench",
                                 description=" ".join(__doc__.split("\n\n")[0].split()) + ".")
    ap.add_argument("--held-gib", default="8,16,35", help="comma-separated targets of live GiB (default 8,16,35)")
    ap.add_argument("--ops", type=int, default=200, help="operations per run, allocations and frees (default 200)")
    ap.add_argument("--engines", default="native,python", help="comma-separated engines (default native,python)")
    ap.add_argument("--lag-ms", default="0", help="comma-separated kernel lengths after each allocation, ms "
                    "(0: none, every fence done at once; default 0)")
    ap.add_argument("--seed", type=int, default=14, help="the program's random seed (default 14)")
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    helds = [float(h) for h in args.held_gib.split(",") if h]
    lags = [float(x) for x in args.lag_ms.split(",") if x]
    print(f"CPython {platform.python_version()}; sim:h200-141gb; policy gpumem; {args.ops} ops, seed {args.seed}; "
          f"load average at start {os.getloadavg()[0]:.1f}; CPU s of the op loop")
    print(f"{'engine':<7} {'held GiB':>8} {'lag ms':>6} {'warm s':>8} {'cold s':>8} {'ratio':>6} "
          f"{'warm calls':>10} {'cold calls':>10} {'warm events':>11} {'cold events':>11} "
          f"{'warm peak MiB':>13} {'cold peak MiB':>13} {'µs/call warm':>12} {'cold':>5}  same")
    for held in helds:
        ops = program(int(held * GIB), args.ops, args.seed)
        for lag_ms in lags:
            decided: dict[bool, tuple] = {}
            for engine in engines:
                warm = run(ops, engine, True, lag_ms / 1e3)
                cold = run(ops, engine, False, lag_ms / 1e3)
                same = ""
                if engine != engines[0]:
                    same = "yes" if decided == {True: warm.decided, False: cold.decided} else "NO"
                else:
                    decided = {True: warm.decided, False: cold.decided}
                print(f"{engine:<7} {held:>8g} {lag_ms:>6g} {warm.cpu_s:>8.3f} {cold.cpu_s:>8.3f} "
                      f"{warm.cpu_s / max(cold.cpu_s, 1e-9):>6.1f} {warm.device_calls:>10,} {cold.device_calls:>10,} "
                      f"{warm.event_calls:>11,} {cold.event_calls:>11,} {warm.peak_reserved_nbytes >> 20:>13,} "
                      f"{cold.peak_reserved_nbytes >> 20:>13,} {per_call_us(warm):>12.1f} {per_call_us(cold):>5.1f}  {same}",
                      flush=True)


if __name__ == "__main__":
    main()
