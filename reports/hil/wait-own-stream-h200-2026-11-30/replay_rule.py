"""The simulator's figures of ``reports/hil/wait-own-stream-h200-2026-11-30.md``: the two-request traces recorded
live under gpumem.torch (its default policy), and two shipped inference traces, replayed under the default policy,
with ``wait_own_stream``, and with ``busy_slack=0``; then the estimate's single-request figure of the batch-16 and
batch-8 requests under the default policy and with ``wait_own_stream``::

    PYTHONPATH=. python reports/hil/wait-own-stream-h200-2026-11-30/replay_rule.py

Overhead = peak reserved / peak allocated - 1 of the whole process (both requests).
"""

from __future__ import annotations

import dataclasses
import os

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.allocator import policy as policies
from gpumem.estimate.fit import replay_inference
from gpumem.replay import replay_trace

HERE = os.path.dirname(os.path.abspath(__file__))
HIL = os.path.dirname(HERE)
TRACES = [
    ("two-requests-b16.gmt.gz", os.path.join(HERE, "two-requests-b16.gmt.gz"), ("trace", "model")),
    ("two-requests-b8.gmt.gz", os.path.join(HERE, "two-requests-b8.gmt.gz"), ("trace",)),
    ("multistream_infer (2026-11-28 run 5)",
     os.path.join(HIL, "live-vs-predicted-h200-2026-11-28-run5", "multistream_infer.gpumem.gmt.gz"), ("trace",)),
    ("multistream_infer (this run, busy_slack=0)", os.path.join(HERE, "multistream_infer.busy0.gmt.gz"),
     ("trace",)),
    ("llama_generate (2026-11-25)", os.path.join(HIL, "live-h200-2026-11-25", "llama_generate.gpumem.gmt.gz"),
     ("trace",)),
]
DEFAULT = policies.get_policy("gpumem")
VARIANTS = [("default", DEFAULT), ("wait_own_stream", dataclasses.replace(DEFAULT, wait_own_stream=True)),
            ("busy_slack=0", dataclasses.replace(DEFAULT, busy_slack=0.0))]


def main() -> None:
    print("| trace | gpu timing | " + " | ".join(name for name, _ in VARIANTS) + " |")
    print("|---|---|" + "---:|" * len(VARIANTS))
    for label, path, timings in TRACES:
        for timing in timings:
            cells = []
            for _, pol in VARIANTS:
                r = replay_trace(path, "sim:h200-141gb", pol, gpu_timing=timing, progress=False, engine="native")
                cells.append(f"{r.peak_reserved_bytes:,} ({r.peak_reserved_bytes / r.stats.peak_allocated_nbytes - 1:.2%})")
            print(f"| {label} | {timing} | " + " | ".join(cells) + " |")
    print()
    print("| estimate, one request | default | wait_own_stream |")
    print("|---|---:|---:|")
    for batch, new in ((16, 48), (16, 32), (8, 16)):
        cells = []
        for _, pol in VARIANTS[:2]:
            saved = policies.POLICIES["gpumem"]
            policies.POLICIES["gpumem"] = pol
            try:
                est = replay_inference(LLAMA_7B, 2, ("gpumem",), "sim:h200-141gb", batch_size=batch, prompt_len=4096,
                                       new_tokens=new)[0]
            finally:
                policies.POLICIES["gpumem"] = saved
            cells.append(f"{est.peak_reserved_bytes:,}")
        print(f"| batch {batch} x 4,096 + {new} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
