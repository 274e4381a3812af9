"""Where the memory held at the peak lies, per trace of the corpus: the study behind issue 18's placement work.

For each trace of a part of the corpus (``gpumem.trace.corpus``: tuning and check reported apart) and each
GPU timing, the trace is replayed on a simulated device (default ``sim:h200-141gb``) under the default
policy (``--set NAME=VALUE`` changes a knob) on the Python engine, whose backing can be read
(:meth:`~gpumem.allocator.backing.VirtualBacking.held_breakdown`). When the memory held reaches its peak,
the overhead (peak reserved / peak allocated - 1) is split into its parts, as shares of peak allocated, at the moment
the memory held is at its peak with the most live data then:

* **live pages**: pages touched by live blocks then, less peak allocated (the partial pages at the edges of
  live blocks; negative when the memory held peaks away from the live peak);
* **locked**: empty pages of chunks that still hold live pages (and how many such chunks);
* **idle**: whole idle chunks (within the slack, or created while the idle ones were busy);
* **cached**: chunks held but mapped nowhere.

It also counts the memory calls (create, map, unmap, release) of the whole replay and of its second half
(the steady state, the step-time proxy). Usage::

    python -m sim.peak_composition [--part tuning|check] [--gpu-timing idle,trace] [--only SUBSTR,...]
                                   [--set chunk_max_fraction=0.0009765625 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.backing import HeldBreakdown, VirtualBacking  # noqa: E402
from gpumem.allocator.policy import AllocatorPolicy, get_policy  # noqa: E402
from gpumem.errors import InvalidArgumentError  # noqa: E402
from gpumem.progress import ProgressBar  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import Trace, load_trace  # noqa: E402
from gpumem.trace.corpus import corpus_part, corpus_traces  # noqa: E402

MEMORY_CALLS = ("mem_create", "mem_map", "mem_unmap", "mem_release")


@dataclasses.dataclass(frozen=True)
class PeakComposition:
    """One replay: its overhead, the breakdown of the memory held when it peaked, and its memory calls."""

    trace: str
    gpu_timing: str
    overhead: float
    peak_allocated_nbytes: int
    peak_reserved_nbytes: int
    at_peak: HeldBreakdown
    memory_calls: int
    memory_calls_second_half: int


def peak_composition(trace: Trace, policy: AllocatorPolicy, device_spec: str = "sim:h200-141gb",
                     gpu_timing: str = "idle", label: str | None = None) -> PeakComposition:
    """Replay ``trace`` under ``policy`` (Python engine, virtual memory) and break down its peak; ``label``
    names the row (default: the trace's name).

    Raises:
        InvalidArgumentError: the policy does not run on a virtual-memory backing on ``device_spec``.
    """
    dev = open_device(device_spec)
    calls: Counter[str] = Counter()
    for kind in MEMORY_CALLS:
        def counted(*args: Any, _fn: Any = getattr(dev, kind), _kind: str = kind) -> Any:
            out = _fn(*args)
            calls[_kind] += 1
            return out
        setattr(dev, kind, counted)
    alloc = CachingAllocator(dev, policy, engine="python")
    backing = alloc.backing
    if not isinstance(backing, VirtualBacking):
        raise InvalidArgumentError(f"policy {policy.name!r} on {device_spec} does not use virtual memory: "
                                   "nothing to break down")
    n_ops = trace.n_ops
    state: dict[str, Any] = {"ops": 0, "half": None, "peak": (-1, -1), "at_peak": None}
    allocate, free = alloc.allocate, alloc.free

    def tick() -> None:
        state["ops"] += 1
        if state["ops"] == n_ops // 2:
            state["half"] = sum(calls.values())

    def allocate_and_look(nbytes: int, stream: int = 0) -> int:
        tick()
        ptr = allocate(nbytes, stream)
        # the moment the memory held is at its peak with the most live data then
        now = (backing.reserved_nbytes, alloc.allocated_nbytes)
        if now > state["peak"]:
            state["peak"] = now
            state["at_peak"] = backing.held_breakdown()
        return ptr

    def free_and_count(ptr: int) -> None:
        tick()
        free(ptr)

    alloc.allocate, alloc.free = allocate_and_look, free_and_count  # type: ignore[method-assign]
    result = replay(trace, alloc, progress=False, gpu_timing=gpu_timing)
    alloc.check_consistency()
    total = sum(calls.values())
    stats = result.stats
    alloc.close()
    return PeakComposition(label or trace.name, gpu_timing, result.overhead, stats.peak_allocated_nbytes,
                           stats.peak_reserved_nbytes, state["at_peak"] or HeldBreakdown(0, 0, 0, 0, 0), total,
                           total - (state["half"] or 0))


def table(rows: list[PeakComposition], part: str) -> str:
    out = [f"### {part} part", "",
           "| trace | timing | overhead | live pages | locked (chunks) | idle | cached | memory calls | second half |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        a, base = r.at_peak, r.peak_allocated_nbytes or 1
        out.append(f"| {r.trace} | {r.gpu_timing} | {r.overhead:.3%} | {(a.live_nbytes - base) / base:+.3%} | "
                   f"{a.locked_nbytes / base:.3%} ({a.locked_chunks}) | {a.idle_nbytes / base:.3%} | "
                   f"{a.cached_nbytes / base:.3%} | {r.memory_calls:,} | {r.memory_calls_second_half:,} |")
    return "\n".join(out)


def trace_label(path: Path) -> str:
    """The file name less its compression and container suffixes (``resnet_train.rmm_log``)."""
    name = path.name
    for suffix in (".gz", ".pickle", ".csv"):
        name = name.removesuffix(suffix)
    return name


def parse_knob(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set wants NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.peak_composition", description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("tuning", "check"), default="tuning")
    ap.add_argument("--gpu-timing", default="idle,trace", help="comma-separated: idle, trace, model")
    ap.add_argument("--device", default="sim:h200-141gb")
    ap.add_argument("--only", default="", help="comma-separated substrings of the trace names to replay")
    ap.add_argument("--set", type=parse_knob, action="append", default=[], metavar="NAME=VALUE",
                    help="a policy knob on top of the default policy (JSON value)")
    args = ap.parse_args(argv)
    policy = dataclasses.replace(get_policy("gpumem"), name="study", **dict(args.set))
    only = [s for s in args.only.split(",") if s]
    paths = [p for p in corpus_traces(args.part) if not only or any(s in p.name for s in only)]
    timings = [t for t in args.gpu_timing.split(",") if t]
    rows = []
    bar = ProgressBar(len(paths) * len(timings), "peak composition")
    for path in paths:
        trace = load_trace(path)
        for timing in timings:
            rows.append(peak_composition(trace, policy, args.device, timing, trace_label(path)))
            bar.update(len(rows))
    bar.close()
    print(table(rows, corpus_part(paths[0]).value if paths else args.part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
