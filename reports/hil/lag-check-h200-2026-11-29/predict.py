"""The predictions of a gpumem.torch decode, made before it ran: `PYTHONPATH=. python
reports/hil/lag-check-h200-2026-11-29/predict.py PROMPT NEW_TOKENS` prints one JSON line per figure.

* ``estimate``: what ``gpumem estimate`` replayed for the ``gpumem`` policy when this ran (the idle device, the
  decode slack, at 884e042), with its peak allocated as gpumem.torch counts it (the program's requests); rerun at a
  commit from 2026-11-30 on, this row is the estimate with the GPU's lag (Note [The GPU's lag in the decode replay]
  in ``gpumem/estimate/fit.py``), the ``model`` row's figure;
* ``idle`` and ``model``: the program's requests (no slack) replayed by ``replay_trace`` under ``gpumem`` with the
  GPU idle and with the GPU's lag modelled (``reports/decode-lag-2026-11-29/replay_timings.py``).

The 7B model is ``llama7b_long_decode``'s shape (``hil/probes/workloads.py``), batch 1, bf16.
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference

HERE = Path(__file__).resolve().parent


def main() -> None:
    prompt, new_tokens = int(sys.argv[1]), int(sys.argv[2])
    timings = runpy.run_path(str(HERE.parent.parent / "decode-lag-2026-11-29" / "replay_timings.py"))
    shape = timings["LLAMA_7B"]  # benchmarks/estimate_speed.py's
    t0 = time.perf_counter()
    peak = inference_trace(shape, 2, prompt_len=prompt, new_tokens=new_tokens).peak_nbytes
    est = replay_inference(shape, 2, ("gpumem",), "sim:h200-141gb", prompt_len=prompt, new_tokens=new_tokens,
                           peak_nbytes=peak)[0]
    print(json.dumps({"prompt": prompt, "new_tokens": new_tokens, "figure": "estimate", "peak_requested": peak,
                      "peak_reserved": est.peak_reserved_bytes, "wall_s": round(time.perf_counter() - t0, 1)}),
          flush=True)
    timings["print_rows"](prompt, new_tokens, ["idle", "model"])


if __name__ == "__main__":
    main()
