"""The tables of ``reports/hil/warmup-end-h200-2026-12-02.md`` from the records in ``run/`` (this machine's CPU)::

    PYTHONPATH=. python reports/hil/warmup-end-h200-2026-12-02/tables.py live      # seconds
    PYTHONPATH=. python reports/hil/warmup-end-h200-2026-12-02/tables.py replays   # ~1 min

``live`` tables each run of ``run.sh``: overhead (peak reserved / peak allocated - 1), the probe's step time (steps
7-40, synchronised at both ends), the host's time of step 8 (where the warm-up ends: its 8th mark is at step 8's
top), the median host step of steps 11-40, and the driver calls. ``replays`` replays the two recorded runs of each
setting on their GPU clock and under ``trace`` timing with the policy they ran (``warmup_give_back`` as recorded).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import sys
from multiprocessing import Pool

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "run")


def live() -> None:
    print("| run | workload | allocator | overhead | step ms (7-40) | host step 8 ms | host median 11-40 ms | calls |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for f in sorted(glob.glob(os.path.join(RUN, "*", "workloads-*.json"))):
        tag = os.path.basename(os.path.dirname(f))
        for r in json.load(open(f, encoding="utf-8"))["runs"]:
            if "error" in r:
                print(f"| {tag} | {r['workload']} | {r['allocator']} | error: {r['error'][:60]} |")
                continue
            host = r["host_step_ms"]
            name = r["allocator"] if r["allocator"] == "default" else ("gpumem, give-back" if "give" in tag
                                                                       else "gpumem")
            print(f"| {tag} | {r['workload']} | {name} | "
                  f"{100 * (r['peak_reserved_bytes'] / r['peak_allocated_bytes'] - 1):.2f} % | "
                  f"{r['mean_step_ms']:.2f} | {host[7]:.0f} | {statistics.median(host[10:]):.1f} | "
                  f"{r.get('num_device_calls', '-')} |")


def _replay(args: tuple[str, str]) -> tuple[str, str, float, float]:
    from gpumem.allocator.policy import POLICIES
    from gpumem.replay_compare import compare_live
    from gpumem.trace import load_trace

    f, timing = args
    pol = dataclasses.replace(POLICIES["gpumem"], warmup_give_back="give" in os.path.dirname(f))
    c = compare_live(load_trace(f, progress=False), "sim:h200-141gb", pol, gpu_timing=timing)
    peak = c.result.peak_live_bytes
    return f, timing, 100 * (c.live_peak_reserved_nbytes / peak - 1), 100 * (c.replayed_peak_reserved_nbytes / peak - 1)


def replays() -> None:
    jobs = [(f, t) for f in sorted(glob.glob(os.path.join(RUN, "*-rec", "*.gmt.gz"))) for t in ("gpu-clock", "trace")]
    with Pool(2) as pool:
        rows = pool.map(_replay, jobs)
    print("| run | timing | live | replayed |\n|---|---|---:|---:|")
    for f, timing, live_pct, rep in rows:
        print(f"| {os.path.relpath(f, RUN)} | {timing} | {live_pct:.2f} % | {rep:.2f} % ({rep - live_pct:+.2f}) |")


COMMANDS = {"live": live, "replays": replays}

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
    elif len(sys.argv) != 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"{__doc__}\nunknown command {' '.join(sys.argv[1:])!r}: use one of {', '.join(COMMANDS)}")
    else:
        COMMANDS[sys.argv[1]]()
