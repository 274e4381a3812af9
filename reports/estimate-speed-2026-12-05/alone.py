"""The estimate's replay of one policy (or several) alone, wall seconds: ``python alone.py 16000 gpumem``
(the checkout on PYTHONPATH; OPENBLAS_NUM_THREADS=1 to leave numpy's threads out, as `gpumem estimate` now does)."""
import sys
import time

from gpumem.estimate import ModelShape, inference_trace
from gpumem.estimate.fit import replay_inference

S = ModelShape(4096, 11008, 32, 32000, 32, 32)
n, pols = int(sys.argv[1]), tuple(sys.argv[2].split(","))
peak = inference_trace(S, 2, prompt_len=2048, new_tokens=n)
t0 = time.perf_counter()
r = replay_inference(S, 2, pols, "sim:h200-141gb", prompt_len=2048, new_tokens=n, peak_nbytes=peak.peak_nbytes)
print(pols, n, f"{time.perf_counter() - t0:.3f} s", [x.peak_reserved_bytes for x in r])
