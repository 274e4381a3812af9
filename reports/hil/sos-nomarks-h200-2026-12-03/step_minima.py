"""Each step's minimum over the runs of one setting, from the workloads records, for generate() (llama_generate):
the stream-ordered steal on against off, and against PyTorch's allocator. Host noise on the H200 machine adds
delay to a step (PyTorch's own median step moved 327-556 ms between runs), so a step's minimum over several runs
is the least disturbed estimate of it; the sums and the median per-step ratio are printed.

    python reports/hil/sos-nomarks-h200-2026-12-03/step_minima.py [--workload NAME] [RECORD_FOLDER ...]

Default folders: this record's runs (run/, confirm/, confirm2/) and the second session's
(reports/hil/sos-default-h200-2026-12-03/run/{a,b,c}). The first 12 steps (untimed) are left out."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREVIOUS = HERE.parent / "sos-default-h200-2026-12-03" / "run"
DEFAULT_FOLDERS = ([HERE / "run", HERE / "confirm", HERE / "confirm2"], [PREVIOUS / "a", PREVIOUS / "b", PREVIOUS / "c"])
UNTIMED = 12


def setting(run: dict) -> str:
    """``pytorch``, ``off`` (the rule before) or ``steal`` (the stream-ordered steal on)."""
    env = run.get("gpumem_env") or {}
    if run["allocator"] == "default":
        return "pytorch"
    if env.get("GPUMEM_STEAL_BEFORE_WARMUP") == "0" or env.get("GPUMEM_STREAM_ORDERED_STEAL") == "0":
        return "off"
    return "steal"   # GPUMEM_STREAM_ORDERED_STEAL=1, or nothing set while steal_before_warmup was the default


def table(folders: list[Path], workload: str = "llama_generate") -> None:
    runs: dict[str, list[list[float]]] = {"steal": [], "off": [], "pytorch": []}
    for folder in folders:
        for path in sorted(folder.glob("*/workloads-*.json")):
            for run in json.loads(path.read_text())["runs"]:
                if run["workload"] == workload and run["steps"] == 40:
                    runs[setting(run)].append(run["host_step_ms"][UNTIMED:])
    if not all(runs.values()):
        raise SystemExit(f"{workload}: no run of every setting in {', '.join(str(f) for f in folders)}")
    n = min(len(steps) for group in runs.values() for steps in group)
    minima = {k: [min(steps[i] for steps in group) for i in range(n)] for k, group in runs.items()}
    print(f"{', '.join(f'{f.parent.name}/{f.name}' for f in folders)}: runs {', '.join(f'{k} {len(v)}' for k, v in runs.items())}")
    for k, m in minima.items():
        print(f"  {k:8s} sum of step minima {sum(m):9.1f} ms")
    for a, b in (("steal", "off"), ("off", "pytorch"), ("steal", "pytorch")):
        ratios = [x / y for x, y in zip(minima[a], minima[b])]
        print(f"  {a}/{b}: sum {sum(minima[a]) / sum(minima[b]) - 1:+.1%}, median step {statistics.median(ratios) - 1:+.1%}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="llama_generate", help="the workload (default: %(default)s)")
    parser.add_argument("folders", nargs="*", type=Path, help="record folders, one group (default: both records)")
    args = parser.parse_args(argv)
    for group in [args.folders] if args.folders else DEFAULT_FOLDERS:
        table(group, args.workload)


if __name__ == "__main__":
    main(sys.argv[1:])
