"""Replay training traces through gpumem's engine with the program's steps marked: the step plan as built.

``sim/step_plan.py`` studied a prototype (``PlanResource``) beside gpumem's caching allocator; this replays
the same traces through :class:`gpumem.allocator.CachingAllocator` itself (the native engine, its plan layer:
Note [Step plans] in :mod:`gpumem.allocator.plan`) and calls ``mark_step()`` where the program would call
``gpumem.torch.step()``. The traces are read without the marks gpumem.torch would make at their optimizer
steps (``load_trace(..., step_marks=False)``; Note [Step marks read off a snapshot's optimizer steps]): the marks
are put where
:func:`sim.step_plan.find_period` finds the steps (exact signature, the boundary where the fewest bytes are
live, :func:`sim.step_plan.split_steps`), from the first steady step on, and at every period after the
repeating stretch: later than a program calling ``step()`` from its first step would (the setup and the
first training steps are not marked). Per trace and GPU timing (``idle``, ``trace``) five replays: the default
policy unmarked; marked under the default policy without its warm-up (``plan_warmup=False``); marked under
the default policy, whose memory-first warm-up (Note [A memory-first warm-up] in
:mod:`gpumem.allocator.plan`) begins at the first mark; the same with the warm-up begun before the first
allocation (``start_plan_warmup()``: what gpumem.torch's automatic marks, on by default, do when the first
optimizer on a GPU is made, before the first step; the row to read for a gpumem.torch program); and marked
under the memory-first policy for the whole run. Each reports peak reserved over peak live (requested bytes) over the whole trace and over the
steady steps after the plan took over (from the second planned step), the driver + event calls per such step,
and the plan's counters. A trace whose period is not a training step (a layer's: a few dozen allocations,
see the period and marks columns) plans that instead, which says little about step plans.

    python -m sim.step_plan_engine [--traces gpt2_fp32_train_h200 resnet50_train_h200] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any


from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import MarkResult
from gpumem.allocator.policy import DEFAULT_POLICY, get_policy
from gpumem.allocator.stats import AllocatorStats
from gpumem.errors import GpumemError, InvalidArgumentError
from gpumem.replay import replay
from gpumem.sim.gpu_work import gpu_timing
from gpumem.specs import open_device
from gpumem.trace import Trace, load_trace
from gpumem.trace.corpus import CorpusPart, corpus_traces
from gpumem.trace.limits import printable

from sim.cli_checks import json_target_problem
from sim.step_plan import DEVICE_SPEC, MEMORY_FIRST_POLICY, Lifetimes, Signature, find_period, signatures, split_steps

DEFAULT_TRACES = ("gpt2_fp32_train_h200", "resnet50_train_h200")


@dataclasses.dataclass
class EngineRow:
    """One replay: a trace through the engine under one policy and GPU timing, steps marked or not."""

    trace: str
    policy: str
    gpu_timing: str
    marked: bool
    warmup_at_start: bool
    """``start_plan_warmup()`` before the first allocation, as automatic marks call it when the first optimizer on
    a GPU is made, before the first step (Note [A memory-first
    warm-up] in :mod:`gpumem.allocator.plan`); else the warm-up begins at the first mark (where the policy has it)."""
    period: int
    marks: int
    overhead: float
    """Peak reserved over peak live (requested), whole trace, minus 1."""
    steady_overhead: float
    """The same from the second planned step to the last mark (NaN: no plan or too few steps)."""
    calls_per_steady_step: float
    """Driver + event calls per step over the same steps."""
    plan: dict[str, int]
    peak_live_nbytes: int
    peak_reserved_nbytes: int


class _Marked:
    """What :func:`gpumem.replay.replay` drives: the allocator, ``mark_step()`` before the allocations at
    ``mark_ranks``, and peak live / reserved kept as it goes (whole trace, and from ``count_from`` on)."""

    def __init__(self, alloc: CachingAllocator, mark_ranks: list[int]) -> None:
        self.alloc, self.device, self.policy, self.engine = alloc, alloc.device, alloc.policy, alloc.engine
        self.record_stream = alloc.record_stream
        self.marks = set(mark_ranks)
        self.rank = 0
        self.sizes: dict[int, int] = {}
        self.live = self.peak_live = self.peak_reserved = 0
        self.installed_at: int | None = None
        self.count_from = self.count_to = -1
        self.steady_live = self.steady_reserved = 0
        self.calls: list[int] = []
        self.n_marks = 0

    def allocate(self, nbytes: int, stream: int = 0) -> int:
        r = self.rank
        self.rank = r + 1
        if r in self.marks:
            self.n_marks += 1
            if self.installed_at is not None:
                st = self.alloc.stats
                self.calls.append(st.device_calls + st.event_calls)
            result = self.alloc.mark_step()
            if result is MarkResult.READY and self.alloc.step_plan_info().plans_installed:
                self.installed_at = r
        ptr = self.alloc.allocate(nbytes, stream)
        self.sizes[ptr] = nbytes
        self.live += nbytes
        reserved = self.alloc.reserved_nbytes
        self.peak_live = max(self.peak_live, self.live)
        self.peak_reserved = max(self.peak_reserved, reserved)
        if len(self.calls) >= 2:   # from the second planned step on (the first maps the arena)
            self.steady_live = max(self.steady_live, self.live)
            self.steady_reserved = max(self.steady_reserved, reserved)
        return ptr

    def free(self, ptr: int) -> None:
        self.alloc.free(ptr)
        self.live -= self.sizes.pop(ptr)

    def snapshot_stats(self) -> AllocatorStats:
        st = self.alloc.snapshot_stats()
        st.peak_requested_nbytes = self.peak_live
        return st


def step_marks(trace: Trace) -> tuple[int, list[int]]:
    """The period and the allocation ranks a program marking every step would mark: the steady steps of
    :func:`sim.step_plan.split_steps` and every period after them.

    Raises:
        InvalidArgumentError: no stretch of the trace repeats twice.
    """
    life = Lifetimes.of(trace)
    per = find_period(signatures(life, Signature.EXACT))
    if per is None:
        raise InvalidArgumentError(f"{trace.name}: no stretch repeats twice, no step to mark")
    steps = split_steps(life, per, trace.live_nbytes())
    ranks = list(range(int(steps.starts[0]), life.n_allocs, steps.period))
    return steps.period, ranks


def run(trace: Trace, label: str, policy: Any, timing: str, marked: bool,
        marks: tuple[int, list[int]] | None = None, warmup_at_start: bool = False) -> EngineRow:
    """One row: ``trace`` replayed under ``policy`` and ``timing``, its steps marked or not (``marks``: those of
    :func:`step_marks`, found here when None); ``warmup_at_start``: see :attr:`EngineRow.warmup_at_start`."""
    period, ranks = step_marks(trace) if marks is None else marks
    with open_device(DEVICE_SPEC) as dev:
        alloc = CachingAllocator(dev, policy)
        if warmup_at_start:
            alloc.start_plan_warmup()
        driver = _Marked(alloc, ranks if marked else [])
        replay(trace, driver, gpu_timing=timing, progress=False)  # type: ignore[arg-type]
        plan = alloc.step_plan_info().as_dict()
        alloc.close()
    c = driver.calls
    steady = len(c) - 2   # calls[i]: at the mark closing planned step i; steps 1 .. len-1 counted from the second
    calls = (c[-1] - c[1]) / (len(c) - 2) if len(c) >= 3 else math.nan
    st_over = driver.steady_reserved / driver.steady_live - 1 if driver.steady_live and steady >= 1 else math.nan
    return EngineRow(label, policy.name, timing, marked, warmup_at_start, period, driver.n_marks,
                     driver.peak_reserved / driver.peak_live - 1, st_over, calls, plan, driver.peak_live,
                     driver.peak_reserved)


def print_rows(rows: list[EngineRow]) -> None:
    print("| trace | period / marks | engine policy | GPU timing | steps marked | whole trace | steady planned steps | driver + event "
          "calls per steady step | served / by the engine | steps hit / missed | plans | arena calls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r.plan
        pct = (lambda x: "n/a" if math.isnan(x) else f"{x:.2%}")
        warm = "no" if not r.marked else "yes, warm-up begun at the start" if r.warmup_at_start else "yes"
        print(f"| {r.trace} | {r.period} / {r.marks} | {r.policy} | {r.gpu_timing} | {warm} | {pct(r.overhead)} | "
              f"{pct(r.steady_overhead)} | {'n/a' if math.isnan(r.calls_per_steady_step) else f'{r.calls_per_steady_step:.1f}'} | "
              f"{p['served']:,} / {p['fallback']:,} | {p['steps_hit']} / {p['steps_missed']} | "
              f"{p['plans_installed']} installed, {p['plans_dropped']} dropped | {p['arena_calls']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.step_plan_engine",
                                 description=(__doc__ or "").split("\n    python -m")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="*", default=list(DEFAULT_TRACES), metavar="NAME",
                    help="trace files, or corpus traces by a prefix of the file name; default: %(default)s")
    ap.add_argument("--timings", default="idle,trace", help="GPU timings, comma-separated (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not args.traces:
        ap.error("--traces: name at least one trace (or leave the option out for the default two)")
    if args.json is not None and (why := json_target_problem(args.json)):
        ap.error(f"--json: {why}")
    try:   # every option checked before any replay
        timings = [gpu_timing(t).value for t in args.timings.split(",")]
    except InvalidArgumentError as exc:
        ap.error(f"--timings: {exc}")
    paths = {p.name: p for part in CorpusPart for p in corpus_traces(part)}
    studied: list[tuple[str, Trace, tuple[int, list[int]]]] = []
    for name in args.traces:
        match = [Path(name)] if Path(name).is_file() else [p for n, p in sorted(paths.items()) if n.startswith(name)]
        if not match:
            ap.error(f"--traces: {name} is no trace file, and no corpus trace starts with it")
        try:   # a file that is no trace, or a trace with no step to mark: one line, before any replay
            trace = load_trace(match[0], step_marks=False)
            studied.append((match[0].name.split(".")[0], trace, step_marks(trace)))
        except GpumemError as exc:
            ap.error(f"--traces: {printable(str(exc))}")
        except OSError as exc:
            ap.error(f"--traces: cannot read {match[0]}: {exc.strerror or exc}")
    rows: list[EngineRow] = []
    for label, trace, marks in studied:
        t0 = time.perf_counter()
        for timing in timings:
            default = get_policy(DEFAULT_POLICY)
            rows.append(run(trace, label, default, timing, marked=False, marks=marks))
            # the default before its warm-up, with it from the first mark, and from the start (automatic marks)
            rows.append(run(trace, label, dataclasses.replace(default, name=f"{default.name} (no warm-up)",
                                                              plan_warmup=False), timing, marked=True, marks=marks))
            rows.append(run(trace, label, default, timing, marked=True, marks=marks))
            rows.append(run(trace, label, default, timing, marked=True, marks=marks, warmup_at_start=True))
            rows.append(run(trace, label, MEMORY_FIRST_POLICY, timing, marked=True, marks=marks))
        print(f"{printable(label)}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
