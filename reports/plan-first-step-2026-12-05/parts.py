"""What the first planned step holds beyond live bytes, in the arena and in the engine, at the op where its memory
held peaks, against the same op one step later (today's layout; ``--lowest``: the layout of least height, as
before). Replays on the Python engine, the default policy,
``gpu_timing="trace"``, ``sim:h200-141gb``; from the repository root (about 10 s)::

    python reports/plan-first-step-2026-12-05/parts.py > reports/plan-first-step-2026-12-05/parts.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpumem.allocator.caching as caching  # noqa: E402
from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.policy import get_policy  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

TRACES = ("gpt2_bf16_train_h200", "resnet50_train_h200", "vit_train_h200", "unet_train_h200")
MB = 1e6


def parts(path: Path) -> str:
    alloc = CachingAllocator(open_device("sim:h200-141gb"), get_policy("gpumem"), engine="python")
    steps: dict[int, list[tuple[int, int, int, int, int]]] = {}   # planned step -> per op
    allocate, free = alloc.allocate, alloc.free

    def look() -> None:
        info = alloc.step_plan_info()
        if info.state.name == "PLANNED":
            steps.setdefault(info.steps_hit + info.steps_missed, []).append(
                (alloc.reserved_nbytes, alloc.allocated_nbytes, info.mapped_nbytes, info.live_nbytes,
                 alloc.backing.reserved_nbytes))

    def allocate_and_look(nbytes: int, stream: int = 0) -> int:
        ptr = allocate(nbytes, stream)
        look()
        return ptr

    def free_and_look(ptr: int) -> None:
        free(ptr)
        look()

    alloc.allocate, alloc.free = allocate_and_look, free_and_look  # type: ignore[method-assign]
    replay(load_trace(path), alloc, progress=False, gpu_timing="trace")
    alloc.close()
    first, second = steps[0], steps[1]
    k = max(range(len(first)), key=lambda j: first[j][0])
    cells = []
    for _, allocated, mapped, arena_live, engine_held in (first[k], second[k]):
        cells += [f"{(mapped - arena_live) / MB:.1f}", f"{(engine_held - (allocated - arena_live)) / MB:.1f}"]
    return f"| {path.name.split('.')[0]} | {k} | " + " | ".join(cells) + " |"


def main() -> int:
    if "--lowest" in sys.argv[1:]:
        real = caching.plan_step

        def lowest(t, *args, **kwargs):
            kwargs.pop("page_nbytes", None)
            return real(t, *args, **kwargs)

        caching.plan_step = lowest
    print("| trace | peak op of the first planned step | arena: mapped less live, MB | engine: held less live, MB "
          "| the same op a step later: arena, MB | engine, MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in TRACES:
        print(parts(Path("data/traces") / f"{name}.snapshot.pickle.gz"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
