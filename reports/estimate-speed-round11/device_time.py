"""Round 11 of reports/estimate-speed.md: the simulated device's own time in one `gpumem fit` (7B, prompt 2,048,
sim:a100-80gb), summed over its malloc, free and event calls (each wrapped with a timer). From the repository root:

    PYTHONPATH=. python reports/estimate-speed-round11/device_time.py 4000
"""
import sys
import time

from gpumem import device as device_module
from gpumem.estimate import find_max_batch
from benchmarks.estimate_speed import LLAMA_7B

spent: dict[str, float] = {}


def timed(name):
    real = getattr(device_module.Device, name)

    def call(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    setattr(device_module.Device, name, call)


for name in ("malloc", "free", "event_record", "event_query", "event_destroy"):
    timed(name)
t0 = time.process_time()
find_max_batch(LLAMA_7B, 2, device="sim:a100-80gb", prompt_len=2048, new_tokens=int(sys.argv[1]))
print(f"fit CPU s {time.process_time() - t0:.2f}; device calls' s:", {k: round(v, 2) for k, v in spent.items()})
