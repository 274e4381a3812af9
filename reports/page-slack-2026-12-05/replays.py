"""The page slack (AllocatorPolicy.page_slack) 0.005 -> 0.0015 on every corpus trace, sim:h200-141gb, trace timing, the
replay CPU at 4 (the default) and 20 us an op (reports/sim-cpu-pace-2026-12-05.md): overhead, device calls, simulated
time. ``PYTHONPATH=. python reports/page-slack-2026-12-05/replays.py``; the sweep of more values is
``python -m sim.peak_composition --part tuning|check --gpu-timing trace|idle --set page_slack=V``."""

import dataclasses, sys
from gpumem.replay import replay_trace
from gpumem.trace import load_trace
from gpumem.trace.corpus import corpus_traces
from gpumem.allocator.policy import POLICIES
from gpumem.sim.gpu_work import GpuWorkModel
for part in ("tuning", "check"):
    for path in corpus_traces(part):
        t = load_trace(path, progress=False)
        cells = []
        for cpu in (4.0, 20.0):
            rs = [replay_trace(t, policy=dataclasses.replace(POLICIES["gpumem"], page_slack=ps), progress=False,
                               gpu_model=GpuWorkModel(cpu_op_us=cpu)) for ps in (0.005, 0.0015)]
            cells.append(f"cpu {cpu:g}: {rs[0].overhead:.3%} -> {rs[1].overhead:.3%}, calls {rs[0].stats.device_calls} -> {rs[1].stats.device_calls}, time {rs[1].sim_time_s / rs[0].sim_time_s - 1:+.3%}")
        print(part, path.name.split('.')[0], " | ".join(cells), flush=True)
