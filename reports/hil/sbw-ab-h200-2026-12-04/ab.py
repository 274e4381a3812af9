"""The ABBA comparison of run.sh: generate() under gpumem with the stream-ordered steal before a warm-up off
(GPUMEM_STEAL_BEFORE_WARMUP=0) and on (=1), runs alternating. Per run: memory above peak allocated, the mean host
step (wall) and the mean process CPU step over the timed steps, steals and driver milliseconds a step; then the
settings' means, each round's on/off ratio (its two on runs against its two off runs), and the sums of step minima
as the record before computed them.

    python reports/hil/sbw-ab-h200-2026-12-04/ab.py [RUN_FOLDER]     (default: run/ beside this file)"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNTIMED = 12


def runs_of(folder: Path) -> list[dict]:
    """Every llama_generate run, in the order run.sh made them (its tags sort so), with its tag and setting."""
    out = []
    for path in sorted(folder.glob("r*/workloads-*.json")):
        for run in json.loads(path.read_text())["runs"]:
            if run["workload"] != "llama_generate" or "error" in run:
                continue
            env = run.get("gpumem_env") or {}
            run["tag"] = path.parent.name
            run["setting"] = "on" if env.get("GPUMEM_STEAL_BEFORE_WARMUP") == "1" else "off"
            out.append(run)
    return out


def main(argv: list[str]) -> None:
    folder = Path(argv[0]) if argv else HERE / "run"
    runs = runs_of(folder)
    if not runs:
        raise SystemExit(f"no llama_generate run under {folder}")
    print("| run | setting | overhead | wall ms / step | CPU ms / step | steals / step | driver ms / step |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        wall = statistics.mean(r["host_step_ms"][UNTIMED:])
        cpu = statistics.mean(r["host_cpu_step_ms"][UNTIMED:]) if r.get("host_cpu_step_ms") else float("nan")
        td = r.get("timed_driver") or {}
        drv = td.get("memory_ms", 0) + td.get("event_ms", 0) + td.get("wait_ms", 0)
        ov = (r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1) * 100
        r["wall"], r["cpu"] = wall, cpu
        print(f"| {r['tag']} | {r['setting']} | {ov:.2f} % | {wall:.1f} | {cpu:.1f} | {td.get('steals', 0):.2f} | {drv:.2f} |")
    for key in ("wall", "cpu"):
        means = {s: statistics.mean(r[key] for r in runs if r["setting"] == s) for s in ("off", "on")}
        print(f"{key}: off {means['off']:.1f} ms, on {means['on']:.1f} ms, on/off {means['on'] / means['off'] - 1:+.1%}")
        rounds: dict[str, dict[str, list[float]]] = {}
        for r in runs:
            rounds.setdefault(r["tag"][:2], {"on": [], "off": []})[r["setting"]].append(r[key])
        ratios = [statistics.mean(v["on"]) / statistics.mean(v["off"]) - 1 for v in rounds.values() if v["on"] and v["off"]]
        print(f"  per round on/off: {', '.join(f'{x:+.1%}' for x in ratios)}")
    steps = {s: [r["host_step_ms"][UNTIMED:] for r in runs if r["setting"] == s] for s in ("off", "on")}
    n = min(len(x) for group in steps.values() for x in group)
    minima = {s: sum(min(x[i] for x in group) for i in range(n)) for s, group in steps.items()}
    print(f"sums of step minima: off {minima['off']:.1f} ms, on {minima['on']:.1f} ms, "
          f"on/off {minima['on'] / minima['off'] - 1:+.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
