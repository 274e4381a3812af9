"""The tables of ``reports/hil/live-reserve-h200-2026-11-30.md``: each trace (gpumem.torch, H200, recorded with its
GPU clock and the live engine's reserve after each allocation, ``.gmt`` version 6) replayed on ``sim:h200-141gb``
with the default policy under its default timing (``gpu-clock``) and compared with the live reserve allocation by
allocation (``gpumem.replay_compare.compare_live``); then the two changes studied and not adopted, each alone and
together: the clock's idle floor taken off (the 1st percentile of the GPU's lag, the lag an idle GPU shows) and the
virtual-memory calls priced at twice the model's idle costs::

    PYTHONPATH=. python reports/hil/live-reserve-h200-2026-11-30/compare.py          # about 3 minutes

Live overhead = the largest live reserve / the trace's peak of live bytes, less 1 (the replay's overhead has the
same denominator).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from gpumem.replay_compare import compare_live
from gpumem.sim import SimDevice, get_profile
from gpumem.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = (("end-stamps-b16", "b16, stamps after the engine (before this change)", "tuning"),
          ("both-b16", "b16", "tuning"), ("both-b8", "b8", "tuning"), ("gpt2_train", "GPT-2 training", "tuning"),
          ("resnet50_train", "ResNet-50 training", "tuning"), ("chk-b16", "b16 again", "check"),
          ("chk-b12", "b12", "check"))


def _device(vmm_factor: float) -> SimDevice:
    p = get_profile("h200-141gb")
    lat = p.latency
    if vmm_factor != 1.0:
        lat = dataclasses.replace(lat, **{k: getattr(lat, k) * vmm_factor for k in (
            "mem_map_us", "mem_set_access_us", "mem_set_access_mapping_us", "mem_unmap_us", "mem_unmap_mapping_us")})
    return SimDevice(dataclasses.replace(p, latency=lat))


def _floored(trace):
    floor = max(float(np.percentile(trace.gpu_times_us - trace.times_us, 1)), 0.0)
    return dataclasses.replace(trace, gpu_times_us=trace.gpu_times_us - floor), floor


def main() -> None:
    print("| run | part | live | replay (default) | allocations agreeing | first difference | "
          "floor off | VMM x2 | both |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for stem, label, part in TRACES:
        trace = load_trace(os.path.join(HERE, stem + ".gmt.gz"), progress=False)
        cells = []
        first = None
        for floor_off, factor in ((False, 1.0), (True, 1.0), (False, 2.0), (True, 2.0)):
            t, _ = _floored(trace) if floor_off else (trace, 0.0)
            dev = _device(factor)
            try:
                c = compare_live(t, dev, engine="native")
            finally:
                dev.close()
            cells.append(f"{c.result.overhead:.2%}")
            if first is None:
                first = c
        f = first.first
        where = "none" if f is None else f"op {f.op:,}: {f.gap_nbytes / 2**20:+,.0f} MiB, GPU {f.gpu_lag_us:.0f} us behind"
        agree = first.allocations_compared - first.allocations_differing
        live = int(trace.live_reserved_nbytes.max()) / first.result.peak_live_bytes - 1
        print(f"| {label} | {part} | {live:.2%} | {cells[0]} | {agree:,} of {first.allocations_compared:,} | {where} "
              f"| {cells[1]} | {cells[2]} | {cells[3]} |", flush=True)


if __name__ == "__main__":
    main()
