"""sim/predict_live.py's scored live rows replayed with `trace` timing at two values of GpuWorkModel.cpu_op_us.

From the repository root (about 3 minutes on 2 cores):

    python reports/hil/long-decode-sdpa-h200-2026-11-29/predict-live-cpu-op-us.py 4,10
"""

import sys
from concurrent.futures import ProcessPoolExecutor

from gpumem.replay import replay_trace
from gpumem.sim.gpu_work import GpuWorkModel
from gpumem.specs import open_device
from gpumem.trace import load_trace
from sim.predict_live import LIVE_POLICIES, PROFILE, live_rows

CPUS = [float(x) for x in sys.argv[1].split(",")]


def job(row):
    trace, policy, out = load_trace(row.trace), LIVE_POLICIES[row.policy], {}
    for cpu in CPUS:
        with open_device(f"sim:{PROFILE}") as dev:
            out[cpu] = replay_trace(trace, dev, policy, progress=False, gpu_timing="trace",
                                    gpu_model=GpuWorkModel(cpu_op_us=cpu)).overhead
    return row, out


if __name__ == "__main__":
    rows = [r for r in live_rows() if not r.not_scored]
    with ProcessPoolExecutor(2) as pool:
        res = list(pool.map(job, rows))
    for row, out in res:
        print(row.part, row.key, f"live {row.live * 100:.3f}",
              " ".join(f"{c:g}:{(v - row.live) * 100:+.3f}" for c, v in out.items()))
    for part in ("tuning", "check"):
        rs = [(r, o) for r, o in res if r.part == part]
        print(part, len(rs), " ".join(
            f"cpu {c:g}: mean|e| {sum(abs(o[c] - r.live) for r, o in rs) / len(rs) * 100:.3f} pp "
            f"worst {max(abs(o[c] - r.live) for r, o in rs) * 100:.3f}" for c in CPUS))
