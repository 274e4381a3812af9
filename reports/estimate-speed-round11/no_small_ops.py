"""Round 11 of reports/estimate-speed.md: the most a small-pool skip could save the `gpumem` replay, measured as a
bound by sending that policy no small allocation of the template-made decode steps at all (not exact: the figure
it prints differs from the estimate's). From the repository root, once with each mode:

    PYTHONPATH=. python reports/estimate-speed-round11/no_small_ops.py 3000 every
    PYTHONPATH=. python reports/estimate-speed-round11/no_small_ops.py 3000 large
"""
import sys
import time

import numpy as np

import gpumem.estimate.fastreplay as fastreplay
from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference
from benchmarks.estimate_speed import LLAMA_7B

new_tokens, mode = int(sys.argv[1]), sys.argv[2]
if mode == "large":
    def run_step(self, t, tpl):
        sizes = tpl.sizes(t)
        keep = (tpl.kinds == 1) | (sizes > (1 << 20))  # frees of allocations never made free nothing
        self._run_ops_native(np.ascontiguousarray(tpl.kinds[keep]), np.ascontiguousarray(tpl.op_ids(t)[keep]),
                             np.ascontiguousarray(sizes[keep]), self.ptrs)
    fastreplay.PlainSink.run_step = run_step
kw = dict(prompt_len=2048, new_tokens=new_tokens)
peak = inference_trace(LLAMA_7B, 2, **kw)
for _ in range(2):
    t0 = time.process_time()
    r = replay_inference(LLAMA_7B, 2, ("gpumem",), "sim:h200-141gb", peak_nbytes=peak.peak_nbytes, **kw)
    print(mode, new_tokens, f"{time.process_time() - t0:.2f} CPU s", r[0].peak_reserved_bytes)
