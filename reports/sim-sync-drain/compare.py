"""Note [A sync gap is the GPU draining] (``gpumem/sim/gpu_work.py``) measured: ``trace`` timing with a
synchronisation's gap as GPU work (now) against the CPU's gaps alone (``sync_gap_is_gpu_work=False``, before)::

    PYTHONPATH=. python reports/sim-sync-drain/compare.py corpus   # every data/traces trace, default policy
    PYTHONPATH=. python reports/sim-sync-drain/compare.py rule [TRACE...]   # wait_own_stream's price
    PYTHONPATH=. python reports/sim-sync-drain/compare.py rule --as-measured|--cpu-pace [TRACE...]   # what-ifs

(The 24 live rows: ``python -m sim.predict_live``, whose candidates include the model before.) ``corpus``: peak
reserved above peak live and the simulated time of each trace's replay under both, beside the time its clock spans.
``rule``: five training traces of the corpus (GPT-2 fp32 and bf16, ResNet-50, ViT, Llama with variable lengths;
recorded under PyTorch's allocator: the same programs as the live rounds) with their step marks left out, under
PyTorch's allocator and under ``wait_own_stream`` off, with the steal's order, the first version of the oldest fence
and now (the variants of ``reports/hil/wait-oldest-h200-2026-12-01/sim_rule.py``, Python engine): overhead, device
calls, simulated time, and the time of the run's last part (from the first synchronisation after 60 % of the trace's
clock to the last one: the steps past growth, as the live rounds time them) against PyTorch's allocator.
"""
import dataclasses
import sys
import warnings
from pathlib import Path

from gpumem.allocator import backing
from gpumem.allocator.policy import get_policy
from gpumem.replay import replay_trace
from gpumem.sim import SimDevice, get_profile, gpu_work
from gpumem.sim.latency import LatencyModel
from gpumem.sim.gpu_work import GpuWorkModel
from gpumem.trace import load_trace
from gpumem.trace.corpus import CHECK, TUNING

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "data/traces"
MODELS = {"before": GpuWorkModel(sync_gap_is_gpu_work=False), "now": GpuWorkModel()}


