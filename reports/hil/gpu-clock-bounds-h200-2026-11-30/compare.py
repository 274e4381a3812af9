"""The check table of ``reports/hil/gpu-clock-bounds-h200-2026-11-30.md`` (the four check runs, then the final code's
run): each trace (gpumem.torch on the H200, recorded with the GPU clock of Note [A stamp lies between its event's
record and its completion seen] and the live engine's reserve after each allocation) replayed on ``sim:h200-141gb`` with the default policy under its default
timing (``gpu-clock``) and compared with the live reserve allocation by allocation
(``gpumem.replay_compare.compare_live``); the last column prices the VMM calls on a busy device as measured
(``LatencyModel.as_measured()``), studied and not adopted::

    PYTHONPATH=. python reports/hil/gpu-clock-bounds-h200-2026-11-30/compare.py          # 1-3 minutes

Live overhead = the largest live reserve / the trace's peak of live bytes, less 1 (the replay's overhead has the
same denominator).
"""

from __future__ import annotations

import dataclasses
import os

from gpumem.replay_compare import compare_live
from gpumem.sim import SimDevice, get_profile
from gpumem.sim.latency import LatencyModel
from gpumem.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = ("check-b12", "check-b14", "check-b16", "check-b20", "final-b12")


def _device(measured: bool) -> SimDevice:
    p = get_profile("h200-141gb")
    return SimDevice(dataclasses.replace(p, latency=LatencyModel.as_measured()) if measured else p)


def main() -> None:
    print("| run | live | replay | replay - live | allocations agreeing | first difference | VMM priced busy |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for stem in TRACES:
        trace = load_trace(os.path.join(HERE, stem + ".gmt.gz"), progress=False)
        runs = []
        for measured in (False, True):
            dev = _device(measured)
            try:
                runs.append(compare_live(trace, dev, engine="native"))
            finally:
                dev.close()
        c = runs[0]
        f = c.first
        where = "none" if f is None else f"op {f.op:,}: {f.gap_nbytes / 2**20:+,.0f} MiB, GPU {f.gpu_lag_us:.0f} µs behind"
        agree = c.allocations_compared - c.allocations_differing
        live = int(trace.live_reserved_nbytes.max()) / c.result.peak_live_bytes - 1
        print(f"| {stem} | {live:.2%} | {c.result.overhead:.2%} | {(c.result.overhead - live) * 100:+.2f} pp | "
              f"{agree:,} of {c.allocations_compared:,} | {where} | {runs[1].result.overhead:.2%} |", flush=True)


if __name__ == "__main__":
    main()
