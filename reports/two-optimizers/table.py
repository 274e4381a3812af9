"""The table of reports/two-optimizers.md: each H200 program with two optimizers of one class, its PyTorch snapshot
replayed (sim:h200-141gb, default policy and timing) against gpumem.torch's live figure and own trace. The replays
run today's engine; each live figure is its run's (the WGAN's first two before Note [A plan that leaves early])::

    PYTHONPATH=. python reports/two-optimizers/table.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.model import PlanEventKind
from gpumem.trace.optimizer_marks import infer_step_marks

HIL = Path(__file__).resolve().parents[1] / "hil"
ROWS = (("built on", HIL / "snapshot-marks-h200-2026-12-01" / "check", "gan_train", "check"),
        ("check", HIL / "two-optimizers-h200-2026-12-01" / "check", "gan_gen_first_train", "check"),
        ("check", HIL / "two-optimizers-h200-2026-12-01" / "check", "gan_sgd_train", "check"),
        ("check (rule before)", HIL / "two-optimizers-h200-2026-12-01" / "check", "wgan_critic_train", "check"),
        ("check (rule now)", HIL / "two-optimizers-h200-2026-12-01" / "rule", "wgan_critic_train", "rule"),
        ("check (early drop)", HIL / "early-leave-h200-2026-12-01" / "run", "wgan_critic_train", "wgan"))


def _marks(t) -> list[int]:
    return [e.at_op for e in t.plan_events if e.kind is PlanEventKind.MARK]


def _pct(r) -> str:
    return f"{100 * r.overhead:.2f} %"


def main() -> None:
    logging.disable(logging.WARNING)
    check = HIL / "two-optimizers-h200-2026-12-01" / "check"
    print("| part | workload | marks read / made live | live gpumem.torch | predicted | each range a mark (before) "
          "| no marks | gpumem.torch's own trace replayed |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for part, folder, w, tag in ROWS:
        runs = json.loads((folder / f"workloads-{tag}.json").read_text())["runs"]
        live = next(r for r in runs if r["workload"] == w and r["allocator"] == "gpumem")
        live_pct = 100 * (live["peak_reserved_bytes"] / live["peak_allocated_bytes"] - 1)
        snap_path = (folder if folder.name != "rule" else check) / f"{w}.default.snapshot.pickle.gz"
        snap = load_trace(snap_path, progress=False)
        bare = load_trace(snap_path, progress=False, step_marks=False)
        own = load_trace(folder / f"{w}.gpumem.gmt.gz", progress=False)
        # the reader before Note [Two optimizers of one class]: no sizes, so every range of the class marks
        import gzip
        import pickle
        ann = pickle.loads(gzip.decompress(snap_path.read_bytes()))["external_annotations"]
        old = infer_step_marks(ann, 0, bare.times_us, kinds=bare.kinds)
        from dataclasses import replace
        each = replace(bare, plan_events=old.events)
        got = [replay_trace(t, progress=False, gpu_timing="trace") for t in (snap, each, bare, own)]
        read, made = _marks(snap), _marks(own)
        same = "same ops" if read == made else "differ"
        print(f"| {part} | {w} | {len(read)} / {len(made)} ({same}) | {live_pct:.2f} % | {_pct(got[0])} | "
              f"{_pct(got[1])} ({len(_marks(each))}) | {_pct(got[2])} | {_pct(got[3])} |")


if __name__ == "__main__":
    main()
