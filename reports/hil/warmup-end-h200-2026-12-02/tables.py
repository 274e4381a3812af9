"""The tables of ``reports/hil/warmup-end-h200-2026-12-02.md`` from the records in ``run/`` (this machine's CPU)::

    PYTHONPATH=. python reports/hil/warmup-end-h200-2026-12-02/tables.py live      # seconds
    PYTHONPATH=. python reports/hil/warmup-end-h200-2026-12-02/tables.py steady    # seconds
    PYTHONPATH=. python reports/hil/warmup-end-h200-2026-12-02/tables.py replays   # ~1 min

``live`` tables each run of ``run.sh`` (``run/`` and ``run/steady/``): overhead (peak reserved / peak allocated - 1),
the probe's step time (its timed steps, synchronised at both ends), the host's time of step 8 (where the warm-up
ends: its 8th mark is at step 8's top, which the records before this one called step 7, counting between marks),
the median host step of the timed steps past step 10, and the driver calls. ``steady`` gives the second call's
rounds (``run/steady``: 48 steps, 12 untimed) as ratios of step times. ``replays`` replays the two recorded runs of each
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
    print("| run | workload | allocator | overhead | step ms | host step 8 ms | host median ms | calls |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for f in sorted(glob.glob(os.path.join(RUN, "*", "workloads-*.json"))
                    + glob.glob(os.path.join(RUN, "steady", "*", "workloads-*.json"))):
        tag = os.path.relpath(os.path.dirname(f), RUN)
        for r in json.load(open(f, encoding="utf-8"))["runs"]:
            if "error" in r:
                print(f"| {tag} | {r['workload']} | {r['allocator']} | error: {r['error'][:60]} |")
                continue
            host = r.get("host_step_ms") or []
            if len(host) < 8:
                sys.exit(f"{f}: {r['workload']} ({r['allocator']}) has {len(host)} host step times, not the 8 or more "
                         "this table needs: a record from a workloads probe older than host_step_ms, or a short run")
            name = "PyTorch's" if r["allocator"] == "default" else ("gpumem, give-back" if os.path.basename(tag).startswith("give")
                                                                     else "gpumem, kept")
            print(f"| {tag} | {r['workload']} | {name} | "
                  f"{100 * (r['peak_reserved_bytes'] / r['peak_allocated_bytes'] - 1):.2f} % | "
                  f"{r['mean_step_ms']:.2f} | {host[7]:.0f} | {statistics.median(host[max(r['warmup'], 10):]):.1f} | "
                  f"{r.get('num_device_calls', '-')} |")


def steady() -> None:
    ms: dict[str, dict[str, float]] = {}
    for f in sorted(glob.glob(os.path.join(RUN, "steady", "*", "workloads-*.json"))):
        tag = os.path.basename(os.path.dirname(f))
        for r in json.load(open(f, encoding="utf-8"))["runs"]:
            setting = "give-back" if tag.startswith("give") else ("kept" if r["allocator"] == "gpumem" else "pytorch")
            ms.setdefault(tag[-1], {})[setting] = r["mean_step_ms"]
    print("| round | PyTorch ms | give-back ms | kept ms | give-back / PyTorch | kept / PyTorch | kept / give-back |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rnd, v in sorted(ms.items()):
        p, g, k = v["pytorch"], v["give-back"], v["kept"]
        print(f"| {rnd} | {p:.2f} | {g:.2f} | {k:.2f} | {100 * (g / p - 1):+.1f} % | {100 * (k / p - 1):+.1f} % | "
              f"{100 * (k / g - 1):+.1f} % |")
    for name, num, den in (("give-back / PyTorch", "give-back", "pytorch"), ("kept / PyTorch", "kept", "pytorch"),
                           ("kept / give-back", "kept", "give-back")):
        print(f"median {name}: {100 * statistics.median(v[num] / v[den] - 1 for v in ms.values()):+.1f} %")


def _replay(args: tuple[str, str]) -> tuple[str, str, float, float]:
    from gpumem.allocator.policy import POLICIES
    from gpumem.replay_compare import compare_live
    from gpumem.trace import load_trace

    f, timing = args
    # The run folder's own name says the setting (give-rec or kept-rec), never the path above it.
    give_back = os.path.basename(os.path.dirname(f)).startswith("give")
    pol = dataclasses.replace(POLICIES["gpumem"], warmup_give_back=give_back)
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


COMMANDS = {"live": live, "steady": steady, "replays": replays}

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
    elif len(sys.argv) != 2 or sys.argv[1] not in COMMANDS:
        given = f"unknown command {' '.join(sys.argv[1:])!r}" if sys.argv[1:] else "no command given"
        sys.exit(f"{__doc__}\n{given}: use one of {', '.join(COMMANDS)}")
    else:
        COMMANDS[sys.argv[1]]()
