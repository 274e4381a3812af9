"""What the step-plan layer holds once a program stops marking steps (Note [When marks stop] in
``gpumem/allocator/plan.py``; review attacker 11, F1 and F2). On the simulator (an H200), both engines, each
case in a process of its own.

Cases:

- ``recording``: two marked steps that differ (nothing planned), then ``--churn`` allocate/free pairs of
  512-3,584 B with no mark. Host memory grown over the churn: the process's RSS (native engine) or
  ``tracemalloc``'s current (Python engine), against ``unmarked`` (the same churn, never marked); ``records``
  held at the end.
- ``planned``: six marked steps of a training-like step (seven temporaries of 0.7 KiB-9 MiB, two living into
  the next step: a plan installs at the third mark), then ``--steps`` of the same step with no mark, against
  the same program never marked. *held*: reserved at the end; *after empty_cache*: reserved after it;
  *arena*: the plan's mapped bytes at the end.
- ``replay``: six marked steps, everything freed, then no mark and no allocation (a CUDA-graph replay):
  *arena* before and after ``empty_cache``.

Prints one table::

    python -m benchmarks.step_plan_marks_stop --churn 1000000 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 1 << 20
STEP = [(3 * MiB, 2), (1 * MiB + 5, 1), (5 * MiB, 4), (700, 1), (2 * MiB, 3), (9 * MiB, 2), (4 * MiB, 3)]
"""(size, freed how many allocations later): the last ones live into the next step."""


def _rss_nbytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _steps(alloc, n: int, mark: bool, live: list, clock: list) -> None:
    for _ in range(n):
        if mark:
            alloc.mark_step()
        for size, life in STEP:
            for e in [e for e in live if e[1] <= clock[0]]:
                alloc.free(e[0])
                live.remove(e)
            clock[0] += 1
            live.append([alloc.allocate(size), clock[0] + life])


def run_one(engine: str, case: str, marked: bool, churn: int, steps: int) -> dict:
    import gc
    import tracemalloc

    from gpumem import sim
    from gpumem.allocator import CachingAllocator

    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)
    out: dict = {}
    if case == "recording":
        if marked:
            for i in range(2):
                alloc.mark_step()
                alloc.free(alloc.allocate((i + 1) * MiB))
        gc.collect()
        if engine == "python":
            tracemalloc.start()
        rss0 = _rss_nbytes()
        for i in range(churn):
            alloc.free(alloc.allocate(512 + (i % 7) * 512))
        out["host"] = (tracemalloc.get_traced_memory()[0] if engine == "python" else _rss_nbytes() - rss0)
    else:
        live: list = []
        clock = [0]
        _steps(alloc, 6, marked, live, clock)
        if case == "planned":
            _steps(alloc, steps, False, live, clock)
        else:
            for e in live:
                alloc.free(e[0])
            live.clear()
        out["arena"] = alloc.step_plan_info().mapped_nbytes
        out["held"] = alloc.snapshot_stats().reserved_nbytes
        alloc.empty_cache()
        out["after_empty_cache"] = alloc.snapshot_stats().reserved_nbytes
        out["arena_after_empty_cache"] = alloc.step_plan_info().mapped_nbytes
    info = alloc.step_plan_info()
    out["state"] = info.state_name
    out["records"] = getattr(info, "records", None)   # the field came with the bound
    alloc.check_consistency()
    return out


def main(argv: list[str] | None = None) -> None:
    from gpumem.native import load_engine

    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_plan_marks_stop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--churn", type=int, default=1_000_000, help="allocations with no mark (recording case)")
    ap.add_argument("--python-churn", type=int, default=200_000, help="the same for the Python engine")
    ap.add_argument("--steps", type=int, default=1000, help="steps with no mark (planned case)")
    ap.add_argument("--engines", nargs="+", default=["native", "python"])
    ap.add_argument("--one", nargs=3, metavar=("ENGINE", "CASE", "MARKED"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        engine, case, marked = args.one
        churn = args.churn if engine == "native" else args.python_churn
        print(json.dumps(run_one(engine, case, marked == "1", churn, args.steps)))
        return
    engines = [e for e in args.engines if e != "native" or load_engine() is not None]
    print(f"{'engine':<7} {'case':<10} {'allocator':<9} {'state':<14} {'records':>8} {'host +':>10} "
          f"{'arena':>8} {'held':>8} {'after empty_cache':>18}")
    for engine in engines:
        for case in ("recording", "planned", "replay"):
            for marked in (False, True):
                cmd = [sys.executable, "-m", "benchmarks.step_plan_marks_stop", "--churn", str(args.churn),
                       "--python-churn", str(args.python_churn), "--steps", str(args.steps),
                       "--one", engine, case, "1" if marked else "0"]
                r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

                def mib(key: str) -> str:
                    return f"{r[key] / MiB:.1f}" if key in r else "-"

                print(f"{engine:<7} {case:<10} {'marked' if marked else 'unmarked':<9} {r['state']:<14} "
                      f"{'-' if r['records'] is None else r['records']:>8} {mib('host'):>10} {mib('arena'):>8} "
                      f"{mib('held'):>8} {mib('after_empty_cache'):>18}")


if __name__ == "__main__":
    main()
