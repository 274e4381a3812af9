"""The estimate's prediction of a gpumem.torch request with a large prefill, made before it ran: ``PYTHONPATH=. python
reports/hil/estimate-lag-h200-2026-11-30/predict_batch.py BATCH PROMPT NEW_TOKENS`` prints one JSON line: peak
reserved under the ``gpumem`` policy (the estimate runs the GPU's lag through the whole request, prefill included:
Note [The GPU's lag in the decode replay] in ``gpumem/estimate/fit.py``) and under ``pytorch``, and the program's
peak of requests. ``hil.probes.decode_progress`` runs a 32-token request before the measured one, with the same
batch and prompt: the prefill's peak is the same in both, so the prediction of the process's peak is the one of the
request of 32 new tokens.

The 7B model is ``llama7b_long_decode``'s shape (``LLAMA_7B`` of ``benchmarks/estimate_speed.py``), bf16.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference


def main() -> None:
    batch, prompt, new_tokens = (int(a) for a in sys.argv[1:4])
    t0 = time.process_time()
    kw = dict(batch_size=batch, prompt_len=prompt, new_tokens=new_tokens)
    peak = inference_trace(LLAMA_7B, 2, **kw).peak_nbytes
    est = replay_inference(LLAMA_7B, 2, ("gpumem", "pytorch"), "sim:h200-141gb", peak_nbytes=peak, **kw)
    print(json.dumps({"batch": batch, "prompt": prompt, "new_tokens": new_tokens, "figure": "estimate",
                      "peak_requested": peak, "peak_reserved_gpumem": est[0].peak_reserved_bytes,
                      "peak_reserved_pytorch": est[1].peak_reserved_bytes,
                      "cpu_s": round(time.process_time() - t0, 2)}))


if __name__ == "__main__":
    main()
