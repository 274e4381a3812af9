"""One generate() row of benchmarks/hf_memory.py's llama-7b (random bf16 weights, SDPA, PyTorch's default
allocator) in this process, printed as one JSON line: `python reports/hil/slack-check-h200-2026-11-29/row.py B P N`
from the repository root (one process per row, as Note [One process per row] in benchmarks/hf_memory_configs.py)."""
import dataclasses
import json
import sys

import torch
import transformers

sys.path.insert(0, "benchmarks")
import hf_memory as H  # noqa: E402

b, p, n = (int(x) for x in sys.argv[1:4])
cfg = H.MODELS["llama-7b"]
model = H.build_model(torch, transformers, cfg)
row = H.Row("generate", "llama-7b", cfg, b, p, n)
H.run_generate(torch, model, row)
out = dataclasses.asdict(row)
out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
print(json.dumps(out), flush=True)
