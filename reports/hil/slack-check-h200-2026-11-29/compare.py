"""The estimate of this checkout against the slack check's H200 runs (this folder): four short-prompt llama-7b
generate() rows under PyTorch's allocator (rows.jsonl) and a 3,072-token prompt decoded for 2,500 tokens under
PyTorch's allocator and under gpumem.torch (p3072-n2500-*.json). From the repository root:

    PYTHONPATH=. python reports/hil/slack-check-h200-2026-11-29/compare.py

Peak allocated as `gpumem estimate` reports it (pytorch: the larger of the requests' and the replay's blocks;
gpumem: the requests'); peak reserved of the `pytorch` replay against PyTorch's allocator, of the `gpumem` replay
against gpumem.torch. With --slack-everywhere, the decode slack is given to every policy's replay and to the
requests, as before the change (for the before column).
"""
import json
import sys
from pathlib import Path

import gpumem.estimate.fit as fit
import gpumem.estimate.workload as workload
from gpumem.estimate import inference_trace
from gpumem.estimate.fit import allocated_as_pytorch_counts, replay_inference
from benchmarks.estimate_speed import LLAMA_7B

HERE = Path(__file__).parent
if "--slack-everywhere" in sys.argv:  # the estimate before Note [The decode slack for stolen pages]
    real = workload._emit_inference

    def everywhere(*args, decode_slack=False, **kwargs):
        return real(*args, decode_slack=True, **kwargs)
    workload._emit_inference = everywhere


def estimate(policy, b, p, n):
    kw = dict(batch_size=b, prompt_len=p, new_tokens=n)
    requests = inference_trace(LLAMA_7B, 2, **kw).peak_nbytes
    (r,) = replay_inference(LLAMA_7B, 2, (policy,), "sim:h200-141gb", peak_nbytes=requests, **kw)
    alloc = allocated_as_pytorch_counts(requests, r) or requests  # as gpumem estimate reports it
    return alloc, r.peak_reserved_bytes


rows = [json.loads(line) for line in (HERE / "rows.jsonl").read_text().splitlines() if line.strip()]
cases = [("pytorch", r["batch_size"], r["prompt_len"], r["new_tokens"], r["peak_allocated_bytes"],
          r["peak_reserved_bytes"]) for r in rows]
for policy, name in (("pytorch", "default"), ("gpumem", "gpumem")):
    last = json.loads((HERE / f"p3072-n2500-{name}.json").read_text())["lines"][-1]
    cases.append((policy, 1, 3072, 2500, last["peak_alloc"], last["peak_res"]))
print(f"{'policy':<8} {'b x p + n':>14} {'alloc est':>15} {'live':>15} {'err':>8} {'res est':>15} {'live':>15} {'err':>8}")
for policy, b, p, n, live_alloc, live_res in cases:
    alloc, res = estimate(policy, b, p, n)
    print(f"{policy:<8} {f'{b} x {p} + {n}':>14} {alloc:>15,} {live_alloc:>15,} {alloc / live_alloc - 1:>+8.3%} "
          f"{res:>15,} {live_res:>15,} {res / live_res - 1:>+8.3%}", flush=True)
