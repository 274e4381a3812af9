"""How far the replay's GPU runs behind its CPU under ``trace`` timing, against the live runs' own GPU clock, and
what a slower replay CPU (``GpuWorkModel.cpu_op_us``) would predict (issue 18; reports/sim-cpu-pace-2026-12-05.md).

    PYTHONPATH=. python reports/sim-cpu-pace-2026-12-05/study.py lag        # §1: the lag, two tuning programs
    PYTHONPATH=. python reports/sim-cpu-pace-2026-12-05/study.py time       # §2: the step time of two rules
    PYTHONPATH=. python reports/sim-cpu-pace-2026-12-05/study.py memory     # §3: sim.predict_live's 24 rows (4 min)

The lag at operation ``i`` of a replay is the simulated work still queued when the CPU reaches ``i``
(``SimDevice.streams.pending_s``; one stream, so it is how long the GPU still needs); live, it is the recorded GPU
clock less the CPU clock at ``i`` (Note [A replay on the recorded GPU clock] in ``gpumem/sim/gpu_work.py``). Both over
the second half of the operations.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from gpumem.allocator.policy import POLICIES
from gpumem.replay import replay_trace
from gpumem.sim import gpu_work
from gpumem.sim.gpu_work import GpuWorkModel
from gpumem.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
CLOCKED = ROOT / "reports/hil/gpu-clock-h200-2026-11-30"
CPU_US = (4.0, 12.0, 20.0, 28.0)


def _lags(trace, timing: str, model: GpuWorkModel) -> tuple[np.ndarray, float]:
    n = trace.n_ops
    lags = np.full(n, np.nan)
    real = gpu_work.ProgramGpu.before

    def before(self, i):
        real(self, i)
        lags[i] = self.device.streams.pending_s * 1e3

    gpu_work.ProgramGpu.before = before
    try:
        r = replay_trace(trace, progress=False, gpu_timing=timing, gpu_model=model)
    finally:
        gpu_work.ProgramGpu.before = real
    return lags[n // 2:], r.overhead


def lag() -> None:
    print("| program (tuning) | setting | GPU behind the CPU, ms: median / p90 / p99 | overhead |")
    print("|---|---|---|---:|")
    for name in ("resnet50_train", "gpt2_train"):
        t = load_trace(CLOCKED / f"{name}.gpumem.gmt.gz", progress=False)
        live = ((t.gpu_times_us - t.times_us) / 1e3)[t.n_ops // 2:]
        q = lambda a: " / ".join(f"{v:.2f}" for v in np.nanpercentile(a, [50, 90, 99]))
        print(f"| {name} | live (its GPU clock) | {q(live)} | |")
        rows = [("`gpu-clock`", "gpu-clock", GpuWorkModel())]
        rows += [(f"`trace`, cpu_op_us {c:g}" + (" (default)" if c == 4.0 else ""), "trace", GpuWorkModel(cpu_op_us=c))
                 for c in CPU_US]
        rows += [("`trace`, queue_depth 64", "trace", GpuWorkModel(queue_depth=64))]
        for label, timing, model in rows:
            lags, ovh = _lags(t, timing, model)
            print(f"| {name} | {label} | {q(lags)} | {ovh:.2%} |", flush=True)


def time() -> None:
    print("| trace (tuning; marks left out) | cpu_op_us | knobs off: overhead, simulated s | steal_before_warmup | "
          "wait_own_stream |")
    print("|---|---:|---|---|---|")
    for name in ("resnet50_train_h200", "gpt2_fp32_train_h200"):
        t = load_trace(ROOT / f"data/traces/{name}.snapshot.pickle.gz", progress=False, step_marks=False)
        for cpu in (4.0, 20.0):
            cells = []
            for kw in (dict(steal_before_warmup=False), dict(steal_before_warmup=True),
                       dict(steal_before_warmup=False, wait_own_stream=True)):
                r = replay_trace(t, policy=dataclasses.replace(POLICIES["gpumem"], **kw), progress=False,
                                 gpu_model=GpuWorkModel(cpu_op_us=cpu))
                cells.append(r)
            base = cells[0].sim_time_s
            print(f"| {name} | {cpu:g} | " + " | ".join(f"{r.overhead:.2%}, {r.sim_time_s:.3f} s ({r.sim_time_s / base - 1:+.2%})"
                                                     for r in cells) + " |", flush=True)


def memory() -> None:
    sys.path.insert(0, str(ROOT))
    import sim.predict_live as P

    @dataclasses.dataclass(frozen=True)
    class Cand(P.Candidate):
        cpu_op_us: float = 4.0

        @property
        def label(self) -> str:
            return super().label + ("" if self.cpu_op_us == 4.0 else f", cpu {self.cpu_op_us:g} us")

        def gpu_model(self):
            m = super().gpu_model()
            return None if m is None else dataclasses.replace(m, cpu_op_us=self.cpu_op_us)

    cands = [P.Candidate("idle", "idle-priced")] + [Cand("trace", "idle-priced", 2.0, True, c) for c in CPU_US]
    rows = P.live_rows()
    text, _ = P.report(rows, P.measure(rows, cands), cands)
    print(text)


if __name__ == "__main__":
    {"lag": lag, "time": time, "memory": memory}[sys.argv[1] if len(sys.argv) > 1 else "lag"]()
