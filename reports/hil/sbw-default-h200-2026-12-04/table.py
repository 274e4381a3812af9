"""The table of run.sh: per run, the setting, memory above peak allocated, the mean wall step over the timed
steps and the hooks' time in the engine's slow path a step (driver calls included) with its steals.

    python reports/hil/sbw-default-h200-2026-12-04/table.py [RUN_FOLDER]     (default: run/ beside this file)"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> None:
    folder = Path(argv[0]) if argv else HERE / "run"
    print("| run | workload | steal_before_warmup | overhead | wall ms / step | slow path ms / step | steals / step "
          "| driver ms / step |")
    print("|---|---|---|---|---|---|---|---|")
    for path in sorted(folder.glob("*/workloads-*.json")):
        data = json.loads(path.read_text())
        for r in data["runs"]:
            if "error" in r:
                print(f"| {path.parent.name} | {r['workload']} | - | failed | - | - | - | - |")
                continue
            env = r.get("gpumem_env") or {}
            knob = {"0": "off", "1": "on"}.get(env.get("GPUMEM_STEAL_BEFORE_WARMUP"), "default (on)")
            wall = statistics.mean(r["host_step_ms"][r["warmup"]:])
            td = r.get("timed_driver") or {}
            drv = td.get("memory_ms", 0) + td.get("event_ms", 0) + td.get("wait_ms", 0)
            ov = (r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1) * 100
            print(f"| {path.parent.name} | {r['workload']} | {knob} | {ov:.2f} % | {wall:.1f} | "
                  f"{td.get('slow_ms', float('nan')):.3f} | {td.get('steals', 0):.2f} | {drv:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
