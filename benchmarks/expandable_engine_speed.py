"""µs per operation of the ``expandable`` policy (pages of 2 / 20 MiB, Note [Expandable segments] in
``gpumem/allocator/policy.py``) on the Python engine against the native one, side by side in one run.

Each corpus trace (``data/traces``) is replayed through ``CachingAllocator(engine=...)`` on a simulated H200:
every allocation and free, in order, then ``empty_cache``; the table gives the CPU µs per operation
(``time.process_time`` over the op loop: other jobs on a shared machine disturb it far less than wall time),
the ratio, and checks that both engines decided the same (pointers, stats, device calls counted by the stats;
``tests/allocator/test_native_differential.py`` checks every call). Before the native engine ran pages of a
pool's own size, ``expandable`` ran on the Python engine alone.

Usage::

    python -m benchmarks.expandable_engine_speed [--traces DIR] [--policies expandable,gpumem] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import OutOfMemoryError
from gpumem.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]


def run(trace_ops: tuple[list[int], list[int], list[int], list[int]], policy: str,
        engine: str) -> tuple[float, int, tuple]:
    """Replays the ops once; returns (CPU seconds of the op loop, ops made, what the engine decided)."""
    kinds, ids, sizes, streams = trace_ops
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(dev, policy, engine=engine)
    if alloc.engine != engine:
        raise RuntimeError(f"policy {policy!r} does not run on the {engine} engine here")
    allocate, free = alloc.allocate, alloc.free
    ptrs = [0] * (max(ids) + 1 if ids else 0)
    out: list[int] = []
    n = 0
    t0 = time.process_time()
    for i in range(len(kinds)):
        if kinds[i] == 0:
            if sizes[i]:
                try:
                    p = allocate(sizes[i], streams[i])
                except OutOfMemoryError:
                    p = 0
                ptrs[ids[i]] = p
                out.append(p)
                n += 1
        elif ptrs[ids[i]]:
            free(ptrs[ids[i]])
            ptrs[ids[i]] = 0
            n += 1
    alloc.empty_cache()
    cpu_s = time.process_time() - t0
    decided = (tuple(out), alloc.snapshot_stats().as_dict())
    alloc.close()
    dev.close()
    return cpu_s, n, decided


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.expandable_engine_speed",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--traces", default=str(ROOT / "data" / "traces"), help="directory of traces (default data/traces)")
    ap.add_argument("--policies", default="expandable", help="comma-separated policies (default expandable)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the fastest counts (default 3)")
    ap.add_argument("--only", default="", help="comma-separated substrings: only the traces whose name has one")
    args = ap.parse_args()
    names = sorted(f for f in os.listdir(args.traces) if not f.endswith(".md"))
    if args.only:
        names = [f for f in names if any(s in f for s in args.only.split(","))]
    print(f"CPython {platform.python_version()}; sim:h200-141gb; load average at start "
          f"{os.getloadavg()[0]:.1f}; best of {args.repeat}; CPU µs per op (allocate or free)")
    print(f"{'trace':<48} {'policy':<11} {'ops':>9} {'python':>8} {'native':>8} {'ratio':>6}  same")
    for name in names:
        ops = load_trace(os.path.join(args.traces, name)).as_lists()
        for policy in args.policies.split(","):
            best: dict[str, float] = {}
            decided: dict[str, tuple] = {}
            n = 0
            for _ in range(args.repeat):
                for engine in ("python", "native"):   # alternating: a load change hits both alike
                    cpu_s, n, decided[engine] = run(ops, policy, engine)
                    best[engine] = min(best.get(engine, cpu_s), cpu_s)
            us = {e: best[e] / max(n, 1) * 1e6 for e in best}
            same = "yes" if decided["python"] == decided["native"] else "NO"
            print(f"{name:<48} {policy:<11} {n:>9} {us['python']:>8.3f} {us['native']:>8.3f} "
                  f"{us['python'] / us['native']:>5.1f}x  {same}", flush=True)


if __name__ == "__main__":
    main()
