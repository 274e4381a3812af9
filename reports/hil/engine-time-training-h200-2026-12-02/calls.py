"""The live driver calls and index walks of the runs of ``reports/hil/engine-time-training-h200-2026-12-02.md``.

The runs were made on the H200 with the study patch beside this file (``patch_calltime.py``, applied to the device's
copy by ``run.sh``). ``compact`` keeps, per run, the ops that made a virtual-memory call or indexed pages, as
``op name start_us dur_us arg`` lines: ``start_us`` counts from the op's ``cuStreamIsCapturing``, which the trace's
GPU clock calls once per stamped op (so it numbers them), ``arg`` is the pages an ``engine_index`` walk indexed.
Its first line is a JSON summary of every call of the run::

    python reports/hil/engine-time-training-h200-2026-12-02/calls.py compact FULL_LOG OUT.tsv.gz
"""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np

VMM = ("cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemRelease")


def compact(src: str, dst: str) -> None:
    """Write the compact form of the full log ``src`` to ``dst`` (module docstring)."""
    names, starts, durs, args = [], [], [], []
    with open(src) as f:
        for line in f:
            n, s, d, a = line.split()
            names.append(n)
            starts.append(int(s))
            durs.append(int(d))
            args.append(int(a))
    names_a = np.array(names)
    starts_a = np.array(starts, dtype=np.int64)
    order = np.argsort(starts_a, kind="stable")   # a mark is pushed when its walk ends: put it where it began
    names_a, starts_a = names_a[order], starts_a[order]
    durs_a, args_a = np.array(durs, dtype=np.int64)[order], np.array(args, dtype=np.int64)[order]
    cap = np.flatnonzero(names_a == "cuStreamIsCapturing")
    op_of = np.searchsorted(cap, np.arange(len(names_a)), side="right") - 1
    wanted = np.isin(names_a, VMM) | (names_a == "engine_index")
    keep_ops = set(op_of[wanted & (op_of >= 0)].tolist())
    summary = {}
    for n in np.unique(names_a):
        d = durs_a[names_a == n] / 1e3
        summary[str(n)] = [int(len(d)), float(np.median(d)), float(np.percentile(d, 90)), float(np.percentile(d, 99))]
    with gzip.open(dst, "wt") as f:
        f.write("# " + json.dumps({"summary_us": summary, "stamped_ops": int(len(cap))}) + "\n")
        for i in range(len(names_a)):
            o = int(op_of[i])
            if o in keep_ops and names_a[i] != "cuStreamIsCapturing":
                f.write(f"{o} {names_a[i]} {(starts_a[i] - starts_a[cap[o]]) / 1e3:.3f} {durs_a[i] / 1e3:.3f} "
                        f"{args_a[i]}\n")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "compact":
        compact(sys.argv[2], sys.argv[3])
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
