"""Where the memory held at the peak lies in the traces whose step plan forms (issue 18): the plan's arena
(pages mapped, bytes live) and the engine beside it (pages held, bytes live), at the op where the memory held
peaks, and the plan's height against its items' most bytes alive at once. Replays on the Python engine, the
default policy, ``gpu_timing="trace"``; from the repository root::

    python reports/plan-peak-2026-12-03/breakdown.py > reports/plan-peak-2026-12-03/breakdown.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpumem.allocator.plan as plan_mod  # noqa: E402
from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.policy import get_policy  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402
from gpumem.trace.corpus import corpus_part  # noqa: E402

TRACES = ("gpt2_fp32_train_h200", "gpt2_bf16_train_h200", "resnet50_train_h200", "vit_train_h200", "unet_train_h200")


def breakdown(path: Path) -> str:
    plans: list[tuple[int, int]] = []   # (height, most bytes alive) of each plan made
    made = plan_mod.plan

    def spy(items, planner=plan_mod.Planner.GREEDY_BEST):
        offs = made(items, planner)
        plans.append((plan_mod.plan_height(items, offs), items.max_live_nbytes()))
        return offs

    plan_mod.plan = spy
    try:
        trace = load_trace(path)
        alloc = CachingAllocator(open_device("sim:h200-141gb"), get_policy("gpumem"), engine="python")
        peak = {"reserved": -1}
        allocate, free = alloc.allocate, alloc.free

        def look() -> None:
            if alloc.reserved_nbytes > peak["reserved"]:
                info = alloc.step_plan_info()
                peak.update(reserved=alloc.reserved_nbytes, allocated=alloc.allocated_nbytes,
                            arena_mapped=info.mapped_nbytes, arena_live=info.live_nbytes,
                            engine_held=alloc.backing.reserved_nbytes, state=info.state.name)

        def allocate_and_look(nbytes: int, stream: int = 0) -> int:
            ptr = allocate(nbytes, stream)
            look()
            return ptr

        def free_and_look(ptr: int) -> None:
            free(ptr)
            look()

        alloc.allocate, alloc.free = allocate_and_look, free_and_look  # type: ignore[method-assign]
        result = replay(trace, alloc, progress=False, gpu_timing="trace")
        alloc.close()
    finally:
        plan_mod.plan = made
    base = result.peak_live_bytes
    p = peak
    engine_live = p["allocated"] - p["arena_live"]
    heights = ", ".join(f"{h / m - 1:+.3%}" for h, m in plans) or "none"
    return (f"| {trace.name} | {corpus_part(path).value} | {result.overhead:.3%} | {p['state']} | "
            f"{(p['arena_mapped'] - p['arena_live']) / base:.3%} | {(p['engine_held'] - engine_live) / base:.3%} | "
            f"{(p['allocated'] - base) / base:+.3%} | {heights} |")


def main() -> int:
    print("| trace | part | overhead | plan state at the peak | arena: mapped less live | engine: held less live "
          "| allocated then less peak allocated | plan height less its items' most alive |")
    print("|---|---|---:|---|---:|---:|---:|---|")
    for name in TRACES:
        print(breakdown(Path("data/traces") / f"{name}.snapshot.pickle.gz"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
