"""The `model` replay of the estimate's decode (no slack) on a `sim:h200-141gb` whose per-call latencies (every
`LatencyModel` field in µs: map, set access, unmap, the event calls, ...) are zero; the size-dependent tables
(malloc, create, release, address free) kept. `PYTHONPATH=. python reports/decode-lag-2026-11-29/zero_latency.py
PROMPT NEW_TOKENS` prints one JSON line. Does the clock a lagged idle twin must keep need the calls' latencies?"""
import dataclasses
import json
import sys
import time

from gpumem.estimate import ModelShape, inference_trace
from gpumem.replay import replay_trace
from gpumem.sim import get_profile
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)  # as benchmarks/estimate_speed.py

prompt, new_tokens = int(sys.argv[1]), int(sys.argv[2])
trace = inference_trace(LLAMA_7B, 2, prompt_len=prompt, new_tokens=new_tokens, full_decode=True).trace
lat = LatencyModel()
zero = dataclasses.replace(lat, **{f.name: 0.0 for f in dataclasses.fields(lat) if f.name.endswith("_us")})
dev = open_device("sim:h200-141gb", profile=dataclasses.replace(get_profile("h200-141gb"), latency=zero))
t0 = time.perf_counter()
r = replay_trace(trace, dev, "gpumem", gpu_timing="model", progress=False)
print(json.dumps({"prompt": prompt, "new_tokens": new_tokens, "timing": "model, per-call latencies zero",
                  "peak_reserved": r.peak_reserved_bytes, "device_calls": r.stats.device_calls,
                  "event_calls": r.stats.event_calls, "wall_s": round(time.perf_counter() - t0, 1)}))
dev.close()
