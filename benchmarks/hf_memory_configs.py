"""Measure generate() and training memory of Hugging Face models built from ``config.json`` files (random
weights, nothing downloaded), beside gpumem's estimate of the same workload.

Each model is a config file (``tests/estimate/configs/*.json``) with optional overrides (to shrink it); the
model is built with ``AutoModelForCausalLM.from_config`` in bf16 with SDPA attention on the GPU, and each
row records ``torch.cuda.max_memory_allocated``/``max_memory_reserved`` (``benchmarks/hf_memory.py``'s
``run_generate``/``run_train``, each model in a fresh process), then ``gpumem estimate`` (the library's
own path: ``estimate_rows`` of the command) for the same config and workload. Libraries a format needs
(bitsandbytes for int8) are probed: where one is missing the row says the figure is modelled, unmeasured.

    python benchmarks/hf_memory_configs.py --out results/ [--plan qwen2-7b,qwen2-small,mistral-7b]

Writes ``estimate-accuracy.json`` and ``estimate-accuracy.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "tests" / "estimate" / "configs"
sys.path.insert(0, str(HERE))

log = logging.getLogger("hf_memory_configs")

#: name -> (config file, overrides, generate rows (batch, prompt, new), training rows (batch, seq, gradient
#: checkpointing)).
PLANS: dict[str, tuple[str, dict[str, Any], list[tuple[int, int, int]], list[tuple[int, int, bool]]]] = {
    "qwen2-7b": ("qwen2-7b.json", {}, [(1, 512, 16), (8, 1024, 16), (4, 2048, 64)], []),
    "qwen2-small": ("qwen2-7b.json", {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                                      "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
                                      "bos_token_id": 1, "eos_token_id": 2},
                    [(2, 256, 16), (16, 1024, 32)], [(2, 512, False), (8, 1024, False), (8, 1024, True),
                                                     (16, 2048, True)]),
    "mistral-7b": ("mistral-7b-v0.1.json", {}, [(1, 1024, 16), (8, 2048, 16), (2, 4000, 64)], []),
    "mixtral-small": ("mixtral-8x7b.json", {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
                                            "num_attention_heads": 16, "num_key_value_heads": 4},
                      [(1, 512, 16), (8, 1024, 32), (32, 2048, 16)], []),
    "qwen2-moe-small": ("qwen2-moe-a2.7b.json", {"hidden_size": 1024, "num_hidden_layers": 8,
                                                 "num_attention_heads": 16, "num_key_value_heads": 16,
                                                 "moe_intermediate_size": 704, "shared_expert_intermediate_size": 2816,
                                                 "intermediate_size": 2816, "vocab_size": 32000, "bos_token_id": 1,
                                                 "eos_token_id": 2},
                        [(1, 512, 16), (8, 1024, 32), (16, 2048, 16)], []),
    # mixed precision: fp32 weights (the master copy), the forward under bf16 autocast, fp32 AdamW states
    "qwen2-small-fp32-master": ("qwen2-7b.json", {"hidden_size": 1024, "intermediate_size": 2816,
                                                  "num_hidden_layers": 8, "num_attention_heads": 16,
                                                  "num_key_value_heads": 4, "vocab_size": 32000, "bos_token_id": 1,
                                                  "eos_token_id": 2, "_fp32_master": True},
                                [], [(2, 512, False), (8, 1024, False), (8, 1024, True)]),
}


def _config(name: str) -> dict[str, Any]:
    file, over, _, _ = PLANS[name]
    cfg = json.loads((CONFIGS / file).read_text())
    cfg.update(over)
    return cfg


def measure(name: str, out: Path) -> None:
    """Build ``name`` and run its rows (in this process); write ``out``."""
    import torch
    import transformers
    from hf_memory import Row, _reset, guarded, run_generate, run_train

    cfg = _config(name)
    master = bool(cfg.pop("_fp32_master", False))
    _, _, gen, train = PLANS[name]
    config = transformers.AutoConfig.for_model(
        cfg["model_type"], attn_implementation="sdpa",
        **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")})
    _reset(torch)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if master else torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to(torch.float32 if master else torch.bfloat16).eval()
    torch.cuda.synchronize()
    meta = {"weights_allocated": torch.cuda.memory_allocated(), "n_params": sum(p.numel() for p in model.parameters()),
            "experts_implementation": str(getattr(config, "experts_implementation", getattr(
                config, "_experts_implementation", None))),
            "param_shapes": [[n, list(p.shape)] for n, p in list(model.named_parameters())[:16]]}
    rows = []
    for b, p, n in gen:
        rows.append(guarded(torch, lambda r: run_generate(torch, model, r), Row("generate", name, cfg, b, p, n)))
    for b, s, ckpt in train:
        if ckpt:
            model.gradient_checkpointing_enable()
        row = Row("train", name, cfg, b, s, 0)
        row.extra["gradient_checkpointing"] = ckpt
        row.extra["fp32_master"] = master
        rows.append(guarded(torch, lambda r: run_train(torch, model, r, autocast=master), row))
        if ckpt:
            model.gradient_checkpointing_disable()
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}))


def estimate(row: dict[str, Any], device: str) -> dict[str, Any]:
    """gpumem's estimate of a measured row, through ``gpumem estimate``'s own code."""
    from gpumem.commands.estimate import estimate_rows

    master = bool(row.get("extra", {}).get("fp32_master"))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(row["config"], f)
    try:
        ns = argparse.Namespace(
            hf_config=f.name, hidden_size=None, intermediate_size=None, layers=None, vocab_size=None, heads=None,
            kv_heads=None, head_dim=0, tie_word_embeddings=False, weight_format=None, weight_bits=None,
            batch_size=row["batch_size"], prompt_len=row["prompt_len"], new_tokens=row["new_tokens"],
            max_seq_len=None, training=row["kind"] == "train", dtype=["fp32" if master else "bf16"], policy=["pytorch"], device=device,
            no_reserved=False, json=True,
            gradient_checkpointing=bool(row.get("extra", {}).get("gradient_checkpointing")), optimizer_8bit=False,
            lora_rank=None, lora_targets=None, mixed_precision="bf16" if master else None)
        (est,) = estimate_rows(ns)
    finally:
        os.unlink(f.name)
    return est


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--plan", default=",".join(PLANS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: measure one plan into --out
    ap.add_argument("--recompute", type=Path,
                    help="no measuring: an estimate-accuracy.json measured before, its estimates recomputed by this "
                         "checkout's code (written under --out)")
    ap.add_argument("--device-spec", default="auto",
                    help="simulated device of the estimate's replays (auto: sim:h200-141gb on an H200, else "
                         "sim:h100-80gb)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.one:
        measure(args.one, args.out)
        return 0
    if args.recompute:
        old = json.loads(args.recompute.read_text())
        measured = []
        for r in old["rows"]:
            r = {k: v for k, v in r.items() if not k.startswith("estimated_") and not k.endswith("_error")}
            if r.get("status") in ("measured only", "estimate failed"):
                r["status"] = "ok"
            measured.append(r)
        doc = {"meta": old["meta"], "rows": _estimated(measured, old["meta"]["estimate_device"])}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "estimate-accuracy.json").write_text(json.dumps(doc, indent=1))
        (args.out / "estimate-accuracy.md").write_text(to_markdown(doc))
        print(to_markdown(doc))
        return 0
    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    if args.device_spec == "auto":
        args.device_spec = "sim:h200-141gb" if "H200" in torch.cuda.get_device_name(0) else "sim:h100-80gb"
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "libraries": {m: importlib.util.find_spec(m) is not None for m in ("bitsandbytes", "bitnet")},
            "estimate_device": args.device_spec}
    rows: list[dict[str, Any]] = []
    for name in [p for p in args.plan.split(",") if p]:
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "part.json"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--out", str(part), "--one", name], check=False)
            if not part.exists():
                rows.append({"kind": "model", "model": name, "status": "error",
                             "error": f"child exited {proc.returncode}"})
                continue
            doc = json.loads(part.read_text())
            meta.setdefault("weights", {})[name] = doc["meta"]
            log.info("%s measured in %.1f s", name, time.perf_counter() - t0)
            rows += _estimated(doc["rows"], args.device_spec)
            (args.out / "estimate-accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    doc = {"meta": meta, "rows": rows}
    (args.out / "estimate-accuracy.json").write_text(json.dumps(doc, indent=1))
    (args.out / "estimate-accuracy.md").write_text(to_markdown(doc))
    print(to_markdown(doc))
    return 0


def _estimated(measured: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The measured rows with gpumem's estimate beside each (rows that failed, or are measured only, as they
    are)."""
    rows: list[dict[str, Any]] = []
    for r in measured:
        if r["status"] == "ok":
            try:
                est = estimate(r, device)
            except Exception as exc:  # recorded beside the measurement, which is kept
                r["status"], r["error"] = "estimate failed", f"{type(exc).__name__}: {exc}"
                rows.append(r)
                continue
            r["estimated_peak_allocated_bytes"] = est["peak_allocated_bytes"]
            r["estimated_peak_reserved_bytes"] = est.get("peak_reserved_bytes")
            r["estimated_n_params"] = est["n_params"]
            r["alloc_error"] = est["peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1
            r["reserved_error"] = (est["peak_reserved_bytes"] / r["peak_reserved_bytes"] - 1
                                   if est.get("peak_reserved_bytes") else None)
        rows.append(r)
    return rows


def to_markdown(doc: dict[str, Any]) -> str:
    """The table of measured against estimated rows."""
    m = doc["meta"]
    lines = [f"# Estimate accuracy on {m['device']} (torch {m['torch']}, transformers {m['transformers']})", "",
             "Random weights, bf16, SDPA; models built from the config files under tests/estimate/configs. "
             "GiB = 2**30 bytes; error = estimate / measured - 1. Reserved: PyTorch's default allocator against "
             f"the `pytorch` policy's replay on {m['estimate_device']}.", "",
             "| kind | model | params | batch | prompt | new | measured alloc | estimate | error | measured reserved"
             " | estimate | error |", "|" + "---|" * 12]
    g = 2**30
    for r in doc["rows"]:
        if r.get("status") == "measured only":
            kind = r["kind"] + (" (grad. ckpt)" if r.get("extra", {}).get("gradient_checkpointing") else "")
            lines.append(f"| {kind} | {r['model']} | | {r['batch_size']} | {r['prompt_len']} | {r['new_tokens']} | "
                         f"{r['peak_allocated_bytes'] / 2**30:.3f} | not modelled | | "
                         f"{r['peak_reserved_bytes'] / 2**30:.3f} | not modelled | |")
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r.get('kind')} | {r.get('model')} | | {r.get('batch_size', '')} | "
                         f"{r.get('prompt_len', '')} | {r.get('new_tokens', '')} | {r.get('status')}: "
                         f"{str(r.get('error', ''))[:80]} | | | | | |")
            continue
        res = r.get("estimated_peak_reserved_bytes") or 0
        rerr = r.get("reserved_error")
        kind = r["kind"] + (" (grad. ckpt)" if r.get("extra", {}).get("gradient_checkpointing") else "")
        lines.append(f"| {kind} | {r['model']} | {r['estimated_n_params'] / 1e9:.2f}B | {r['batch_size']} | "
                     f"{r['prompt_len']} | {r['new_tokens']} | {r['peak_allocated_bytes'] / g:.3f} | "
                     f"{r['estimated_peak_allocated_bytes'] / g:.3f} | {r['alloc_error']:+.2%} | "
                     f"{r['peak_reserved_bytes'] / g:.3f} | {res / g:.3f} | "
                     f"{'-' if rerr is None else format(rerr, '+.2%')} |")
    libs = m.get("libraries", {})
    lines += ["", "Libraries on the device: " + ", ".join(f"{k} {'present' if v else 'missing'}"
                                                          for k, v in libs.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
