"""Live gpumem.torch (nothing set: automatic step marks) against the replay of PyTorch's snapshot of the same
program, with the step marks read off its optimizer steps and without (Note [Step marks read off a snapshot's
optimizer steps]), on every H200 record that ran both allocators with gpumem.torch's default marks::

    PYTHONPATH=. python reports/snapshot-step-marks/live.py            # a markdown table on stdout

Each snapshot is read with its record_stream log where the run wrote one (``load_trace_with_stream_uses``), and
replayed on ``sim:h200-141gb`` under the default policy and the default GPU timing of a snapshot (``trace``).
"""

from __future__ import annotations

import json
from pathlib import Path

from gpumem.replay import replay_trace
from gpumem.trace.model import PlanEventKind
from gpumem.trace.stream_log import load_trace_with_stream_uses
from gpumem.trace import load_trace
from hil.probes.workloads import corpus_part_of

HIL = Path(__file__).resolve().parents[1] / "hil"
RECORDS = (HIL / "live-vs-predicted-h200-2026-11-29-default-marks" / "workloads-predict-default.json",
           HIL / "workloads-today-h200-2026-11-30" / "run-a" / "workloads-train.json",
           HIL / "workloads-today-h200-2026-11-30" / "run-a" / "workloads-infer.json",
           # recorded after the rule was written, on loops it was not looked at for (check rows)
           HIL / "snapshot-marks-h200-2026-12-01" / "check" / "workloads-check.json")


def _load(folder: Path, snapshot: str, marks: bool):
    log = folder / snapshot.replace(".snapshot.pickle.gz", ".record_stream.jsonl.gz")
    if log.is_file():
        return load_trace_with_stream_uses(folder / snapshot, log, step_marks=marks, progress=False)[0]
    return load_trace(folder / snapshot, progress=False, step_marks=marks)


def main() -> None:
    print("| record | workload | part | marks read | live gpumem.torch | predicted, marks | predicted, no marks |")
    print("|---|---|---|---:|---:|---:|---:|")
    for record in RECORDS:
        data = json.loads(record.read_text())
        runs = {(r["workload"], r["allocator"]): r for r in data["runs"]}
        for (workload, allocator), run in runs.items():
            pytorch = runs.get((workload, "default"))
            if allocator != "gpumem" or not run.get("peak_reserved_bytes") or not pytorch:
                continue
            live = run["peak_reserved_bytes"] / run["peak_allocated_bytes"] - 1
            marked = _load(record.parent, pytorch["trace_file"], True)
            n = sum(1 for e in marked.plan_events if e.kind is PlanEventKind.MARK)
            got = replay_trace(marked, progress=False).overhead
            bare = replay_trace(_load(record.parent, pytorch["trace_file"], False), progress=False).overhead
            print(f"| {record.parent.name} | {workload} | {corpus_part_of(workload)} | {n} | {live:.2%} | "
                  f"{got:.2%} ({(got - live) * 100:+.2f}) | {bare:.2%} ({(bare - live) * 100:+.2f}) |", flush=True)


if __name__ == "__main__":
    main()
