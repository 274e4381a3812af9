"""Four new live servers (section 4 of ``reports/hil/engine-time-2026-11-30.md``), recorded on the H200 after the
model was fixed, replayed as shipped and under the model before it (no engine time, unmap at 19.4 µs a mapping)::

    PYTHONPATH=. python reports/hil/engine-time-2026-11-30/new.py      # ~1 min

The runs (shipped code, no study patch): ``python -m hil.probes.decode_progress --allocator gpumem --attention
sdpa --batch B --prompt 4096 --new-tokens 48 --window 8 --json new-bB.json --record new-bB.gmt.gz --gpu-clock``
for B = 12 and 14, then B = 16 and 20 (their first runs' files did not come back from the device; these are the
second).
"""

from __future__ import annotations

import dataclasses
import os

from gpumem.replay_compare import compare_live
from gpumem.sim import LatencyModel, SimDevice, get_profile

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "new")


def _row(path: str, latency: LatencyModel):
    dev = SimDevice(dataclasses.replace(get_profile("h200-141gb"), latency=latency))
    try:
        return compare_live(path, dev)
    finally:
        dev.close()


def main() -> None:
    from gpumem.trace import load_trace

    print("| run | live | replay (shipped) | replay - live | allocations agreeing | first difference | "
          "the model before: replay - live |\n|---|---:|---:|---:|---:|---|---:|")
    for b in (12, 14, 16, 20):
        path = os.path.join(HERE, f"new-b{b}.gmt.gz")
        t = load_trace(path, progress=False)
        now = _row(t, LatencyModel())
        before = _row(t, LatencyModel(engine_index_us=0.0, mem_unmap_mapping_us=19.4))
        live = int(t.live_reserved_nbytes.max()) / now.result.peak_live_bytes - 1
        f = now.first
        first = "none" if f is None else f"op {f.op:,}: {f.gap_nbytes / 2**20:+,.0f} MiB, GPU {f.gpu_lag_us:.0f} µs behind"
        print(f"| new-b{b} | {live:.2%} | {now.result.overhead:.2%} | {(now.result.overhead - live) * 100:+.2f} pp | "
              f"{now.allocations_compared - now.allocations_differing:,} of {now.allocations_compared:,} | {first} | "
              f"{(before.result.overhead - live) * 100:+.2f} pp |", flush=True)


if __name__ == "__main__":
    main()
