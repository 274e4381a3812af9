import sys, os, json, dataclasses, pickle
from pathlib import Path
import torch, transformers
sys.path.insert(0, "benchmarks")
import hf_memory as H
out = Path(os.environ["OUT"])
cfg = H.MODELS["llama-7b"]
model = H.build_model(torch, transformers, cfg)
print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
rows = []
for b, p, n in [(1, 128, 16), (1, 4096, 16), (8, 1024, 32), (1, 2048, 64)]:
    row = H.Row("generate", "llama-7b", cfg, b, p, n)
    H.run_generate(torch, model, row)
    rows.append(dataclasses.asdict(row))
    print(b, p, n, row.peak_allocated_bytes, row.peak_reserved_bytes, row.prefill_peak_allocated_bytes, flush=True)
(out / "rows.json").write_text(json.dumps(rows, indent=1))
for b, p, n in [(1, 128, 16), (1, 4096, 16)]:
    row = H.Row("generate", "llama-7b", cfg, b, p, n)
    H.record_snapshot(torch, lambda: H.run_generate(torch, model, row), out / f"gen7b_b{b}_p{p}_n{n}.snapshot.pickle")
    print("snap", b, p, n, row.peak_allocated_bytes, row.peak_reserved_bytes, flush=True)
