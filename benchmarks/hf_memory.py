"""Measure the GPU memory of Hugging Face transformers ``generate()`` and training steps on a real GPU.

For each Llama-style model (randomly initialised, bf16, SDPA attention) and each workload of the grid,
this records ``torch.cuda.max_memory_allocated`` and ``torch.cuda.max_memory_reserved`` (the peak the
program allocated and the peak PyTorch's caching allocator reserved from the device), what the weights
alone take, and the peak after the prefill step, and writes them as JSON and Markdown under ``--out``.
An out-of-memory error or any other failure of one row is recorded in that row; the grid goes on.

``--trace`` also records PyTorch memory snapshots (``torch.cuda.memory._snapshot``) of one small
generate() and one small training step, which gpumem reads as traces (``gpumem replay FILE``): they show
the exact sequence of allocations the estimator's synthetic traces model.

``--max-batch`` searches, on the device, the largest batch that runs for a few workloads (bisection
between a batch that runs and one that runs out of memory), to check ``gpumem.estimate.find_max_batch``.

Usage (on a machine with a CUDA GPU, torch and transformers)::

    python benchmarks/hf_memory.py --out results/ --fresh         # the accuracy grid, a process per model
    python benchmarks/hf_memory.py --out results/ --trace --max-batch
    python benchmarks/hf_memory.py --out results/ --quick         # a few small rows
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/hf_memory.py --out results/ \
        --tag hf_memory_expandable --no-train --models llama-0.5b-gqa,llama-7b

The estimator compares itself with the JSON: ``python -m gpumem.estimate.accuracy results/hf_memory.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("hf_memory")

#: Llama-style shapes from ~0.1B to 7B parameters: name -> config keywords.
MODELS: dict[str, dict[str, int]] = {
    "llama-0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000),
    "llama-0.5b-gqa": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                           num_key_value_heads=4, vocab_size=32000),
    "llama-1.1b-gqa": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
    "llama-3b-gqa": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
}

#: generate() workloads per model: (batch, prompt tokens, new tokens).
GENERATE_GRID: dict[str, list[tuple[int, int, int]]] = {
    "llama-0.1b": [(1, 128, 16), (4, 1024, 32), (32, 512, 16), (32, 4096, 8)],
    "llama-0.5b-gqa": [(1, 128, 16), (8, 2048, 16), (32, 4096, 8)],
    "llama-1.1b-gqa": [(1, 512, 32), (16, 1024, 16), (32, 4096, 8)],
    "llama-3b-gqa": [(1, 4096, 16), (8, 1024, 16), (32, 2048, 8)],
    "llama-7b": [(1, 128, 16), (1, 4096, 16), (8, 1024, 32), (16, 4096, 8), (32, 2048, 8)],
}

#: training workloads per model: (batch, sequence length).
TRAIN_GRID: dict[str, list[tuple[int, int]]] = {
    "llama-0.1b": [(1, 512), (8, 1024), (16, 2048)],
    "llama-0.5b-gqa": [(4, 1024), (8, 2048)],
    "llama-1.1b-gqa": [(2, 1024), (8, 2048)],
    "llama-3b-gqa": [(1, 2048), (4, 2048)],
}

#: (model, prompt, new tokens) for which --max-batch searches the largest batch that runs.
MAX_BATCH: list[tuple[str, int, int, int]] = [("llama-7b", 4096, 16, 32), ("llama-7b", 1024, 64, 128)]


@dataclass
class Row:
    """One measured workload."""

    kind: str  # "generate" or "train"
    model: str
    config: dict[str, int]
    batch_size: int
    prompt_len: int
    new_tokens: int
    status: str = "ok"  # ok | oom | error
    error: str = ""
    weights_allocated_bytes: int = 0
    baseline_allocated_bytes: int = 0
    baseline_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    prefill_peak_allocated_bytes: int = 0
    after_allocated_bytes: int = 0
    generated_tokens: int = 0
    first_step_peak_allocated_bytes: int = 0
    first_step_peak_reserved_bytes: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _reset(torch: Any) -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def build_model(torch: Any, transformers: Any, cfg: dict[str, int]) -> Any:
    """A randomly initialised LlamaForCausalLM in bf16 on the GPU, SDPA attention, eval mode."""
    config = transformers.LlamaConfig(
        **cfg, max_position_embeddings=8192, attn_implementation="sdpa",
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.to(torch.bfloat16)
    return model.eval()


def run_generate(torch: Any, model: Any, row: Row) -> None:
    """Run one generate() and fill ``row`` with what it allocated."""
    from transformers import LogitsProcessorList

    _reset(torch)
    row.baseline_allocated_bytes = torch.cuda.memory_allocated()
    row.baseline_reserved_bytes = torch.cuda.memory_reserved()
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(3, vocab, (row.batch_size, row.prompt_len), device="cuda", generator=gen)
    attention_mask = torch.ones_like(input_ids)
    steps: list[int] = []

    class Probe:  # a logits processor: called once per generated token, after the step's forward
        def __call__(self, ids: Any, scores: Any) -> Any:
            steps.append(torch.cuda.max_memory_allocated())
            return scores

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=row.new_tokens,
            min_new_tokens=row.new_tokens, do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList([Probe()]),
        )
    torch.cuda.synchronize()
    row.wall_s = time.perf_counter() - t0
    row.generated_tokens = int(out.shape[1] - row.prompt_len)
    row.peak_allocated_bytes = torch.cuda.max_memory_allocated()
    row.peak_reserved_bytes = torch.cuda.max_memory_reserved()
    row.prefill_peak_allocated_bytes = steps[0] if steps else 0
    del out, input_ids, attention_mask
    gc.collect()
    row.after_allocated_bytes = torch.cuda.memory_allocated()


def run_train(torch: Any, model: Any, row: Row, n_steps: int = 2, autocast: bool | str | None = False) -> None:
    """Run ``n_steps`` AdamW training steps (the model's weights, default foreach AdamW) and fill ``row``;
    ``autocast``: the forward under ``torch.autocast`` in ``"bf16"`` (or ``True``) or ``"fp16"`` (mixed
    precision on fp32 master weights)."""
    amp_dtype = torch.float16 if autocast == "fp16" else torch.bfloat16
    model.train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    try:
        _reset(torch)
        row.baseline_allocated_bytes = torch.cuda.memory_allocated()
        row.baseline_reserved_bytes = torch.cuda.memory_reserved()
        vocab = model.config.vocab_size
        gen = torch.Generator(device="cuda").manual_seed(0)
        t0 = time.perf_counter()
        for step in range(n_steps):
            ids = torch.randint(3, vocab, (row.batch_size, row.prompt_len), device="cuda", generator=gen)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=bool(autocast)):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, ids
            torch.cuda.synchronize()
            if step == 0:
                row.first_step_peak_allocated_bytes = torch.cuda.max_memory_allocated()
                row.first_step_peak_reserved_bytes = torch.cuda.max_memory_reserved()
                torch.cuda.reset_peak_memory_stats()
        row.wall_s = time.perf_counter() - t0
        row.peak_allocated_bytes = torch.cuda.max_memory_allocated()
        row.peak_reserved_bytes = torch.cuda.max_memory_reserved()
        row.after_allocated_bytes = torch.cuda.memory_allocated()
    finally:
        opt.zero_grad(set_to_none=True)
        del opt
        model.eval()
        model.config.use_cache = True
        gc.collect()
        torch.cuda.empty_cache()


def guarded(torch: Any, fn: Any, row: Row) -> Row:
    """Run ``fn(row)``; an out-of-memory error or any other exception is recorded, not raised."""
    try:
        fn(row)
    except torch.cuda.OutOfMemoryError as exc:
        row.status, row.error = "oom", str(exc).splitlines()[0][:300]
    except Exception as exc:  # noqa: BLE001 - one failing row must not end the grid
        row.status, row.error = "error", f"{type(exc).__name__}: {exc}"[:500]
        log.warning("%s", traceback.format_exc())
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    log.info("%s %s b=%d p=%d n=%d: %s alloc=%.3f GiB reserved=%.3f GiB", row.kind, row.model, row.batch_size,
             row.prompt_len, row.new_tokens, row.status, row.peak_allocated_bytes / 2**30,
             row.peak_reserved_bytes / 2**30)
    return row


def record_snapshot(torch: Any, fn: Any, path: Path) -> None:
    """Record the allocations of ``fn()`` as a PyTorch memory snapshot (no stacks) at ``path``."""
    import pickle

    _reset(torch)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=500000)
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snap, f)


def max_batch_search(torch: Any, model: Any, name: str, prompt: int, new: int, hi_start: int) -> dict[str, Any]:
    """Bisect the largest batch for which generate() runs (doubling first from ``hi_start``)."""
    tried: dict[int, str] = {}

    def runs(b: int) -> bool:
        row = guarded(torch, lambda r: run_generate(torch, model, r),
                      Row("generate", name, {}, b, prompt, new))
        tried[b] = row.status
        return row.status == "ok"

    lo, hi = 0, hi_start
    while runs(hi):
        lo, hi = hi, hi * 2
        if hi > 4096:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid):
            lo = mid
        else:
            hi = mid
    return {"model": name, "prompt_len": prompt, "new_tokens": new, "max_batch": lo, "first_oom_batch": hi,
            "tried": {str(k): v for k, v in sorted(tried.items())}}


def to_markdown(meta: dict[str, Any], rows: list[Row], searches: list[dict[str, Any]]) -> str:
    """A table of every row."""
    lines = [f"# HF transformers memory on {meta.get('device', '?')}", "",
             f"torch {meta.get('torch')}, transformers {meta.get('transformers')}, "
             f"PYTORCH_CUDA_ALLOC_CONF={meta.get('alloc_conf') or '(default)'}", "",
             "| kind | model | batch | prompt/seq | new | status | weights GiB | peak alloc GiB | peak reserved GiB "
             "| prefill peak GiB | wall s |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    g = 2**30
    for r in rows:
        lines.append(f"| {r.kind} | {r.model} | {r.batch_size} | {r.prompt_len} | {r.new_tokens} | {r.status} | "
                     f"{r.weights_allocated_bytes / g:.3f} | {r.peak_allocated_bytes / g:.3f} | "
                     f"{r.peak_reserved_bytes / g:.3f} | {r.prefill_peak_allocated_bytes / g:.3f} | {r.wall_s:.2f} |")
    for s in searches:
        lines += ["", f"max batch {s['model']} prompt {s['prompt_len']} new {s['new_tokens']}: {s['max_batch']} "
                      f"runs, {s['first_oom_batch']} does not ({s['tried']})"]
    return "\n".join(lines) + "\n"


def run_fresh(args: argparse.Namespace, argv: list[str]) -> int:
    """Run every model of ``--models`` in a child process and merge their JSON into one file."""
    import subprocess
    import tempfile

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    searches: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    passthrough = [a for a in argv if a != "--fresh"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in args.models.split(",") if n]:
            left = args.budget_s - (time.perf_counter() - t0)
            if left <= 5:
                log.warning("budget spent: skipping %s", name)
                continue
            cmd = [sys.executable, __file__, *strip_opts(passthrough, ("--out", "--tag", "--models", "--budget-s", "--snapshot-dir")),
                   "--out", tmp, "--tag", name, "--models", name, "--budget-s", str(left),
                   "--snapshot-dir", str(args.snapshot_dir or args.out)]
            proc = subprocess.run(cmd, check=False)
            part = Path(tmp) / f"{name}.json"
            if not part.exists():
                rows.append(asdict(Row("model", name, MODELS[name], 0, 0, 0, status="error",
                                       error=f"child exited {proc.returncode}")))
                continue
            doc = json.loads(part.read_text())
            rows += doc["rows"]
            searches += doc["max_batch"]
            weights = {**meta.get("weights", {}), **doc["meta"].get("weights", {})}
            meta = {**doc["meta"], "weights": weights, "fresh_process_per_model": True}
    meta["wall_s"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    objs = [Row(**{k: v for k, v in r.items()}) for r in rows]
    (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, "max_batch": searches},
                                                          indent=1))
    (args.out / f"{args.tag}.md").write_text(to_markdown(meta, objs, searches))
    print(to_markdown(meta, objs, searches))
    return 0


def strip_opts(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options in ``names`` (and their values)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the grid and write ``hf_memory.json`` and ``hf_memory.md`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for the results")
    ap.add_argument("--tag", default="hf_memory", help="base name of the output files")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--quick", action="store_true", help="first generate row of each model only, no training")
    ap.add_argument("--no-train", action="store_true", help="skip the training rows")
    ap.add_argument("--trace", action="store_true", help="also record two small PyTorch memory snapshots")
    ap.add_argument("--trace-big", action="store_true",
                    help="also record a snapshot of llama-7b generate() at batch 16, prompt 4096, 8 new tokens")
    ap.add_argument("--max-batch", action="store_true", help="also bisect the largest batch on the device")
    ap.add_argument("--max-batch-spec", default="",
                    help="searches as model:prompt:new:start,... (default: the MAX_BATCH list)")
    ap.add_argument("--check-batches", default="",
                    help="run exactly these generate() rows: model:batch:prompt:new,... (after the grid)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new rows after this many seconds")
    ap.add_argument("--snapshot-dir", type=Path, help="where snapshots go (default: --out)")
    ap.add_argument("--fresh", action="store_true",
                    help="run each model in its own process (no cuBLAS workspace or cache left by another model)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.fresh:
        return run_fresh(args, argv or sys.argv[1:])

    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    snaps = args.snapshot_dir or args.out
    snaps.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "mem_get_info": list(torch.cuda.mem_get_info())}
    rows: list[Row] = []
    searches: list[dict[str, Any]] = []

    def save() -> None:
        doc = {"meta": meta, "rows": [asdict(r) for r in rows], "max_batch": searches}
        (args.out / f"{args.tag}.json").write_text(json.dumps(doc, indent=1))
        (args.out / f"{args.tag}.md").write_text(to_markdown(meta, rows, searches))

    names = [n for n in args.models.split(",") if n]
    for name in names:
        cfg = MODELS[name]
        if time.perf_counter() - t_start > args.budget_s:
            log.warning("budget spent: skipping %s", name)
            break
        _reset(torch)
        try:
            model = build_model(torch, transformers, cfg)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row("model", name, cfg, 0, 0, 0, status="error", error=f"{type(exc).__name__}: {exc}"[:500]))
            save()
            continue
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        meta.setdefault("weights", {})[name] = {"allocated": weights,
                                                "n_params": sum(p.numel() for p in model.parameters())}
        grid = GENERATE_GRID.get(name, [])[: 1 if args.quick else None]
        for b, p, n in grid:
            if time.perf_counter() - t_start > args.budget_s:
                break
            row = Row("generate", name, cfg, b, p, n, weights_allocated_bytes=weights)
            rows.append(guarded(torch, lambda r: run_generate(torch, model, r), row))
            save()
        if args.trace_big and name == "llama-7b":
            def big_gen() -> None:
                run_generate(torch, model, Row("generate", name, cfg, 16, 4096, 8))
            record_snapshot(torch, big_gen, snaps / "generate_7b_b16_p4096_n8.snapshot.pickle")
        if args.trace and name == "llama-0.5b-gqa":
            def small_gen() -> None:
                run_generate(torch, model, Row("generate", name, cfg, 2, 512, 4))
            record_snapshot(torch, small_gen, snaps / "generate_0.5b_b2_p512_n4.snapshot.pickle")
        for spec in [c for c in args.check_batches.split(",") if c]:
            mname, b, p, n = spec.split(":")
            if mname == name:
                row = Row("check", name, cfg, int(b), int(p), int(n), weights_allocated_bytes=weights)
                rows.append(guarded(torch, lambda r: run_generate(torch, model, r), row))
                save()
        if args.max_batch:
            specs = MAX_BATCH
            if args.max_batch_spec:
                specs = [(m, int(p), int(n), int(st)) for m, p, n, st in
                         (x.split(":") for x in args.max_batch_spec.split(",") if x)]
            for mname, prompt, new, start in specs:
                if mname == name and time.perf_counter() - t_start < args.budget_s:
                    searches.append(max_batch_search(torch, model, name, prompt, new, start))
                    save()
        if not args.quick and not args.no_train:
            for b, s in TRAIN_GRID.get(name, []):
                if time.perf_counter() - t_start > args.budget_s:
                    break
                row = Row("train", name, cfg, b, s, 0, weights_allocated_bytes=weights)
                rows.append(guarded(torch, lambda r: run_train(torch, model, r), row))
                save()
            if args.trace and name == "llama-0.1b":
                record_snapshot(torch, lambda: run_train(torch, model, Row("train", name, cfg, 2, 256, 0)),
                                snaps / "train_0.1b_b2_s256.snapshot.pickle")
        del model
        _reset(torch)
    meta["wall_s"] = time.perf_counter() - t_start
    save()
    print(to_markdown(meta, rows, searches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
