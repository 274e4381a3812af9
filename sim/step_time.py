"""Step time the allocator's device calls add, predicted by the simulator, against the live H200 runs.

Issue 18. The live runs (``reports/hil/live-h200-2026-11-25-run4.md``, ``-run2.md``) measured GPT-2 and
ResNet-50 training under PyTorch's allocator, gpumem's default policy and the memory-first setting C
(chunks capped at 1/1024, stream-ordered steal). This replays the traces gpumem recorded live in run 2
(``live-h200-2026-11-25-run2/{gpt2,resnet50}.gmt.gz``: 80 steps, the first 20 warm-up) on ``sim:h200-141gb``
with ``--gpu-timing trace`` under each, and predicts what the allocator's calls add per steady step:

* **calls**: the simulated cost of every device call the allocator made in the timed steps (everything
  but the program's own kernel launches: VMM calls, ``cudaMalloc``/``cudaFree``, events), over the timed
  steps, less the same under PyTorch's allocator; as a share of the live run's PyTorch step time. This
  counts every call on the CPU's critical path, none hidden behind queued GPU work.
* **sim time**: the replay's own critical path (its simulated time per timed step, less PyTorch's), where
  calls made while the CPU runs ahead of the GPU are hidden; over the same live step time.

Each under the latency model priced as measured (``LatencyModel.as_measured()``: a busy device and many
mappings make VMM calls dearer, Note [A busy device prices VMM calls higher] in :mod:`gpumem.sim.latency`)
and, for comparison, priced idle (``LatencyModel()``, the default). ``--frontier`` replays instead the
grid of :mod:`sim.steal_frontier` (chunk cap x ordered steal x page slack) and marks the settings predicted
to hold at most ``--max-overhead`` above peak live with at most ``--max-step-cost`` of step time on both.

    python -m sim.step_time [--json build/step-time.json]
    python -m sim.step_time --frontier [--json build/step-time-frontier.json]
    python -m sim.step_time --workloads [--json build/step-time-workloads.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gpumem.allocator.policy import POLICIES, AllocatorPolicy
from gpumem.progress import progress
from gpumem.replay import ReplayResult, replay_trace
from gpumem.sim import get_profile
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device
from gpumem.trace import Trace, load_trace
from sim import steal_frontier

PROFILE = "h200-141gb"
RUN2 = Path("reports/hil/live-h200-2026-11-25-run2")
RUN4 = Path("reports/hil/live-h200-2026-11-25-run4")
TRACES = {"gpt2": RUN2 / "gpt2.gmt.gz", "resnet50": RUN2 / "resnet50.gmt.gz"}
WARMUP_STEPS, STEPS = steal_frontier.WARMUP_STEPS, steal_frontier.STEPS
DEFAULT = dataclasses.replace(POLICIES["gpumem"], name="default")
C = dataclasses.replace(POLICIES["gpumem"], name="C", chunk_max_fraction=1 / 1024, stream_ordered_steal=True)
#: the latency models compared: as measured (the default), and every call priced as on an idle device
LATENCIES = {"measured": LatencyModel.as_measured(), "idle-priced": LatencyModel()}


@dataclass(frozen=True)
class Live:
    """One live run: its record, the model, gpumem's setting, and step times (ms) of both allocators."""

    run: str
    model: str
    setting: str
    pytorch_ms: float
    gpumem_ms: float
    steps: int
    """All steps, warm-up included (the train probe's ``--steps``)."""
    driver_calls: int
    event_calls: int

    @property
    def overhead(self) -> float:
        return self.gpumem_ms / self.pytorch_ms - 1.0


