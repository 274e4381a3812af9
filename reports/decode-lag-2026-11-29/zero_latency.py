"""The `model` replay of the estimate's decode (no slack) on a `sim:h200-141gb` whose per-call latencies (every
`LatencyModel` field in µs: map, set access, unmap, the event calls, ...) are zero; the size-dependent tables
(malloc, create, release, address free) kept. `PYTHONPATH=. python reports/decode-lag-2026-11-29/zero_latency.py
PROMPT NEW_TOKENS` prints one JSON line. Does the clock a lagged idle twin must keep need the calls' latencies?"""
import dataclasses
import runpy
import sys
from pathlib import Path

from gpumem.sim import get_profile
from gpumem.sim.latency import LatencyModel
from gpumem.specs import open_device

print_rows = runpy.run_path(str(Path(__file__).resolve().parent / "replay_timings.py"))["print_rows"]
lat = LatencyModel()
zero = dataclasses.replace(lat, **{f.name: 0.0 for f in dataclasses.fields(lat) if f.name.endswith("_us")})
dev = open_device("sim:h200-141gb", profile=dataclasses.replace(get_profile("h200-141gb"), latency=zero))
try:
    print_rows(int(sys.argv[1]), int(sys.argv[2]), ["model"], dev, ", per-call latencies zero")
finally:
    dev.close()
