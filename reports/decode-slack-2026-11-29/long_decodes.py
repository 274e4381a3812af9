"""The estimate (this checkout) against every live 7B SDPA long decode recorded under PyTorch's allocator and under
gpumem.torch (H200, reports/hil/long-decode-*-2026-11-29/). From the repository root (10-60 s):

    PYTHONPATH=. python reports/decode-slack-2026-11-29/long_decodes.py

Peak allocated as `gpumem estimate` reports it: under `pytorch`, the larger of the requests' peak and the replay's
peak of blocks; under `gpumem`, the requests' peak (gpumem.torch counts requests).
"""
import json

from gpumem.estimate import inference_trace
from gpumem.estimate.fit import replay_inference
from benchmarks.estimate_speed import LLAMA_7B

HIL = "reports/hil/"
# (prompt, new tokens, allocator, record, line of the record: -1 the last, else that window's)
LIVE = [
    (4096, 2000, "pytorch", "long-decode-p4096-h200-2026-11-29/p4096-default.json", -1),
    (1024, 3000, "pytorch", "long-decode-check-h200-2026-11-29/p1024-n3000-default.json", -1),
    (2048, 4500, "pytorch", "long-decode-p4096-h200-2026-11-29/p2048-n4500-default.json", -1),
    (2048, 6000, "pytorch", "long-decode-check-h200-2026-11-29/p2048-n6000-default.json", -1),
    (4096, 2000, "gpumem", "long-decode-p4096-h200-2026-11-29/p4096-gpumem.json", -1),
    (1024, 3000, "gpumem", "long-decode-check-h200-2026-11-29/p1024-n3000-gpumem.json", -1),
    (2048, 4500, "gpumem", "long-decode-p4096-h200-2026-11-29/p2048-n6000-gpumem.json", 9),  # the window at 4,500
    (2048, 6000, "gpumem", "long-decode-p4096-h200-2026-11-29/p2048-n6000-gpumem.json", -1),
]

print(f"{'prompt':>6} {'tokens':>6} {'policy':<8} {'alloc est':>15} {'live':>15} {'err':>8} {'res est':>15} "
      f"{'live':>15} {'err':>8}")
for prompt, n, policy, path, line in LIVE:
    live = json.load(open(HIL + path))["lines"][line]
    kw = dict(prompt_len=prompt, new_tokens=n)
    requests = inference_trace(LLAMA_7B, 2, **kw).peak_nbytes
    (r,) = replay_inference(LLAMA_7B, 2, (policy,), "sim:h200-141gb", peak_nbytes=requests, **kw)
    alloc = max(requests, r.peak_block_allocated_bytes) if policy == "pytorch" else requests
    print(f"{prompt:>6} {n:>6} {policy:<8} {alloc:>15,} {live['peak_alloc']:>15,} {alloc / live['peak_alloc'] - 1:>+8.3%} "
          f"{r.peak_reserved_bytes:>15,} {live['peak_res']:>15,} {r.peak_reserved_bytes / live['peak_res'] - 1:>+8.3%}",
          flush=True)
