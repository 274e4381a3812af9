"""Compare the estimates with measurements of ``benchmarks/hf_memory.py`` and write the accuracy table.

``python -m gpumem.estimate.accuracy MEASURED.json [--expandable MEASURED_EXPANDABLE.json] --out BASE``
writes ``BASE.md`` and ``BASE.json``: per measured row the estimated peak allocated bytes against
``torch.cuda.max_memory_allocated`` (error = estimate / measured - 1; the bar is 0 %..+10 %), and the
simulated peak reserved under the ``pytorch`` and ``expandable`` policies against
``torch.cuda.max_memory_reserved`` of the default allocator and of ``expandable_segments:True``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .fit import allocated_as_pytorch_counts, estimate_peak_reserved, replay_inference, training_reserved_nbytes
from .formulas import estimate_inference_memory, estimate_training_memory
from .shape import ModelShape
from .workload import training_trace

__all__ = ["AccuracyRow", "compare", "to_markdown", "main"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AccuracyRow:
    """One measured workload beside its estimate."""

    kind: str
    model: str
    n_params: int
    batch_size: int
    prompt_len: int
    new_tokens: int
    measured_peak_allocated_bytes: int
    estimated_peak_allocated_bytes: int
    error: float
    phase: str
    measured_peak_reserved_bytes: int
    simulated_reserved_pytorch_bytes: int
    measured_peak_reserved_expandable_bytes: int
    simulated_reserved_expandable_bytes: int


def _shape(cfg: dict[str, int]) -> ModelShape:
    return ModelShape(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"],
                      cfg["num_attention_heads"], cfg["num_key_value_heads"])


def compare(doc: dict[str, Any], *, expandable: dict[str, Any] | None = None, reserved: bool = True,
            device: str = "sim:h200-141gb") -> list[AccuracyRow]:
    """Estimate every ``ok`` row of a ``hf_memory.json`` document (``doc``); ``expandable`` is the same
    grid measured under ``expandable_segments:True``, matched by (model, batch, prompt, new tokens)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise InvalidArgumentError("not a hf_memory.json document: no 'rows' list")
    exp = {}
    for r in (expandable or {}).get("rows", []):
        if r.get("status") == "ok":
            exp[(r["kind"], r["model"], r["batch_size"], r["prompt_len"], r["new_tokens"])] = r["peak_reserved_bytes"]
    out: list[AccuracyRow] = []
    for r in doc["rows"]:
        if r.get("status") != "ok" or r.get("kind") not in ("generate", "train", "check"):
            continue
        shape = _shape(r["config"])
        b, p, n = r["batch_size"], r["prompt_len"], r["new_tokens"]
        args = (shape.hidden_size, shape.intermediate_size, shape.n_layers, shape.vocab_size, shape.n_heads,
                shape.n_kv_heads)
        policies = ("pytorch", "expandable")
        if r["kind"] == "train":
            est = estimate_training_memory(*args, p, 2, batch_size=b)
            res = estimate_peak_reserved(training_trace(shape, 2, batch_size=b, seq_len=p), policies,
                                         device=device) if reserved else []
        else:
            est = estimate_inference_memory(*args, p + n, 2, batch_size=b, prompt_len=p, new_tokens=n)
            res = replay_inference(shape, 2, policies, device, batch_size=b, prompt_len=p, new_tokens=n,
                                   peak_nbytes=est.total_bytes) if reserved else []
        sim = {e.policy: e.peak_reserved_bytes for e in res}
        estimated = est.total_bytes
        if r["kind"] != "train" and res:  # as gpumem estimate reports generate()'s peak allocated (pytorch first)
            estimated = allocated_as_pytorch_counts(estimated, res[0]) or estimated
        if r["kind"] == "train" and "pytorch" in sim:  # Note [Training reserved margin] in .fit
            sim["pytorch"] = training_reserved_nbytes(sim["pytorch"])
        m = r["peak_allocated_bytes"]
        out.append(AccuracyRow(
            r["kind"], r["model"], shape.n_params, b, p, n, m, estimated, estimated / m - 1, est.phase,
            r["peak_reserved_bytes"], sim.get("pytorch", 0), exp.get((r["kind"], r["model"], b, p, n), 0),
            sim.get("expandable", 0)))
    return out


