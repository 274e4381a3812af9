"""The fit of Note [The engine's own time] (``gpumem/sim/latency.py``), from the call logs of the four timed H200
servers of ``reports/hil/where-replays-part-2026-11-30.md`` §5 (the tuning part), on this machine's CPU, ~1 min::

    PYTHONPATH=. python reports/hil/engine-time-2026-11-30/fit.py

1. Each ``ct-`` trace is replayed as the model stood before (no engine time, unmap at 19.4 µs a mapping), and
   each op's pages indexed before a steal are read off :meth:`gpumem.device.Device.engine_work`.
2. Each live steal op whose first engine call is a fence record (the ``b`` runs: the ``a`` runs' patch did not
   time records) gives the gap from the end of the trace clock's reads to that record.
3. A growth op's gap to its ``cuMemCreate`` is the part every slow op takes (the median, 4.6 µs), taken off.
4. ``k * ln(1 + pages / p0)`` fitted to what is left: the ``p0`` of a grid that minimises the median absolute
   error, with ``k`` the median ratio; a least-squares line and a square root beside it.
5. The pooled median of every live ``cuMemUnmap`` of the four runs.
"""

from __future__ import annotations

import dataclasses
import gzip
import os

import numpy as np

import gpumem.allocator as ga
import gpumem.replay_compare as rc
from gpumem.sim import LatencyModel, SimDevice, get_profile
from gpumem.sim import device as simdev

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS = os.path.join(os.path.dirname(HERE), "where-replays-part-2026-11-30")
BINS = ((0, 500), (500, 1000), (1000, 2000), (2000, 4000), (4000, 8000), (8000, 10**9))


def _calls(run: str) -> dict[int, list[tuple[str, float, float]]]:
    ops: dict[int, list[tuple[str, float, float]]] = {}
    with gzip.open(os.path.join(CALLS, f"calls-{run}.tsv.gz"), "rt") as f:
        f.readline()
        for line in f:
            o, n, s, d = line.split()
            ops.setdefault(int(o), []).append((n, float(s), float(d)))
    return ops


def _clock(name: str) -> bool:
    return name.startswith("cuEventQuery") or name == "cuEventElapsedTime"


def _first_gaps(ops, first: str) -> dict[int, float]:
    """Op -> the gap from the clock's reads to the op's first other call, where that call is ``first``."""
    gaps = {}
    for o, calls in ops.items():
        i = next((k for k, c in enumerate(calls) if not _clock(c[0])), None)
        if i is None or calls[i][0] != first:
            continue
        gaps[o] = calls[i][1] - max([s + d for _, s, d in calls[:i]], default=0.0)
    return gaps


def _pages_by_op(run: str) -> dict[int, int]:
    state = {"op": -1}
    pages: dict[int, int] = {}
    real = simdev.SimDevice._do_engine_work

    def engine_work(self, n):
        pages[state["op"]] = pages.get(state["op"], 0) + n
        return real(self, n)

    make = ga.make_allocator

    def counting(*a, **k):
        alloc = make(*a, **k)
        allocate, free = alloc.allocate, alloc.free

        def alloc_op(*x, **y):
            state["op"] += 1
            return allocate(*x, **y)

        def free_op(*x, **y):
            state["op"] += 1
            return free(*x, **y)

        alloc.allocate, alloc.free = alloc_op, free_op
        return alloc

    profile = get_profile("h200-141gb")
    before = LatencyModel(engine_index_us=0.0, mem_unmap_mapping_us=19.4)   # the model before the fit
    dev = SimDevice(dataclasses.replace(profile, latency=before))
    simdev.SimDevice._do_engine_work, ga.make_allocator = engine_work, counting
    try:
        rc.compare_live(os.path.join(CALLS, f"ct-{run}.gmt.gz"), dev, engine="native")
    finally:
        simdev.SimDevice._do_engine_work, ga.make_allocator = real, make
        dev.close()
    return pages


def _l1_log(p: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    best = None
    for p0 in np.geomspace(10, 5000, 200):
        x = np.log1p(p / p0)
        k = float(np.median(y / x))
        err = float(np.median(np.abs(y - k * x)))
        if best is None or err < best[0]:
            best = (err, float(p0), k)
    return best


def main() -> None:
    pages_all, gaps_all, growth = [], [], []
    unmaps = []
    for run in ("a-b16", "a-b12", "b-b16", "b-b20"):
        ops = _calls(run)
        unmaps += [d for calls in ops.values() for n, _, d in calls if n == "cuMemUnmap"]
        if run.startswith("b"):
            growth += list(_first_gaps(ops, "cuMemCreate").values())
            steals = _first_gaps(ops, "cuEventRecord")
            pages = _pages_by_op(run)
            pairs = [(pages[o], g) for o, g in steals.items() if o in pages]
            print(f"{run}: {len(pairs)} live steals whose first engine call is a fence record, with pages indexed")
            pages_all += [p for p, _ in pairs]
            gaps_all += [g for _, g in pairs]
    p, g = np.array(pages_all, float), np.array(gaps_all, float)
    base = float(np.median(growth))
    y = g - base
    err, p0, k = _l1_log(p, y)
    lin = np.polyfit(p, y, 1)
    ks = float(np.median(y / np.sqrt(p)))
    print(f"\nevery slow op (a growth's gap to cuMemCreate, median of {len(growth)}): {base:.1f} µs")
    print(f"fit: {k:.2f} µs * ln(1 + pages / {p0:.0f}), median |error| {err:.1f} µs ({len(p)} steals)\n")
    print("| pages indexed | steals | live, less the slow op's part (median) | log fit | line | square root |")
    print("|---|---:|---:|---:|---:|---:|")
    for lo, hi in BINS:
        m = (p >= lo) & (p < hi)
        if m.any():
            hi_s = "" if hi >= 10**9 else f"{hi:,}"
            print(f"| {lo:,}-{hi_s} | {int(m.sum())} | {np.median(y[m]):.1f} µs | {np.median(k * np.log1p(p[m] / p0)):.1f} | "
                  f"{np.median(np.polyval(lin, p[m])):.1f} | {np.median(ks * np.sqrt(p[m])):.1f} |")
    u = np.array(unmaps)
    print(f"\ncuMemUnmap, all four runs: {len(u):,} calls, median {np.median(u):.2f} µs "
          f"({np.median(u) / 19.4:.2f}x the model's 19.4 per mapping; less 0.10/MiB x 2 MiB: {np.median(u) - 0.2:.1f})")


if __name__ == "__main__":
    main()
