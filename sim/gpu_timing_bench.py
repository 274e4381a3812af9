"""Peak reserved over peak live under each GPU timing and engine policy (issue 18, points 1 and 3).

Replays every trace on a simulated device under ``--gpu-timing`` idle / trace / model and the default
``gpumem`` policy with several ``busy_slack`` values (Note [Wait, do not grow, behind the GPU] in
``gpumem/allocator/backing.py``), and prints one Markdown table per part: *tuning* (the traces policy
decisions may look at) and *check* (held out: ``--check`` traces; no decision looks at them).

    python -m sim.gpu_timing_bench                       # data/traces/*.gz, all tuning
    python -m sim.gpu_timing_bench --check held_out/*.gz --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import sys
from pathlib import Path

from gpumem.allocator.policy import POLICIES
from gpumem.progress import progress
from gpumem.replay import replay_trace
from gpumem.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("idle", "trace", "model")
BUSY_SLACKS = (math.inf, 0.05, 0.02, 0.0)


def _label(busy: float) -> str:
    default = " (default)" if busy == POLICIES["gpumem"].busy_slack else ""
    value = "inf" if math.isinf(busy) else f"{busy:g}"
    return f"busy_slack={value}{default}"


def measure(paths: list[str], device: str, timings: tuple[str, ...], slacks: tuple[float, ...]) -> list[dict]:
    rows = []
    with progress(len(paths) * len(timings) * len(slacks), "replays", "replay") as bar:
        for path in paths:
            trace = load_trace(path)
            for timing in timings:
                for busy in slacks:
                    policy = dataclasses.replace(POLICIES["gpumem"], busy_slack=busy)
                    r = replay_trace(trace, device, policy, progress=False, gpu_timing=timing)
                    rows.append({"trace": Path(path).name, "gpu_timing": timing, "busy_slack": busy,
                                 "overhead": r.overhead, "peak_reserved_bytes": r.peak_reserved_bytes,
                                 "device_calls": r.stats.device_calls, "event_calls": r.stats.event_calls,
                                 "sim_time_s": r.sim_time_s})
                    bar.update(1)
    return rows


def table(rows: list[dict], part: str, timings: tuple[str, ...], slacks: tuple[float, ...]) -> str:
    head = "| trace | gpu timing | " + " | ".join(_label(b) for b in slacks) + " |"
    lines = [f"### {part}", "", head, "|---|---|" + "---|" * len(slacks)]
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    for t in traces:
        for timing in timings:
            cells = []
            for b in slacks:
                r = next(x for x in rows if x["trace"] == t and x["gpu_timing"] == timing and x["busy_slack"] == b)
                cells.append(f"{r['overhead']:.2%} ({r['device_calls']:,} calls, {r['sim_time_s']:.3f} s)")
            lines.append(f"| {t} | {timing} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.gpu_timing_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tuning", nargs="*", default=None, help="tuning traces (default: data/traces/*.gz)")
    p.add_argument("--check", nargs="*", default=[], help="held-out traces (no decision looks at them)")
    p.add_argument("--device", default="sim:h200-141gb")
    p.add_argument("--timings", nargs="+", default=list(TIMINGS), choices=TIMINGS)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    tuning = args.tuning if args.tuning is not None else sorted(glob.glob(str(ROOT / "data" / "traces" / "*.gz")))
    timings = tuple(args.timings)
    out = {}
    for part, paths in (("tuning", tuning), ("check", args.check)):
        if not paths:
            print(f"### {part}\n\n(no traces)\n")
            continue
        rows = measure(paths, args.device, timings, BUSY_SLACKS)
        out[part] = rows
        print(table(rows, part, timings, BUSY_SLACKS) + "\n")
    print("cells: peak reserved / peak live - 1 (allocator device calls, simulated seconds); "
          f"policy: gpumem with the busy_slack shown; device {args.device}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
