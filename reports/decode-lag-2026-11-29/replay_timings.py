"""The estimate's 7B decode (every step emitted, no decode slack) replayed under gpumem with each GPU timing.

    PYTHONPATH=. python reports/decode-lag-2026-11-29/replay_timings.py PROMPT NEW_TOKENS TIMING[,TIMING...]

One JSON line per timing: the program's peak of requests, the replay's peak reserved, the engine's device and
event calls, the wall seconds of the replay (this machine's CPU). The ops are those of
``inference_trace(..., full_decode=True)`` (the program's requests: Note [The decode slack for stolen pages] in
``gpumem/estimate/fit.py``), replayed by ``replay_trace`` on ``sim:h200-141gb`` (Note [The GPU runs behind the CPU]
in ``gpumem/sim/gpu_work.py`` for the timings; the emitted trace's clock is its op index, so ``model`` is the one
that means anything here besides ``idle``).
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.estimate import inference_trace
from gpumem.replay import replay_trace


def print_rows(prompt: int, new_tokens: int, timings: "list[str]", device: object = "sim:h200-141gb",
               label: str = "") -> None:
    """One JSON line per timing (``device``: a spec, opened anew for each, or an open device for one timing;
    ``label`` added to the timing's name). Also used by ``zero_latency.py`` here and by
    ``reports/hil/lag-check-h200-2026-11-29/predict.py``."""
    trace = inference_trace(LLAMA_7B, 2, prompt_len=prompt, new_tokens=new_tokens, full_decode=True).trace
    for timing in timings:
        t0 = time.perf_counter()
        r = replay_trace(trace, device, "gpumem", gpu_timing=timing, progress=False)
        print(json.dumps({"prompt": prompt, "new_tokens": new_tokens, "timing": timing + label,
                          "peak_requested": r.trace_peak_live_bytes, "peak_reserved": r.peak_reserved_bytes,
                          "device_calls": r.stats.device_calls, "event_calls": r.stats.event_calls,
                          "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    print_rows(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","))
