"""What a block kept past its planned step costs (Note [Allocations kept past their step] in
``gpumem/allocator/plan.py``): each step allocates and frees a temporary of ``--temp-mib``, then a 512 B block
the plan places where the temporary was; the block is kept (never freed) on some steps. Unlimited memory, on
the simulator (an H200's 141 GB), both engines.

Rows: the temporary, which steps keep their block (``once``: step 5; ``every 10th``; ``every step``), and the
allocator (unmarked: no ``mark_step``; marked: a step plan). Columns: *held* (reserved at the end), *peak*
(peak reserved), *plans* installed / dropped, *missed* steps. Prints one table::

    python -m benchmarks.step_plan_kept --steps 200 --temp-mib 4096 100
"""

from __future__ import annotations

import argparse


def run(engine: str, marks: bool, steps: int, temp_nbytes: int, keep: str) -> dict[str, int]:
    from gpumem import sim
    from gpumem.allocator import CachingAllocator

    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)
    for i in range(steps):
        if marks:
            alloc.mark_step()
        alloc.free(alloc.allocate(temp_nbytes))
        s = alloc.allocate(512)
        kept = i == 5 if keep == "once" else i % 10 == 9 if keep == "every 10th" else True
        if not kept:
            alloc.free(s)
    alloc.check_consistency()
    st, info = alloc.stats, alloc.step_plan_info()
    out = {"held": st.reserved_nbytes, "peak": st.peak_reserved_nbytes, "installed": info.plans_installed,
           "dropped": info.plans_dropped, "missed": info.steps_missed}
    alloc.close()
    return out


def main(argv: list[str] | None = None) -> None:
    from gpumem.native import load_engine
    from gpumem.units import MiB, format_bytes

    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_plan_kept", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--temp-mib", type=int, nargs="+", default=[4096, 100])
    ap.add_argument("--keep", nargs="+", default=["once", "every 10th", "every step"])
    ap.add_argument("--engines", nargs="+", default=["native", "python"])
    args = ap.parse_args(argv)
    engines = [e for e in args.engines if e != "native" or load_engine() is not None]
    print(f"{'engine':<7} {'temporary':>10} {'kept':<11} {'allocator':<9} {'held':>12} {'peak':>12} "
          f"{'plans':>6} {'dropped':>7} {'missed':>6}")
    for engine in engines:
        for temp in args.temp_mib:
            for keep in args.keep:
                for marks in (False, True):
                    r = run(engine, marks, args.steps, temp * MiB, keep)
                    print(f"{engine:<7} {format_bytes(temp * MiB):>10} {keep:<11} {'marked' if marks else 'unmarked':<9} "
                          f"{r['held'] / MiB:>8,.0f} MiB {r['peak'] / MiB:>8,.0f} MiB {r['installed']:>6} "
                          f"{r['dropped']:>7} {r['missed']:>6}")


if __name__ == "__main__":
    main()
