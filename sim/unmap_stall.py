"""Does a VMM call wait for the GPU? Replays gpumem's live-recorded traces with the option off and on.

Issue 18: live on the H200, settings that steal more cost far more step time than a replay predicts
(Note [Does a VMM call wait for the GPU?] in :mod:`gpumem.sim.device`). This replays each trace a live
run recorded (``gpumem.torch`` with ``GPUMEM_TRACE_OUT``), with ``--gpu-timing trace``, under PyTorch's
default allocator (``pytorch``) and under the gpumem setting the live run used, once per value of
:attr:`~gpumem.sim.latency.LatencyModel.waits_for_device`, and prints, per row, the live step-time ratio
against the default allocator and the predicted one: the replay's simulated time (``sim_time_s``) under
the gpumem setting over that under ``pytorch``. Also the step time added per step, live and predicted
(simulated time over the steps the trace holds, warm-up included), and the memory overhead.

    python -m sim.unmap_stall [--json out.json]

Settings (reports/hil/live-vs-predicted-h200-2026-11-25-run2.md): A stream-ordered steal, chunks capped
at 1/256; B the steal off (the default policy); C the steal on, chunks capped at 1/1024.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
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

RUN2 = Path("reports/hil/live-h200-2026-11-25-run2")
RUN1 = Path("reports/hil/live-h200-2026-11-25")
PROFILE = "h200-141gb"
STEALS = re.compile(r"steals ([\d,]+)")

SETTINGS: dict[str, AllocatorPolicy] = {
    "A": dataclasses.replace(POLICIES["gpumem"], chunk_max_fraction=1 / 256, stream_ordered_steal=True),
    "B": dataclasses.replace(POLICIES["gpumem"], chunk_max_fraction=1 / 256, stream_ordered_steal=False),
    "C": dataclasses.replace(POLICIES["gpumem"], chunk_max_fraction=1 / 1024, stream_ordered_steal=True),
}
#: The values of ``waits_for_device`` compared: none (the default), the unmap, every VMM call of a steal.
WAITS: dict[str, tuple[str, ...]] = {"off": (), "unmap": ("mem_unmap",),
                                     "vmm": ("mem_unmap", "mem_map", "mem_set_access")}


@dataclass(frozen=True)
class Row:
    """One live run to predict: its trace, the gpumem setting, live step times (ms) and steals."""

    name: str
    trace: Path
    setting: str
    steps: int
    live_default_ms: float
    live_gpumem_ms: float
    live_steals: int


def live_rows() -> list[Row]:
    """The rows of the run-2 record: GPT-2 and ResNet-50 under A/B/C (run A's traces), seven workloads under C."""
    rows: list[Row] = []
    train = {"gpt2": json.loads((RUN2 / "A-gpt2.json").read_text()),
             "resnet50": json.loads((RUN2 / "A-resnet50.json").read_text())}
    others = {s: json.loads((RUN2 / f"{s}.json").read_text()) for s in ("B", "C")}
    for model, rec in train.items():
        steps = rec["steps"]  # the train probe's --steps counts the warm-up
        default = next(r for r in rec["runs"] if r["allocator"] == "default")
        for setting in ("A", "B", "C"):
            src = rec if setting == "A" else others[setting]
            run = next(r for r in src["runs"] if r["allocator"] == "gpumem" and r.get("model", model) == model)
            rows.append(Row(f"{model} {setting}", RUN2 / f"{model}.gmt.gz", setting, steps, default["mean_step_ms"],
                            run["mean_step_ms"], int(STEALS.search(run["summary"]).group(1).replace(",", ""))))
    defaults = {r["workload"]: r["mean_step_ms"] for r in json.loads((RUN1 / "workloads.json").read_text())["runs"]
                if r["allocator"] == "default"}
    for r in json.loads((RUN2 / "workloads" / "workloads.json").read_text())["runs"]:
        rows.append(Row(f"{r['workload']} C", RUN2 / "workloads" / r["trace_file"], "C", r["steps"],
                        defaults[r["workload"]], r["mean_step_ms"], r["n_steals"]))
    return rows


def replay(trace: Trace, policy: "str | AllocatorPolicy", waits: tuple[str, ...]) -> tuple[ReplayResult, int]:
    """A trace-timed replay on the H200 profile whose latency model waits for the device in ``waits``."""
    profile = dataclasses.replace(get_profile(PROFILE), latency=LatencyModel(waits_for_device=waits))
    dev = open_device(f"sim:{PROFILE}", profile=profile)
    try:
        result = replay_trace(trace, dev, policy, progress=False, gpu_timing="trace")
        return result, dev.stats.device_waits
    finally:
        dev.close()


def measure(rows: list[Row]) -> list[dict]:
    out: list[dict] = []
    base: dict[tuple[Path, str], ReplayResult] = {}
    traces: dict[Path, Trace] = {}
    with progress(len(rows), "rows", "row") as bar:
        for row in rows:
            trace = traces.setdefault(row.trace, load_trace(row.trace))
            rec: dict = {"row": row.name, "steps": row.steps, "live_steals": row.live_steals,
                         "live_ratio": row.live_gpumem_ms / row.live_default_ms,
                         "live_added_ms": row.live_gpumem_ms - row.live_default_ms}
            for label, waits in WAITS.items():
                ref = base.get((row.trace, label))
                if ref is None:
                    ref = base[(row.trace, label)] = replay(trace, "pytorch", waits)[0]
                res, n_waits = replay(trace, SETTINGS[row.setting], waits)
                rec[label] = {"ratio": res.sim_time_s / ref.sim_time_s,
                              "added_ms": (res.sim_time_s - ref.sim_time_s) * 1e3 / row.steps,
                              "overhead": res.overhead, "pytorch_overhead": ref.overhead,
                              "sim_time_s": res.sim_time_s, "pytorch_sim_time_s": ref.sim_time_s,
                              "device_waits": n_waits, "device_calls": res.stats.device_calls}
            out.append(rec)
            bar.update(1)
    return out


def table(recs: list[dict]) -> str:
    lines = ["| row | live steals | live step vs default | predicted, off | predicted, unmap waits | "
             "predicted, all VMM calls wait | live added ms/step | predicted added ms/step (off / unmap / vmm) | "
             "overhead off / unmap / vmm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        ratios = [f"{(r[k]['ratio'] - 1) * 100:+.1f} %" for k in WAITS]
        added = " / ".join(f"{r[k]['added_ms']:.1f}" for k in WAITS)
        over = " / ".join(f"{r[k]['overhead']:.2%}" for k in WAITS)
        lines.append(f"| {r['row']} | {r['live_steals']:,} | {(r['live_ratio'] - 1) * 100:+.1f} % | "
                     + " | ".join(ratios) + f" | {r['live_added_ms']:.1f} | {added} | {over} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.unmap_stall", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the measurements here")
    p.add_argument("--only", nargs="*", help="rows whose name starts with one of these")
    args = p.parse_args(argv)
    rows = live_rows()
    if args.only:
        rows = [r for r in rows if any(r.name.startswith(o) for o in args.only)]
    recs = measure(rows)
    if args.json:
        args.json.write_text(json.dumps(recs, indent=1))
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
