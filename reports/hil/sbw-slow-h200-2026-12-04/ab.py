"""The table of run.sh: generate() under PyTorch's allocator and under gpumem with steal_before_warmup off and on.
Per run: memory above peak allocated, the mean wall step over the timed steps, and for gpumem the hooks' time in
the engine's slow path a step (driver calls included) with its calls and steals; then, by setting, the means, and
the slow path's difference against the mean step: the host time the knob adds, measured rather than read off
step times that move by more on a shared host.

    python reports/hil/sbw-slow-h200-2026-12-04/ab.py [RUN_FOLDER]     (default: run/ beside this file)"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNTIMED = 12
SETTINGS = ("pt", "off", "on")


def runs_of(folder: Path) -> list[dict]:
    """Every llama_generate run in run.sh's order (its tags sort so), with its tag and setting."""
    out = []
    for path in sorted(folder.glob("r*/workloads-*.json")):
        for run in json.loads(path.read_text())["runs"]:
            if run["workload"] != "llama_generate" or "error" in run:
                continue
            run["tag"] = path.parent.name
            run["setting"] = run["tag"].split("-")[-1]
            out.append(run)
    return out


def main(argv: list[str]) -> None:
    folder = Path(argv[0]) if argv else HERE / "run"
    runs = runs_of(folder)
    if not runs:
        raise SystemExit(f"no llama_generate run under {folder}")
    print("| run | allocator, knob | overhead | wall ms / step | slow path ms / step | slow calls / step "
          "| steals / step | driver ms / step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        r["wall"] = statistics.mean(r["host_step_ms"][UNTIMED:])
        td = r.get("timed_driver") or {}
        r["slow"] = td.get("slow_ms")
        ov = (r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1) * 100
        who = "PyTorch" if r["setting"] == "pt" else f"gpumem, {r['setting']}"
        if td:
            drv = td["memory_ms"] + td["event_ms"] + td["wait_ms"]
            rest = f"{td['slow_ms']:.3f} | {td['slow_calls']:.1f} | {td['steals']:.2f} | {drv:.3f}"
        else:
            rest = "- | - | - | -"
        print(f"| {r['tag']} | {who} | {ov:.2f} % | {r['wall']:.1f} | {rest} |")
    wall = {s: statistics.mean(r["wall"] for r in runs if r["setting"] == s) for s in SETTINGS
            if any(r["setting"] == s for r in runs)}
    print("mean wall ms / step: " + ", ".join(f"{s} {v:.1f}" for s, v in wall.items()))
    slow = {s: [r["slow"] for r in runs if r["setting"] == s and r["slow"] is not None] for s in ("off", "on")}
    if slow["off"] and slow["on"]:
        d = statistics.mean(slow["on"]) - statistics.mean(slow["off"])
        print(f"slow path ms / step: off {', '.join(f'{x:.3f}' for x in slow['off'])}; "
              f"on {', '.join(f'{x:.3f}' for x in slow['on'])}")
        print(f"on - off: {d:+.3f} ms a step, {d / wall['off']:+.3%} of off's mean step")


if __name__ == "__main__":
    main(sys.argv[1:])
