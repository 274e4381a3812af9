"""Where the peak of a planned training trace falls, step by step, with the plan laid out as the lowest (before
Note [A plan laid out for its first step]) and for its first step (now). Replays on the Python engine, the default
policy, ``gpu_timing="trace"``, ``sim:h200-141gb``; from the repository root (about 30 s)::

    python reports/plan-first-step-2026-12-05/steps.py > reports/plan-first-step-2026-12-05/steps.txt
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
from gpumem.trace.corpus import corpus_part  # noqa: E402

TRACES = ("gpt2_fp32_train_h200", "gpt2_bf16_train_h200", "resnet50_train_h200", "vit_train_h200", "unet_train_h200")


def phases(path: Path, first_step: bool) -> tuple[float, dict[str, float]]:
    """The run's overhead, and the most reserved in the recorded steps, the first planned step and the steps after
    it, as a share of peak allocated above it."""
    real = caching.plan_step

    def lowest(t, *args, **kwargs):
        kwargs.pop("page_nbytes", None)
        return real(t, *args, **kwargs)

    if not first_step:
        caching.plan_step = lowest
    try:
        alloc = CachingAllocator(open_device("sim:h200-141gb"), get_policy("gpumem"), engine="python")
        most: dict[str, int] = {}
        allocate, free = alloc.allocate, alloc.free

        def look() -> None:
            info = alloc.step_plan_info()
            if info.state.name.startswith("RECORDING"):
                phase = "recorded"
            elif info.state.name == "PLANNED":
                phase = "first planned" if info.steps_hit + info.steps_missed == 0 else "after"
            else:
                return
            most[phase] = max(most.get(phase, 0), alloc.reserved_nbytes)

        def allocate_and_look(nbytes: int, stream: int = 0) -> int:
            ptr = allocate(nbytes, stream)
            look()
            return ptr

        def free_and_look(ptr: int) -> None:
            free(ptr)
            look()

        alloc.allocate, alloc.free = allocate_and_look, free_and_look  # type: ignore[method-assign]
        result = replay(load_trace(path), alloc, progress=False, gpu_timing="trace")
        alloc.close()
    finally:
        caching.plan_step = real
    base = result.peak_live_bytes
    return result.overhead, {k: v / base - 1 for k, v in most.items()}


def main() -> int:
    print("| trace | part | layout | overhead | recorded steps | first planned step | planned steps after it |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name in TRACES:
        path = Path("data/traces") / f"{name}.snapshot.pickle.gz"
        for first_step in (False, True):
            overhead, most = phases(path, first_step)
            cells = " | ".join(f"{most[k]:.3%}" if k in most else "" for k in ("recorded", "first planned", "after"))
            print(f"| {name} | {corpus_part(path).value} | {'first step' if first_step else 'lowest'} | "
                  f"{overhead:.3%} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
