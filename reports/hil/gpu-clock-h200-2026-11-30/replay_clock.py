"""The simulator's figures of ``reports/hil/gpu-clock-h200-2026-11-30.md``: each trace recorded live with its GPU
clock (gpumem.torch, default policy, H200; the clock in the trace, ``.gmt`` version 5), replayed on
``sim:h200-141gb`` under ``gpu-clock`` (single-stream traces: the default for them), ``trace`` and ``idle``
timing, beside the live figures of its run::

    PYTHONPATH=. python reports/hil/gpu-clock-h200-2026-11-30/replay_clock.py

Overhead = peak reserved / peak allocated - 1 of the whole process; device calls in parentheses (live: the engine's
``num_device_calls``; the batch-16 server's: its probe's ``dev``, which counts the same calls).
"""

from __future__ import annotations

import json
import os

import numpy as np

from gpumem.replay import replay_trace
from gpumem.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))


def rows() -> list[tuple[str, str, float, int]]:
    """(workload, trace path, live overhead, live device calls) of every recorded run."""
    out = []
    for label, stem in (("batch-16 server, two requests", "two-requests-b16"),
                        ("check: batch-16 server, again", "check-b16"), ("check: batch-8 server", "check-b8"),
                        ("check: eager attention, batch 4", "check-eager-b4")):
        end = json.load(open(os.path.join(HERE, stem + ".json")))["lines"][-1]
        out.append((label, os.path.join(HERE, stem + ".gmt.gz"), end["peak_res"] / end["peak_alloc"] - 1, end["dev"]))
    for r in json.load(open(os.path.join(HERE, "workloads-clock.json")))["runs"]:
        path = os.path.join(HERE, r["trace_file"])
        if os.path.exists(path):   # llama_generate's trace (9.7 MB) is not shipped
            out.append((r["workload"], path, r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1,
                        r["num_device_calls"]))
    return out


def main() -> None:
    print("| workload | live | gpu-clock | trace | idle | GPU behind the CPU at its ops: median / 99th pct |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, path, live, calls in rows():
        trace = load_trace(path, progress=False)
        lag_ms = (trace.gpu_times_us - trace.times_us) / 1e3
        cells = []
        for timing in ("gpu-clock", "trace", "idle"):
            if timing == "gpu-clock" and len(set(trace.streams.tolist())) > 1:
                cells.append("refused (4 streams)")
                continue
            r = replay_trace(trace, "sim:h200-141gb", "gpumem", progress=False, engine="native", gpu_timing=timing)
            cells.append(f"{r.overhead:.2%} ({r.stats.device_calls:,})")
        print(f"| {name} | {live:.2%} ({calls:,}) | " + " | ".join(cells)
              + f" | {np.median(lag_ms):.2f} / {np.percentile(lag_ms, 99):.1f} ms |")


if __name__ == "__main__":
    main()
