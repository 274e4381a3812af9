"""cProfile of the estimate's `gpumem` replay alone (7B, prompt 2,048): `PYTHONPATH=. python
reports/estimate-speed-round12/profile_gpumem.py NEW_TOKENS` prints the result and the 18 costliest functions."""
import cProfile
import pstats
import sys

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference

n = int(sys.argv[1])
kw = dict(prompt_len=2048, new_tokens=n)
peak = inference_trace(LLAMA_7B, 2, **kw)
pr = cProfile.Profile()
pr.enable()
r = replay_inference(LLAMA_7B, 2, ("gpumem",), "sim:h200-141gb", peak_nbytes=peak.peak_nbytes, **kw)
pr.disable()
print(r)
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
