"""The H200 accuracy harness's CPU side (benchmarks/hf_memory_configs.py): the estimate it sets beside a measured
row goes through ``gpumem estimate``'s own code with one policy (before: the policy was passed as a string, which
the command read as a list of seven one-letter policies and refused), and ``--recompute`` redoes the estimates of
a measured file."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hf_memory_configs as harness  # noqa: E402


def _row(name: str, kind: str = "generate") -> dict:
    return {"kind": kind, "model": name, "config": harness._config(name), "batch_size": 1, "prompt_len": 64,
            "new_tokens": 4 if kind == "generate" else 0, "status": "ok", "peak_allocated_bytes": 2**30,
            "peak_reserved_bytes": 2**30, "extra": {"gradient_checkpointing": False}}


def test_the_estimate_of_a_measured_row_uses_the_pytorch_policy_alone():
    est = harness.estimate(_row("mixtral-small"), "sim:h200-141gb")
    assert est["reserved_policy"] == "pytorch" and list(est["peak_reserved_by_policy"]) == ["pytorch"]
    assert est["n_params"] == 791_233_536  # as the H200 counted the model's parameters (run 2)


def test_recompute_redoes_the_estimates_fp32_master_rows_included(tmp_path):
    master = {**_row("qwen2-small", "train"), "status": "measured only"}
    master["extra"] = {"gradient_checkpointing": False, "fp32_master": True}
    doc = {"meta": {"device": "NVIDIA H200", "torch": "t", "transformers": "x", "estimate_device": "sim:h200-141gb"},
           "rows": [{**_row("qwen2-moe-small"), "estimated_peak_allocated_bytes": 1, "alloc_error": 9.0}, master]}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    assert harness.main(["--out", str(tmp_path / "out"), "--recompute", str(src)]) == 0
    rows = json.loads((tmp_path / "out" / "estimate-accuracy.json").read_text())["rows"]
    assert rows[0]["estimated_peak_allocated_bytes"] > 2**20 and rows[0]["alloc_error"] != 9.0
    # the fp32-master row (bf16 autocast) is estimated with --mixed-precision bf16: fp32 weights, grads and
    # two AdamW states are 16 bytes per parameter before any activation
    assert rows[1]["status"] == "ok" and rows[1]["estimated_peak_allocated_bytes"] > 16 * rows[1]["estimated_n_params"]
    assert "not modelled" not in (tmp_path / "out" / "estimate-accuracy.md").read_text()
