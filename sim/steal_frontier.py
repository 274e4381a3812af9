"""Memory against driver calls per step: the growth knobs that set how often the engine moves memory.

Issue 18. The VMM stall probe (``reports/hil/vmm-stall-h200-2026-11-25.md``) found that no VMM call waits
for queued GPU work and the GPU does not pause for page-table changes: a steal costs its calls' CPU
time, about 40 µs per driver memory call live (run 2, ``live-vs-predicted-h200-2026-11-25-run2.md``).
So a setting's step-time cost is its driver calls per step, whenever they are made, and the policy
question is which settings hold the least memory for a given number of calls. This sweep replays
traces with ``--gpu-timing trace`` on ``sim:h200-141gb`` (the replay that predicts live memory within
0.12 pp on GPT-2 and ResNet-50) over ``chunk_max_fraction``, ``stream_ordered_steal`` and
``page_slack``, and prints, per trace and setting, the overhead (peak reserved over peak allocated),
driver memory and event calls per timed step (the calls of the whole trace less those of its first
quarter, the 20 warm-up steps of 80: growth is done by then), and the step time those calls cost at
``--us-per-call`` (default 40, the live figure) as a share of PyTorch's step time in run 2.

With ``--corpus`` it replays instead every trace of ``data/traces`` (tuning part, then check part) under
the default policy and the memory-first setting C, with the calls of each trace's second half (after
growth, as steps repeat) per thousand operations there.

    python -m sim.steal_frontier [--traces gpt2 resnet50] [--json build/frontier.json]
    python -m sim.steal_frontier --corpus [--json build/frontier-corpus.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

from gpumem.allocator.policy import POLICIES, AllocatorPolicy
from gpumem.progress import progress
from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.corpus import CorpusPart, corpus_traces

RUN2 = Path("reports/hil/live-h200-2026-11-25-run2")
#: the live traces of run 2 (80 steps each, 20 of them warm-up: the train probe's ``--steps`` counts the warm-up)
#: and the step time of PyTorch's allocator there (ms)
LIVE = {"gpt2": (RUN2 / "gpt2.gmt.gz", 98.16), "resnet50": (RUN2 / "resnet50.gmt.gz", 35.34)}
WARMUP_STEPS, STEPS = 20, 80
FRACTIONS = (1 / 256, 1 / 512, 1 / 1024)
SLACKS = (0.005, 0.01, 0.02)


def settings() -> list[AllocatorPolicy]:
    """The grid: every chunk cap x ordered steal x page slack, named like ``f1024-s1-p0.005``."""
    out = []
    for frac, steal, slack in itertools.product(FRACTIONS, (False, True), SLACKS):
        name = f"f{round(1 / frac)}-s{int(steal)}-p{slack}"
        out.append(dataclasses.replace(POLICIES["gpumem"], name=name, chunk_max_fraction=frac,
                                       stream_ordered_steal=steal, page_slack=slack))
    return out


def corpus_rows() -> list[dict]:
    """The default policy and setting C on every corpus trace: overhead, and driver and event calls per
    thousand operations of the trace's second half."""
    pols = [dataclasses.replace(POLICIES["gpumem"], name="default"),
            dataclasses.replace(POLICIES["gpumem"], name="C", chunk_max_fraction=1 / 1024, stream_ordered_steal=True)]
    paths = [(part, p) for part in CorpusPart for p in corpus_traces(part)]
    rows = []
    with progress(len(paths) * len(pols), "replays", "replay") as bar:
        for part, path in paths:
            trace = load_trace(path)
            half = trace.head(trace.n_ops // 2)
            for pol in pols:
                r = replay_trace(trace, "sim:h200-141gb", pol, progress=False, gpu_timing="trace")
                h = replay_trace(half, "sim:h200-141gb", pol, progress=False, gpu_timing="trace")
                kops = (trace.n_ops - half.n_ops) / 1e3
                rows.append({"part": part.value, "trace": path.name.removesuffix(".gz"), "setting": pol.name,
                             "overhead": r.overhead, "ooms": r.ooms,
                             "calls_per_kop": (r.stats.device_calls - h.stats.device_calls) / kops,
                             "event_calls_per_kop": (r.stats.event_calls - h.stats.event_calls) / kops})
                bar.update(1)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.steal_frontier", description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="*", default=list(LIVE), choices=list(LIVE), help="live traces to replay")
    p.add_argument("--us-per-call", type=float, default=40.0, help="live cost of one driver memory call (µs)")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--corpus", action="store_true", help="the corpus traces under the default policy and C instead")
    args = p.parse_args(argv)
    if not math.isfinite(args.us_per_call) or args.us_per_call < 0:
        p.error(f"--us-per-call must be a finite number >= 0, got {args.us_per_call}")
    if args.json is not None and not args.json.parent.is_dir():   # checked before the long run, not after
        p.error(f"--json: no folder {args.json.parent}")
    if args.corpus:
        rows = corpus_rows()
        print("| part | trace | setting | overhead | driver calls / 1k ops, second half | event calls / 1k ops |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['part']} | {r['trace']} | {r['setting']} | {r['overhead']:.2%} | {r['calls_per_kop']:.2f} | "
                  f"{r['event_calls_per_kop']:.2f} |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    grid = settings()
    rows = []
    with progress(len(grid) * len(args.traces), "replays", "replay") as bar:
        for name in args.traces:
            path, step_ms = LIVE[name]
            trace = load_trace(path)
            warm = trace.head(trace.n_ops * WARMUP_STEPS // STEPS)
            timed = STEPS - WARMUP_STEPS
            for pol in grid:
                r = replay_trace(trace, "sim:h200-141gb", pol, progress=False, gpu_timing="trace")
                w = replay_trace(warm, "sim:h200-141gb", pol, progress=False, gpu_timing="trace")
                calls = (r.stats.device_calls - w.stats.device_calls) / timed
                events = (r.stats.event_calls - w.stats.event_calls) / timed
                rows.append({"trace": name, "setting": pol.name, "overhead": r.overhead,
                             "calls_per_step": calls, "event_calls_per_step": events,
                             "cost_pct": calls * args.us_per_call / 1e3 / step_ms * 100})
                bar.update(1)
    print("| trace | setting | overhead | driver calls / timed step | event calls / timed step | calls' cost, % of step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trace']} | {r['setting']} | {r['overhead']:.2%} | {r['calls_per_step']:.1f} | "
              f"{r['event_calls_per_step']:.1f} | {r['cost_pct']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