def corpus() -> None:
    print("| part | trace | before: overhead | now: overhead | before: simulated s | now: simulated s | "
          "the clock's span s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for part, names in (("tuning", TUNING), ("check", CHECK)):
        for name in names:
            trace = load_trace(TRACES / name, progress=False)
            rs = {k: replay_trace(trace, "sim:h200-141gb", "gpumem", progress=False, gpu_model=m)
                  for k, m in MODELS.items()}
            span_s = float(trace.times_us[-1] - trace.times_us[0]) / 1e6
            print(f"| {part} | {name} | {rs['before'].overhead:.2%} | {rs['now'].overhead:.2%} | "
                  f"{rs['before'].sim_time_s:.3f} | {rs['now'].sim_time_s:.3f} | {span_s:.3f} |", flush=True)


def _sync_times(trace, policy, model, **kw) -> tuple[object, list[float]]:
    """The replay, and the simulated time at each synchronisation it made (``ProgramGpu.before``)."""
    times: list[float] = []
    real = gpu_work.ProgramGpu.before

    def before(self, i):
        real(self, i)
        if self._sync[i] & 1:
            times.append(self.device.now_s)

    gpu_work.ProgramGpu.before = before
    profile = get_profile("h200-141gb")
    if "--as-measured" in sys.argv:   # calls priced as on a busy device with many mappings
        profile = dataclasses.replace(profile, latency=LatencyModel.as_measured())
    dev = SimDevice(profile)
    try:
        return replay_trace(trace, dev, policy, progress=False, gpu_model=model, **kw), times
    finally:
        gpu_work.ProgramGpu.before = real
        dev.close()


def _cpu_at_recorded_pace() -> None:
    """What-if (``--cpu-pace``, not shipped): under ``trace`` the replay's CPU spends the recorded gap before each
    operation (its own pace) instead of ``cpu_op_us``, as it does under ``gpu-clock``."""
    real = gpu_work.ProgramGpu.__init__

    def init(self, trace, device, timing, model=None):
        real(self, trace, device, timing, model)
        if self.timing is gpu_work.GpuTiming.TRACE and self.clock:
            t = trace.times_us.tolist()
            gaps = [t[i] - t[i - 1] for i in range(1, len(t))]
            self._cpu_op_s = [self._cpu_s] + [g * 1e-6 if 0 < g < self.model.sync_gap_us else self._cpu_s
                                              for g in gaps]

    gpu_work.ProgramGpu.__init__ = init


def _steady(trace, sync_s: list[float]) -> tuple[float, int]:
    """Seconds from the first synchronisation after 60 % of the trace's clock to the last one (the last part of
    the run, past its growth), and the index of that first synchronisation."""
    t = trace.times_us
    gaps = t[1:] - t[:-1]
    at = [i + 1 for i in range(len(gaps)) if gaps[i] >= GpuWorkModel().sync_gap_us]
    first = next(k for k, i in enumerate(at) if t[i] - t[0] >= 0.6 * (t[-1] - t[0]))
    return sync_s[-1] - sync_s[first], first


def rule() -> None:
    sys.path.insert(0, str(ROOT / "reports/hil/wait-oldest-h200-2026-12-01"))
    import sim_rule as S

    variants = (("off", False, S.NOW_ORDER, S.NOW_READY), ("steal's order", True, S.steal_order, S.first_busy_page),
                ("first version", True, S.oldest_any_size, S.first_busy_page), ("now", True, S.NOW_ORDER, S.NOW_READY))
    print("| trace (marks left out) | model | allocator | overhead | device calls | simulated s | last part s | "
          "last part against PyTorch's allocator |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    if "--cpu-pace" in sys.argv:
        _cpu_at_recorded_pace()
    names = [a for a in sys.argv[2:] if not a.startswith("--")] or [
        "gpt2_fp32_train_h200", "gpt2_bf16_train_h200", "resnet50_train_h200", "vit_train_h200",
        "llama_varlen_train_h200"]
    for name in (f"{n}.snapshot.pickle.gz" for n in names):
        trace = dataclasses.replace(load_trace(TRACES / name, progress=False), plan_events=())
        t = trace.times_us
        for label, model in MODELS.items():
            mine, syncs = _sync_times(trace, "pytorch", model)
            base, first = _steady(trace, syncs)
            rec_at = [i + 1 for i in range(len(t) - 1) if t[i + 1] - t[i] >= model.sync_gap_us]
            recorded = (t[rec_at[-1]] - t[rec_at[first]]) / 1e6
            short = name.split(".")[0]
            print(f"| {short} | {label} | PyTorch's (the recording: {recorded:.3f} s) | {mine.overhead:.2%} | "
                  f"{mine.stats.device_calls:,} | {mine.sim_time_s:.3f} | {base:.3f} | |", flush=True)
            for vname, wait_own, order, ready in variants:
                backing.VirtualBacking._chunk_of_stream = order
                backing.VirtualBacking._chunk_ready = ready
                try:
                    policy = dataclasses.replace(get_policy("gpumem"), wait_own_stream=wait_own)
                    r, syncs = _sync_times(trace, policy, model, engine="python")
                finally:
                    backing.VirtualBacking._chunk_of_stream = S.NOW_ORDER
                    backing.VirtualBacking._chunk_ready = S.NOW_READY
                part, _ = _steady(trace, syncs)
                print(f"| {short} | {label} | gpumem, wait_own_stream {vname} | {r.overhead:.2%} | "
                      f"{r.stats.device_calls:,} | {r.sim_time_s:.3f} | {part:.3f} | {part / base - 1:+.2%} |",
                      flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    {"corpus": corpus, "rule": rule}.get(sys.argv[1] if len(sys.argv) > 1 else "", lambda: sys.exit(__doc__))()
