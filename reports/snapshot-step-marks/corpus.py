"""The corpus under the default policy on ``sim:h200-141gb``, with the step marks read off each snapshot's
optimizer steps and without them (Note [Step marks read off a snapshot's optimizer steps]), the GPU idle and
behind (each trace's default timing), tuning and check parts apart::

    PYTHONPATH=. python reports/snapshot-step-marks/corpus.py            # a markdown table on stdout
"""

from __future__ import annotations

from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.corpus import CorpusPart, corpus_part, corpus_traces
from gpumem.trace.model import PlanEventKind


def main() -> None:
    print("| trace | part | marks | idle, no marks | idle, marks | behind, no marks | behind, marks (default) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for part in (CorpusPart.TUNING, CorpusPart.CHECK):
        for path in corpus_traces(part):
            marked = load_trace(path, progress=False)
            bare = load_trace(path, progress=False, step_marks=False)
            n = sum(1 for e in marked.plan_events if e.kind is PlanEventKind.MARK)
            cells = [replay_trace(t, progress=False, gpu_timing=timing).overhead
                     for timing in ("idle", None) for t in (bare, marked)]
            name = path.name.split(".")[0] + (" (RMM log)" if "rmm" in path.name else "")
            print(f"| {name} | {corpus_part(path).value} | {n} | " + " | ".join(f"{c:.2%}" for c in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
