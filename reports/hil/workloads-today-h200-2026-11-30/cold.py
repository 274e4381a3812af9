"""The cold VMM call (section 5 of ``reports/hil/workloads-today-h200-2026-11-30.md``), on this machine's CPU::

    PYTHONPATH=. python reports/hil/workloads-today-h200-2026-11-30/cold.py fit      # ~15 s
    PYTHONPATH=. python reports/hil/workloads-today-h200-2026-11-30/cold.py replay C_US GAP_US UNMAP_US SETS [CALLS]

``fit`` reads the call logs of the four ``ct-`` servers (the tuning part, ``where-replays-part-2026-11-30/``): each
``cuMemCreate`` and ``cuMemUnmap`` with the time since the previous VMM call of the process, the warm price (the
median of those within 20 µs of the previous call) and, fitted to the medians of four bins of the gap, what a call
costs on top after a gap ``g``: ``C * g / (g + G)``.

``replay`` is a what-if (the simulated device's VMM calls patched here, not shipped): each VMM call (``CALLS``,
default all five ``_do_mem_*`` methods, comma-separated) costs ``C_US * g / (g + GAP_US)`` on top, ``g`` the time since
the device's previous VMM call ended, with ``mem_unmap_mapping_us = UNMAP_US``; it prints replay less live for the
traces of ``SETS`` (comma-separated: ``ct`` the tuning servers, ``live`` every trace with live reserves one folder
down in reports/hil, ``ms`` the four-stream traces beside this file). ``replay 0 1 38.7 ct`` is the shipped model.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import sys

import numpy as np

import gpumem.replay_compare as rc
from gpumem.sim import SimDevice, get_profile
from gpumem.sim import device as simdev
from gpumem.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
HIL = os.path.dirname(HERE)
CALLS = os.path.join(HIL, "where-replays-part-2026-11-30")
VMM = ("cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemSetAccess")
BINS = ((20, 100), (100, 1000), (1000, 10000), (10000, 1e12))


def fit() -> None:
    pts: dict[str, list] = {"cuMemCreate": [], "cuMemUnmap": []}
    for run in ("a-b16", "b-b16", "b-b20", "a-b12"):
        times = load_trace(os.path.join(CALLS, f"ct-{run}.gmt.gz"), progress=False).times_us
        ops: dict[int, list] = {}
        with gzip.open(os.path.join(CALLS, f"calls-{run}.tsv.gz"), "rt") as f:
            f.readline()
            for line in f:
                o, n, s, d = line.split()
                ops.setdefault(int(o), []).append((n, float(s), float(d)))
        prev = None
        for o in sorted(ops):
            for n, s, d in ops[o]:
                if n not in VMM:
                    continue
                at = times[o] + s   # the op's clock (taken as it began) plus the call's start within it
                if prev is not None and n in pts:
                    pts[n].append((at - prev, d))
                prev = at + d
    extra = []
    for n, p in pts.items():
        p = np.array(p)
        warm = float(np.median(p[p[:, 0] < 20, 1]))
        print(f"{n}: warm (within 20 µs of the previous VMM call) median {warm:.1f} µs over {int((p[:, 0] < 20).sum()):,} "
              f"calls")
        extra += [(g, d - warm) for g, d in p]
    e = np.array(extra)
    g, y = e[:, 0], e[:, 1]
    med = [(float(np.median(g[(g >= lo) & (g < hi)])), float(np.median(y[(g >= lo) & (g < hi)])),
            int(((g >= lo) & (g < hi)).sum())) for lo, hi in BINS]
    best = None
    for g0 in np.geomspace(50, 100000, 400):
        for c in np.linspace(20, 250, 231):
            worst = max(abs(c * G / (G + g0) - Y) for G, Y, _ in med)
            if best is None or worst < best[0]:
                best = (worst, float(g0), float(c))
    worst, g0, c = best
    print(f"\nextra = {c:.0f} * g / (g + {g0:.0f} µs); worst bin {worst:.1f} µs\n")
    print("| gap since the previous VMM call | calls | median gap | live, over the warm price (median) | fit |")
    print("|---|---:|---:|---:|---:|")
    for (lo, hi), (G, Y, k) in zip(BINS, med):
        span = f"{lo:g} µs-" + ("" if hi >= 1e12 else f"{hi:g} µs")
        print(f"| {span} | {k:,} | {G:,.0f} µs | {Y:.1f} µs | {c * G / (G + g0):.1f} µs |")


def _patch(c_us: float, gap_us: float, names: list[str]) -> None:
    for name in names:
        real = getattr(simdev.SimDevice, name)

        def make(real):
            def call(self, *args, **kwargs):
                last = getattr(self, "_study_vmm_end_s", None)
                if last is not None:
                    g = (self._clock.now - last) * 1e6
                    extra = c_us * g / (g + gap_us)
                    if extra > 0:
                        self._call("vmm_cold", extra)
                out = real(self, *args, **kwargs)
                self._study_vmm_end_s = self._clock.now
                return out
            return call

        setattr(simdev.SimDevice, name, make(real))


def replay(c_us: float, gap_us: float, unmap_us: float, sets: str, names: list[str]) -> None:
    if c_us > 0:
        _patch(c_us, gap_us, names)
    paths = []
    if "ct" in sets:
        paths += sorted(glob.glob(os.path.join(CALLS, "ct-*.gmt.gz")))
    if "live" in sets:
        paths += sorted(glob.glob(os.path.join(HIL, "*", "*.gmt.gz")))
    if "ms" in sets:
        paths += sorted(glob.glob(os.path.join(HERE, "run-*", "multistream_infer.gpumem.gmt.gz")))
        paths += sorted(glob.glob(os.path.join(HERE, "runs-c", "r*", "multistream_infer.gpumem.gmt.gz")))
    profile = get_profile("h200-141gb")
    latency = dataclasses.replace(profile.latency, mem_unmap_mapping_us=unmap_us)
    print("| trace | live | replay | replay - live | allocations agreeing |\n|---|---:|---:|---:|---:|")
    for path in paths:
        trace = load_trace(path, progress=False)
        if trace.live_reserved_nbytes is None:
            continue
        dev = SimDevice(dataclasses.replace(profile, latency=latency))
        try:
            c = rc.compare_live(trace, dev, engine="native")
        finally:
            dev.close()
        live = int(trace.live_reserved_nbytes.max()) / c.result.peak_live_bytes - 1
        print(f"| {os.path.relpath(path, HIL)} | {live:.2%} | {c.result.overhead:.2%} | "
              f"{(c.result.overhead - live) * 100:+.2f} pp | {c.allocations_compared - c.allocations_differing:,} of "
              f"{c.allocations_compared:,} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["fit"]:
        fit()
    elif sys.argv[1:2] == ["replay"] and len(sys.argv) >= 6:
        names = (sys.argv[6].split(",") if len(sys.argv) > 6 else
                 ["_do_mem_create", "_do_mem_release", "_do_mem_map", "_do_mem_set_access", "_do_mem_unmap"])
        replay(float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], names)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