def _runs(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["runs"]


def live_runs() -> list[Live]:
    """The live step times: run 4 (``train-s0.json``: PyTorch and the default policy; ``train-c.json``: C) and
    run 2 (``A-*.json``: PyTorch; ``B.json``: the default policy; ``C.json``: C)."""
    out: list[Live] = []
    run4 = _runs(RUN4 / "train-s0.json")
    run4_c = _runs(RUN4 / "train-c.json")
    for model in TRACES:
        ref = next(r for r in run4 if r["model"] == model and r["allocator"] == "default")
        for setting, runs in (("default", run4), ("C", run4_c)):
            r = next(r for r in runs if r["model"] == model and r["allocator"] == "gpumem")
            out.append(Live("run 4", model, setting, ref["mean_step_ms"], r["mean_step_ms"], r["steps"],
                            r["num_device_calls"], r["num_event_calls"]))
    for model in TRACES:
        ref = next(r for r in _runs(RUN2 / f"A-{model}.json") if r["allocator"] == "default")
        for setting, name in (("default", "B"), ("C", "C")):
            r = next(r for r in _runs(RUN2 / f"{name}.json") if r["model"] == model and r["allocator"] == "gpumem")
            out.append(Live("run 2", model, setting, ref["mean_step_ms"], r["mean_step_ms"], r["steps"],
                            r["num_device_calls"], r["num_event_calls"]))
    return out


@dataclass(frozen=True)
class Replayed:
    """What one setting's replay of one trace costs per timed step (the whole trace less its warm-up)."""

    overhead: float
    calls_ms: float
    """Simulated ms of the allocator's device calls per timed step."""
    sim_ms: float
    """Simulated ms per timed step (the replay's critical path)."""
    driver_calls: float
    event_calls: float
    busy_priced_share: float
    """The share of VMM calls made while the simulated GPU had queued work."""


def _replay(trace: Trace, policy: "str | AllocatorPolicy", latency: LatencyModel) -> tuple[ReplayResult, dict]:
    profile = dataclasses.replace(get_profile(PROFILE), latency=latency)
    dev = open_device(f"sim:{PROFILE}", profile=profile)
    try:
        result = replay_trace(trace, dev, policy, progress=False, gpu_timing="trace")
        st = dev.stats
        vmm = sum(n for k, n in st.calls.items() if k.startswith(("mem_", "address_")))
        return result, {"calls_us": sum(c for k, c in st.cost_us.items() if k != "launch"),
                        "busy_priced": st.busy_priced_calls, "vmm": vmm}
    finally:
        dev.close()


def replayed(trace: Trace, policy: "str | AllocatorPolicy", latency: LatencyModel, steps: int = STEPS,
             warmup: int = WARMUP_STEPS) -> Replayed:
    """``policy`` on ``trace`` of ``steps`` steps: the cost of the steps after ``warmup`` (the trace cut in
    proportion to its operations), overhead of the whole trace."""
    warm = trace.head(trace.n_ops * warmup // steps)
    full, f = _replay(trace, policy, latency)
    head, h = _replay(warm, policy, latency)
    timed = steps - warmup
    vmm = f["vmm"] - h["vmm"]
    return Replayed(full.overhead, (f["calls_us"] - h["calls_us"]) / timed / 1e3,
                    (full.sim_time_s - head.sim_time_s) / timed * 1e3,
                    (full.stats.device_calls - head.stats.device_calls) / timed,
                    (full.stats.event_calls - head.stats.event_calls) / timed,
                    (f["busy_priced"] - h["busy_priced"]) / vmm if vmm else 0.0)


def predictions(latencies: dict[str, LatencyModel]) -> dict[tuple[str, str, str], Replayed]:
    """``(model, setting, latency) -> Replayed`` for PyTorch's allocator, the default policy and C."""
    out: dict[tuple[str, str, str], Replayed] = {}
    jobs = [(m, s, lat) for m in TRACES for s in ("pytorch", "default", "C") for lat in latencies]
    pols = {"pytorch": "pytorch", "default": DEFAULT, "C": C}
    traces: dict[str, Trace] = {}
    with progress(len(jobs), "settings", "setting") as bar:
        for model, setting, lat in jobs:
            trace = traces.setdefault(model, load_trace(TRACES[model]))
            out[(model, setting, lat)] = replayed(trace, pols[setting], latencies[lat])
            bar.update(1)
    return out


def table(lives: list[Live], preds: dict[tuple[str, str, str], Replayed]) -> tuple[str, list[dict]]:
    lines = ["| live run | model | setting | live step ms (PyTorch / gpumem) | live step cost | live driver + event "
             "calls / step, warm-up included | replayed driver + event calls / timed step | "
             "predicted, calls (measured prices) | "
             "predicted, calls (idle prices) | predicted, sim time (measured / idle prices) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for lv in lives:
        cells = {}
        for lat in LATENCIES:
            p, ref = preds[(lv.model, lv.setting, lat)], preds[(lv.model, "pytorch", lat)]
            cells[lat] = ((p.calls_ms - ref.calls_ms) / lv.pytorch_ms, (p.sim_ms - ref.sim_ms) / lv.pytorch_ms)
        p = preds[(lv.model, lv.setting, "measured")]
        rows.append({"run": lv.run, "model": lv.model, "setting": lv.setting, "live": lv.overhead,
                     "live_pytorch_ms": lv.pytorch_ms, "live_gpumem_ms": lv.gpumem_ms,
                     "live_calls_per_step": (lv.driver_calls + lv.event_calls) / lv.steps,
                     "replayed_calls_per_step": p.driver_calls + p.event_calls,
                     **{f"calls_{k}": v[0] for k, v in cells.items()}, **{f"sim_{k}": v[1] for k, v in cells.items()}})
        lines.append(f"| {lv.run} | {lv.model} | {lv.setting} | {lv.pytorch_ms:.2f} / {lv.gpumem_ms:.2f} | "
                     f"{lv.overhead:+.2%} | {(lv.driver_calls + lv.event_calls) / lv.steps:.0f} | "
                     f"{p.driver_calls:.1f} + {p.event_calls:.1f} | {cells['measured'][0]:+.2%} | "
                     f"{cells['idle-priced'][0]:+.2%} | {cells['measured'][1]:+.2%} / {cells['idle-priced'][1]:+.2%} |")
    return "\n".join(lines), rows


def frontier(max_overhead: float, max_cost: float) -> tuple[str, list[dict]]:
    """Every setting of the steal-frontier grid on both traces, priced as measured."""
    grid = steal_frontier.settings()
    lat = LATENCIES["measured"]
    step_ms = {lv.model: lv.pytorch_ms for lv in live_runs() if lv.run == "run 4"}
    rows: list[dict] = []
    with progress(len(TRACES) * (len(grid) + 1), "settings", "setting") as bar:
        for model, path in TRACES.items():
            trace = load_trace(path)
            ref = replayed(trace, "pytorch", lat)
            bar.update(1)
            for pol in grid:
                p = replayed(trace, pol, lat)
                rows.append({"model": model, "setting": pol.name, "overhead": p.overhead,
                             "calls_per_step": p.driver_calls, "event_calls_per_step": p.event_calls,
                             "added_ms": p.calls_ms - ref.calls_ms,
                             "cost": (p.calls_ms - ref.calls_ms) / step_ms[model],
                             "sim_cost": (p.sim_ms - ref.sim_ms) / step_ms[model],
                             "busy_priced_share": p.busy_priced_share})
                bar.update(1)
    by = {(r["model"], r["setting"]): r for r in rows}
    lines = ["| setting (cap / ordered steal / page slack) | GPT-2 overhead | GPT-2 calls / step (driver + event) | "
             "GPT-2 step cost, calls | ResNet-50 overhead | ResNet-50 calls / step | ResNet-50 step cost, calls | "
             "both targets |", "|---|---|---|---|---|---|---|---|"]
    for pol in grid:
        g, r = by[("gpt2", pol.name)], by[("resnet50", pol.name)]
        ok = all(x["overhead"] <= max_overhead and x["cost"] <= max_cost for x in (g, r))
        lines.append(f"| {pol.name} | {g['overhead']:.2%} | "
                     f"{g['calls_per_step']:.0f} + {g['event_calls_per_step']:.0f} | {g['cost']:+.2%} | "
                     f"{r['overhead']:.2%} | {r['calls_per_step']:.0f} + {r['event_calls_per_step']:.0f} | "
                     f"{r['cost']:+.2%} | {'yes' if ok else 'no'} |")
    return "\n".join(lines), rows


RUN1 = Path("reports/hil/live-h200-2026-11-25")


def workloads() -> tuple[str, list[dict]]:
    """Run 2's seven workloads under C (``live-h200-2026-11-25-run2/workloads/``: 10 steps, 3 warm-up), their
    PyTorch step time from run 1 (``live-h200-2026-11-25/workloads.json``, same probe and machine type):
    further rows no constant was chosen on."""
    defaults = {r["workload"]: r["mean_step_ms"] for r in _runs(RUN1 / "workloads.json") if r["allocator"] == "default"}
    runs = _runs(RUN2 / "workloads" / "workloads.json")
    lines = ["| workload | live step ms (PyTorch, run 1 / C, run 2) | live step cost | replayed driver + event calls / "
             "timed step | predicted: calls, as measured | predicted: calls, idle prices | replayed overhead |",
             "|---|---|---|---|---|---|---|"]
    rows: list[dict] = []
    with progress(len(runs), "workloads", "workload") as bar:
        for r in runs:
            trace = load_trace(RUN2 / "workloads" / r["trace_file"])
            pytorch_ms, c_ms = defaults[r["workload"]], r["mean_step_ms"]
            cost = {}
            for lat, model in LATENCIES.items():
                p = replayed(trace, C, model, r["steps"], r["warmup"])
                ref = replayed(trace, "pytorch", model, r["steps"], r["warmup"])
                cost[lat] = (p.calls_ms - ref.calls_ms) / pytorch_ms
                if lat == "measured":
                    measured = p
            rows.append({"workload": r["workload"], "live_pytorch_ms": pytorch_ms, "live_c_ms": c_ms,
                         "live": c_ms / pytorch_ms - 1, "calls_measured": cost["measured"],
                         "calls_idle-priced": cost["idle-priced"], "overhead": measured.overhead,
                         "calls_per_step": measured.driver_calls, "event_calls_per_step": measured.event_calls})
            lines.append(f"| {r['workload']} | {pytorch_ms:.2f} / {c_ms:.2f} | {c_ms / pytorch_ms - 1:+.1%} | "
                         f"{measured.driver_calls:.0f} + {measured.event_calls:.0f} | {cost['measured']:+.1%} | "
                         f"{cost['idle-priced']:+.1%} | {measured.overhead:.2%} |")
            bar.update(1)
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.step_time", description=__doc__.splitlines()[0])
    p.add_argument("--frontier", action="store_true", help="the steal-frontier grid instead of default and C")
    p.add_argument("--workloads", action="store_true", help="run 2's seven workloads under C instead")
    p.add_argument("--max-overhead", type=float, default=0.01,
                   help="frontier: most memory above peak live (0.01: 1 %%)")
    p.add_argument("--max-step-cost", type=float, default=0.01, help="frontier: most step time added (0.01: 1 %%)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    if not 0 <= args.max_overhead < 1 or not 0 <= args.max_step_cost < 1:
        p.error("--max-overhead and --max-step-cost are fractions in [0, 1)")
    if args.frontier:
        text, rows = frontier(args.max_overhead, args.max_step_cost)
    elif args.workloads:
        text, rows = workloads()
    else:
        text, rows = table(live_runs(), predictions(LATENCIES))
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
