"""Live against predicted under each GPU timing (issue 18): which timing predicts gpumem.torch on the GPU.

Reads a folder written by h18's live probe (``workloads.json``: per workload and allocator the live peak
allocated / reserved bytes and the trace file the run recorded; gpumem's runs record gpumem's own trace,
``*.gpumem.gmt.gz``), replays each gpumem trace on ``--device`` under ``--gpu-timing`` idle / trace / model
with the policy the live run used (``busy_slack=inf`` by default: the rule before issue 18) and the
candidates ``--busy-slack``, and prints one Markdown table per part (tuning / check, ``--check``).

    python -m sim.gpu_timing_live FOLDER --check llama_varlen_train vit_train llama_generate \\
        unet_train multistream_infer --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from gpumem.allocator.policy import POLICIES
from gpumem.progress import progress
from gpumem.replay import replay_trace
from gpumem.trace import load_trace

TIMINGS = ("idle", "trace", "model")


def measure(folder: Path, device: str, live_busy: float, candidates: list[float]) -> list[dict]:
    runs = [r for r in json.loads((folder / "workloads.json").read_text())["runs"]
            if r["allocator"] == "gpumem" and "peak_reserved_bytes" in r]
    rows = []
    with progress(len(runs), "workloads", "trace") as bar:
        for r in runs:
            trace = load_trace(folder / r["trace_file"])
            row = {"workload": r["workload"], "live": r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1,
                   "live_steals": r.get("n_steals"), "live_step_ms": r.get("mean_step_ms")}
            for timing in TIMINGS:
                policy = dataclasses.replace(POLICIES["gpumem"], busy_slack=live_busy)
                row[timing] = replay_trace(trace, device, policy, progress=False, gpu_timing=timing).overhead
            for busy in candidates:
                policy = dataclasses.replace(POLICIES["gpumem"], busy_slack=busy)
                row[f"busy_slack={busy:g}"] = replay_trace(trace, device, policy, progress=False).overhead
            rows.append(row)
            bar.update(1)
    return rows


def table(rows: list[dict], part: str, candidates: list[float]) -> str:
    cands = [f"busy_slack={b:g}" for b in candidates]
    lines = [f"### {part}", "",
             "| workload | live | idle | trace | model | " + " | ".join(f"{c}, trace" for c in cands) + " |",
             "|---|---|---|---|---|" + "---|" * len(cands)]
    for r in rows:
        cells = [f"{r['live']:.2%}"] + [f"{r[t]:.2%} ({(r[t] - r['live']) * 100:+.2f} pp)" for t in TIMINGS]
        cells += [f"{r[c]:.2%}" for c in cands]
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.gpu_timing_live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--check", nargs="*", default=[], help="workloads of the check part (no decision looks at them)")
    p.add_argument("--device", default="sim:h200-141gb")
    p.add_argument("--live-busy-slack", type=float, default=math.inf, help="the busy_slack the live runs used")
    p.add_argument("--busy-slack", type=float, nargs="*", default=[0.05, 0.0], help="candidates, replayed under trace")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = measure(args.folder, args.device, args.live_busy_slack, args.busy_slack)
    for part in ("tuning", "check"):
        sel = [r for r in rows if (r["workload"] in args.check) == (part == "check")]
        print(table(sel, part, args.busy_slack) if sel else f"### {part}\n\n(no workloads)", end="\n\n")
    print(f"live and predicted: peak reserved / peak allocated - 1 (replays: peak live); device {args.device}; "
          f"idle/trace/model under busy_slack={args.live_busy_slack:g}, the live runs' rule")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
