"""What a step plan costs on a step of many small same-size temporaries (review attacker 7, finding 3): ``n``
allocate/free pairs of 4 KiB per step, every one planned at the arena's base (an optimizer's foreach kernels,
per-parameter gradients). Install and the serve path were quadratic there (a list per slot of the slots it
overlaps: ``n * (n - 1)`` entries).

Each engine and ``n`` runs in a process of its own (host memory is the process's peak, ``ru_maxrss``):

- *mark*: the mark that makes the step READY, plans it (numpy, :func:`gpumem.allocator.plan.plan_step`) and
  installs it; *planner*: the numpy part of it; *install*: the rest (the engine's install);
- *RSS +*: host memory the planning mark added to the process's peak;
- *planned* / *unmarked*: one step's time (the median of ``--steps``), planned, and on a fresh allocator
  without marks; *ratio*: planned / unmarked.

Prints one table; run it under another gpumem (another checkout as the working directory) to compare::

    python -m benchmarks.step_plan_scale --n 3000 10000 --engines native python
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR_NBYTES = 4096


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def measure(engine: str, n: int, steps: int) -> dict[str, float]:
    """One engine and ``n`` in this process: the figures of the table's row."""
    import gpumem.allocator.caching as caching
    from gpumem import sim
    from gpumem.allocator import CachingAllocator

    planner_s = [0.0]
    real = caching.plan_step

    def timed_plan_step(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            planner_s[0] += time.perf_counter() - t0

    caching.plan_step = timed_plan_step

    def make() -> CachingAllocator:
        return CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)

    def step(alloc: CachingAllocator) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            alloc.free(alloc.allocate(PAIR_NBYTES))
        return time.perf_counter() - t0

    alloc = make()
    for _ in range(2):   # two recorded steps
        alloc.mark_step()
        step(alloc)
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    alloc.mark_step()    # READY: planned and installed
    mark_s = time.perf_counter() - t0
    rss1 = _rss_mib()
    planned = [step(alloc)]
    for _ in range(steps):
        alloc.mark_step()
        planned.append(step(alloc))
    info = alloc.step_plan_info()
    if info.plans_installed != 1 or info.fallback != 0:
        raise SystemExit(f"{engine}, n={n}: the plan did not serve every allocation: {info}")
    bare = make()
    unmarked = [step(bare) for _ in range(steps + 1)]
    return {"mark_s": mark_s, "planner_s": planner_s[0], "rss_mib": rss1 - rss0,
            "planned_s": statistics.median(planned[1:]), "unmarked_s": statistics.median(unmarked[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_plan_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[3000, 10000], help="allocate/free pairs per step")
    parser.add_argument("--engines", nargs="+", default=["native", "python"], choices=["native", "python"])
    parser.add_argument("--steps", type=int, default=3, help="planned steps timed (the median is shown)")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.n and min(args.n) < 1 or args.steps < 1:
        parser.error("--n and --steps must be positive")
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.steps)))
        return 0
    print(f"{'engine':<7} {'n':>7} {'mark s':>8} {'planner s':>10} {'install s':>10} {'RSS + MiB':>10} "
          f"{'planned ms':>11} {'unmarked ms':>12} {'ratio':>6}")
    for engine in args.engines:
        for n in args.n:
            out = subprocess.run([sys.executable, "-m", "benchmarks.step_plan_scale", "--child", engine, str(n),
                                  "--steps", str(args.steps)], cwd=ROOT, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{engine:<7} {n:>7} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{engine:<7} {n:>7} {r['mark_s']:>8.3f} {r['planner_s']:>10.3f} {r['mark_s'] - r['planner_s']:>10.3f} "
                  f"{r['rss_mib']:>10.1f} {1e3 * r['planned_s']:>11.1f} {1e3 * r['unmarked_s']:>12.1f} "
                  f"{r['planned_s'] / r['unmarked_s']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