_COLUMNS = """\
Columns: *measured alloc* is `torch.cuda.max_memory_allocated()` over the whole run (weights loaded
before it included), *estimate* is `total_bytes` of `estimate_inference_memory` / `estimate_training_memory`
(for `generate()` with the reserved replays, the larger of that and the `pytorch` replay's peak of blocks, as
`gpumem estimate` reports it),
*error* = estimate / measured - 1 (the bar: never below 0, at most +10 %; the goal +3 %), *peak in* is the
phase where the estimate peaks. *reserved (default)* is `torch.cuda.max_memory_reserved()` under PyTorch's
default allocator, *sim pytorch* what the replay of the synthetic trace reserved under gpumem's `pytorch`
policy on `sim:h200-141gb`; *reserved (expandable)* was measured with
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (only some rows), *sim expandable* is the `expandable`
policy's replay. GiB = 2**30 bytes."""


def to_markdown(rows: list[AccuracyRow], title: str = "Estimate accuracy", sources: list[str] | None = None) -> str:
    """The table, and a summary of the errors; ``sources`` are lines naming where the measurements come from."""
    g = 2**30
    lines = [f"# {title}", "", *(sources or []), *([""] if sources else []), _COLUMNS, "",
             "| kind | model | params | batch | prompt/seq | new | measured alloc GiB | estimate GiB | error | peak in "
             "| reserved (default) GiB | sim pytorch GiB | reserved (expandable) GiB | sim expandable GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        exp_m = f"{r.measured_peak_reserved_expandable_bytes / g:.3f}" if r.measured_peak_reserved_expandable_bytes else "-"
        lines.append(
            f"| {r.kind} | {r.model} | {r.n_params / 1e9:.2f}B | {r.batch_size} | {r.prompt_len} | {r.new_tokens} | "
            f"{r.measured_peak_allocated_bytes / g:.3f} | {r.estimated_peak_allocated_bytes / g:.3f} | "
            f"{r.error * 100:+.2f} % | {r.phase} | {r.measured_peak_reserved_bytes / g:.3f} | "
            f"{r.simulated_reserved_pytorch_bytes / g:.3f} | {exp_m} | {r.simulated_reserved_expandable_bytes / g:.3f} |")
    if rows:
        errs = [r.error for r in rows]
        under = [r for r in rows if r.error < 0]
        ratio = [r.measured_peak_reserved_bytes / r.simulated_reserved_pytorch_bytes for r in rows
                 if r.simulated_reserved_pytorch_bytes]
        lines += ["", f"{len(rows)} rows: error of the peak-allocated estimate from {min(errs) * 100:+.2f} % to "
                      f"{max(errs) * 100:+.2f} % (bar: 0 % to +10 %, goal +3 %); {len(under)} below the measurement; "
                      f"{sum(e > 0.03 for e in errs)} above +3 %."]
        if ratio:
            lines.append(f"Measured reserved (PyTorch default) / simulated reserved (`pytorch` policy): "
                         f"{min(ratio):.3f} to {max(ratio):.3f}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m gpumem.estimate.accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measured", type=Path, nargs="+", help="hf_memory.json files (default allocator)")
    ap.add_argument("--expandable", type=Path, help="hf_memory.json measured with expandable_segments:True")
    ap.add_argument("--out", type=Path, required=True, help="base name of the .md and .json written")
    ap.add_argument("--title", default="Estimate accuracy")
    args = ap.parse_args(argv)
    rows: list[AccuracyRow] = []
    meta: list[Any] = []
    sources: list[str] = []
    exp = json.loads(args.expandable.read_text()) if args.expandable else None
    for path in [*args.measured, *([args.expandable] if args.expandable else [])]:
        doc = json.loads(path.read_text())
        m = doc.get("meta", {})
        meta.append(m)
        sources.append(f"- `{path.name}`: {m.get('device', '?')}, torch {m.get('torch', '?')}, transformers "
                       f"{m.get('transformers', '?')}, PYTORCH_CUDA_ALLOC_CONF={m.get('alloc_conf') or '(default)'}"
                       f"{', one process per model' if m.get('fresh_process_per_model') else ''}")
        if path != args.expandable:
            rows += compare(doc, expandable=exp)
    text = to_markdown(rows, args.title, ["Measurements by `benchmarks/hf_memory.py`:", *sources])
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
