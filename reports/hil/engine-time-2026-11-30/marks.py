"""Replays a trace through the native engine patched by ``patch_marks.py`` and tables, for the steals whose first
device call is a fence record, the time from the engine's slow path to each mark (section 1 of
``reports/hil/engine-time-2026-11-30.md``). Run it as ``patch_marks.py``'s docstring says."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np


def main() -> None:
    if len(sys.argv) != 2 or not os.environ.get("MK_LOG"):
        sys.exit(__doc__)
    log = os.environ["MK_LOG"]
    code = ("import sys, gpumem.replay_compare as rc; from gpumem.sim import SimDevice, get_profile; "
            "rc.compare_live(sys.argv[1], 'sim:h200-141gb', engine='native')")
    subprocess.run([sys.executable, "-c", code, sys.argv[1]], check=True)   # the log is written at its exit
    ops, cur = [], None
    with open(log) as f:
        for line in f:
            _, name, t, v = line.split()
            if name == "begin":
                cur = {"marks": [], "fresh": None}
                ops.append(cur)
            elif cur is not None and name == "fresh":
                cur["fresh"] = int(v) if cur["fresh"] is None else cur["fresh"]
            elif cur is not None:
                cur["marks"].append((name, int(t) / 1e3))
    steps, fresh, walk = collections.defaultdict(list), [], []
    for o in ops:
        names = [n for n, _ in o["marks"]]
        if "record" not in names or "idle_walked" not in names[:names.index("record")]:
            continue
        marks = o["marks"][:names.index("record") + 1]
        if [n for n, _ in marks].count("steal_chunk") != 1 or [n for n, _ in marks].count("chunk_for") != 1:
            continue   # a chunk created before the steal: its device calls are in the times
        prev = 0.0
        for n, t in marks:
            steps[n].append(t - prev)
            prev = t
        steps["from the slow path to the record"].append(marks[-1][1])
        fresh.append(o["fresh"] or 0)
        at = dict(marks)
        walk.append(at["idle_walked"] - at.get("told", at["steal_chunk"]))
    print(f"{len(fresh)} steals whose first device call is a fence record, walk first\n")
    print("| step (time since the previous mark) | median | p90 |\n|---|---:|---:|")
    for n, v in steps.items():
        print(f"| {n} | {np.median(v):.1f} µs | {np.percentile(v, 90):.1f} µs |")
    f, w = np.array(fresh, float), np.array(walk)
    print(f"\npages indexed: median {np.median(f):,.0f}, p90 {np.percentile(f, 90):,.0f}; "
          f"the index after the device was told, per page: {np.median(w * 1e3 / np.maximum(f, 1)):.1f} ns at the median")


if __name__ == "__main__":
    main()
