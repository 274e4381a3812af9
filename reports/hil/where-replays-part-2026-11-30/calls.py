"""The live driver calls of four gpumem.torch runs (section 5 of ``reports/hil/where-replays-part-2026-11-30.md``).

The runs were made on the H200 with a study patch, ``patch_calltime.py`` beside this file, applied to the device's
copy only (``calltime_run.sh`` runs it): every driver call the CUDA backend checks, and each fence record and
query, is timed on the steady clock. The full logs (2 million lines a run) are not shipped. ``compact`` keeps,
per run, the calls of the ops that made a virtual-memory call, as ``op name start_us dur_us`` lines. ``start_us`` counts from the
op's ``cuStreamIsCapturing``, which the trace's GPU clock calls once per op, so it numbers the ops. It also keeps
the whole run's summary per call::

    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/calls.py summary     # the tables, ~1 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/calls.py pair        # live against the model, ~1 min
    python reports/hil/where-replays-part-2026-11-30/calls.py compact FULL_LOG.gz OUT.tsv.gz   # how they were made

``pair`` replays each run's trace (``ct-*.gmt.gz`` beside this file; the ``a`` runs are the first device call's,
the ``b`` runs the second's) and pairs the replay's VMM calls with the live ones, op by op, where both made the
same calls: the model's price against the live time of the same call.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = ("a-b16", "a-b12", "b-b16", "b-b20")
VMM = {"cuMemCreate": "mem_create", "cuMemMap": "mem_map", "cuMemUnmap": "mem_unmap", "cuMemSetAccess": "mem_set_access"}


def _read_full(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    names, starts, durs = [], [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            n, s, d = line.split()
            names.append(n)
            starts.append(int(s))
            durs.append(int(d))
    return np.array(names), np.array(starts, dtype=np.int64), np.array(durs, dtype=np.int64)


def compact(src: str, dst: str) -> None:
    names, starts, durs = _read_full(src)
    cap = np.flatnonzero(names == "cuStreamIsCapturing")
    op_of = np.searchsorted(cap, np.arange(len(names)), side="right") - 1
    vmm = np.isin(names, list(VMM))
    keep_ops = set(op_of[vmm & (op_of >= 0)].tolist())
    summary = {}
    for n in np.unique(names):
        if n.startswith("cuCtx"):
            continue
        d = durs[names == n] / 1e3
        summary[str(n)] = [int(len(d)), float(np.median(d)), float(np.percentile(d, 90)), float(np.percentile(d, 99))]
    with gzip.open(dst, "wt") as f:
        f.write("# " + json.dumps({"summary_us": summary}) + "\n")
        for i in range(len(names)):
            o = int(op_of[i])
            if o in keep_ops and names[i] not in ("cuStreamIsCapturing",) and not names[i].startswith("cuCtx"):
                f.write(f"{o} {names[i]} {(starts[i] - starts[cap[o]]) / 1e3:.3f} {durs[i] / 1e3:.3f}\n")


def _read(run: str):
    with gzip.open(os.path.join(HERE, f"calls-{run}.tsv.gz"), "rt") as f:
        summary = json.loads(f.readline()[2:])["summary_us"]
        rows = [line.split() for line in f]
    ops = np.array([int(r[0]) for r in rows])
    names = np.array([r[1] for r in rows])
    start = np.array([float(r[2]) for r in rows])
    dur = np.array([float(r[3]) for r in rows])
    return summary, ops, names, start, dur


def summary() -> None:
    print("| run | call | n | median | p90 | p99 |\n|---|---|---:|---:|---:|---:|")
    for run in RUNS:
        s = _read(run)[0]
        for n in ("cuEventQuery:done", "cuEventQuery:pending", "cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
                  "cuEventElapsedTime"):
            if n in s:
                c, med, p90, p99 = s[n]
                print(f"| {run} | {n} | {c:,} | {med:.1f} µs | {p90:.1f} µs | {p99:.1f} µs |")
    print("\n| run | unmaps | engine time since the previous call, median | the unmap, median | together, median |"
          "\n|---|---:|---:|---:|---:|")
    for run in RUNS:
        _, ops, names, start, dur = _read(run)
        u = np.flatnonzero(names == "cuMemUnmap")
        u = u[(u > 0) & (ops[u - 1] == ops[u])]   # the op's own previous call
        before = start[u] - (start[u - 1] + dur[u - 1])
        print(f"| {run} | {len(u):,} | {np.median(before):.1f} µs | {np.median(dur[u]):.1f} µs | "
              f"{np.median(before + dur[u]):.1f} µs |")


def pair() -> None:
    sys.path.insert(0, HERE)
    from study import hook_vmm_calls   # noqa: E402 - the script beside this one

    from gpumem.sim import SimDevice, get_profile
    from gpumem.replay_compare import compare_live
    from gpumem.trace import load_trace

    state: dict = {"calls": {}, "ops": None}

    def price(k, name, cost_us):
        state["calls"].setdefault(int(state["ops"][k]), []).append((name, cost_us))
        return cost_us

    hook_vmm_calls(price)
    print("| run | call | pairs | live, median | model, median | live / model, median (p10-p90) |\n|---|---|---:|---:|---:|---|")
    for run in RUNS:
        _, ops, names, _, dur = _read(run)
        live: dict[int, list] = {}
        for o, n, d in zip(ops.tolist(), names.tolist(), dur.tolist()):
            if n in VMM:
                live.setdefault(o, []).append((VMM[n], d))
        trace = load_trace(os.path.join(HERE, f"ct-{run}.gmt.gz"), progress=False)
        state["calls"] = {}
        state["ops"] = np.flatnonzero((trace.kinds == 0) & (trace.nbytes > 0))
        dev = SimDevice(get_profile("h200-141gb"))
        try:
            compare_live(trace, dev, engine="native")
        finally:
            dev.close()
        pairs: dict[str, list] = {n: [] for n in VMM.values()}
        for o, calls in state["calls"].items():
            lv = live.get(o, [])
            if [n for n, _ in lv] == [n for n, _ in calls]:
                for (n, ld), (_, md) in zip(lv, calls):
                    pairs[n].append((ld, md))
        for n, p in pairs.items():
            if p:
                a = np.array(p)
                r = a[:, 0] / a[:, 1]
                print(f"| {run} | {n} | {len(a):,} | {np.median(a[:, 0]):.1f} µs | {np.median(a[:, 1]):.1f} µs | "
                      f"{np.median(r):.2f} ({np.percentile(r, 10):.2f}-{np.percentile(r, 90):.2f}) |", flush=True)


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "compact" and len(sys.argv) == 4:
        compact(sys.argv[2], sys.argv[3])
    elif what == "summary":
        summary()
    elif what == "pair":
        pair()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
