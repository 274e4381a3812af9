"""The estimate's prediction of a gpumem.torch decode, made before it ran: ``PYTHONPATH=. python
reports/hil/estimate-lag-h200-2026-11-30/predict.py PROMPT NEW_TOKENS`` prints one JSON line: what ``gpumem
estimate`` replays for the ``gpumem`` policy since it runs the GPU's lag (Note [The GPU's lag in the decode replay]
in ``gpumem/estimate/fit.py``), and its peak allocated (the program's requests, as gpumem.torch counts them).

The 7B model is ``llama7b_long_decode``'s shape (``hil/probes/workloads.py``; ``LLAMA_7B`` of
``benchmarks/estimate_speed.py``), batch 1, bf16.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference


def main() -> None:
    prompt, new_tokens = int(sys.argv[1]), int(sys.argv[2])
    t0 = time.process_time()
    peak = inference_trace(LLAMA_7B, 2, prompt_len=prompt, new_tokens=new_tokens).peak_nbytes
    est = replay_inference(LLAMA_7B, 2, ("gpumem",), "sim:h200-141gb", prompt_len=prompt, new_tokens=new_tokens,
                           peak_nbytes=peak)[0]
    print(json.dumps({"prompt": prompt, "new_tokens": new_tokens, "figure": "estimate", "peak_requested": peak,
                      "peak_reserved": est.peak_reserved_bytes, "cpu_s": round(time.process_time() - t0, 2)}))


if __name__ == "__main__":
    main()
