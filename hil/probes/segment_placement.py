"""Where the CUDA driver puts the segments PyTorch's caching allocator asks for, in a fresh process.

PyTorch gives a request the smallest free block that fits and, among blocks of one size, the one at the lowest
address; so which of two equal free blocks a workload reuses depends on where ``cudaMalloc`` put their segments.
The simulated device places segments in 32 MiB slots handed out downwards, a slot's room filled upwards (Note
[Where the driver places a segment] in gpumem/sim/device.py), and the ``pytorch`` policy orders ties by address. The H200 snapshots of the accuracy harness's fresh processes show another phase
first: with a small model, the row's segments went *up*, one above the other, in the free address range above
the weights, and only once that range was used up below everything (``reports/estimate-accuracy-run5-misses.md``;
the tied Qwen2 0.16B generate row is +4.32 % for it). This probe measures that rule:

1. it builds a model as ``benchmarks/hf_memory_configs.py`` builds it (``--plan``; ``none``: no model), then
   empties the cache as the harness does before a row;
2. it asks for ``--count`` tensors of the sizes of ``--sizes-mib`` in turn (each over 10 MiB, so each opens a
   segment of exactly its size, rounded to 2 MiB), all kept live, and records each segment's address;
3. it frees them, empties the cache, and asks for the same tensors again (how released ranges are reused).

For each pass it writes where each segment went (above or below the one before it, above every segment held
before the pass) and how many bytes went up before the first segment below everything. Prints one JSON line
and writes it to ``--out``::

    python -m hil.probes.segment_placement --plan qwen2-small-tied --out placement.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be whole MiB separated by commas, got {text!r}") from None
    if not sizes or any(s < 12 or s % 2 for s in sizes):
        raise argparse.ArgumentTypeError("each size an even number of MiB >= 12 (a request over "
                                         "10 MiB opens a segment of its own size)")
    return sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hil.probes.segment_placement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="none",
                   help="a plan of benchmarks/hf_memory_configs.py whose model is built first (its base model: "
                        "no LoRA adapters), or 'none' (default)")
    p.add_argument("--sizes-mib", type=_parse_sizes, default=_parse_sizes("12,20,32"),
                   help="segment sizes asked for in turn, in MiB (even, >= 12; default 12,20,32)")
    p.add_argument("--count", type=int, default=48, help="segments asked for in each pass (default 48)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p


def _build(torch: Any, plan: str) -> Any:
    """The plan's model as ``hf_memory_configs.measure`` builds it (on the GPU, in its dtype), or None."""
    if plan == "none":
        return None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hf_memory_configs
    import transformers

    cfg = hf_memory_configs._config(plan)
    master = bool(cfg.pop("_fp32_master", False))
    for key in [k for k in cfg if k.startswith("_")]:
        cfg.pop(key)
    return hf_memory_configs.build_model(torch, transformers, cfg, master)


def _reset(torch: Any) -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _segments(torch: Any) -> list[list[int]]:
    return sorted([s["address"], s["total_size"]] for s in torch.cuda.memory_snapshot())


def _pass(torch: Any, sizes: list[int], count: int) -> dict[str, Any]:
    """Ask for ``count`` tensors, keep them, and say where each one's segment went."""
    held = _segments(torch)
    top = max((a + n for a, n in held), default=0)
    bottom = min((a for a, _ in held), default=0)
    kept, placed = [], []
    lowest = bottom if held else None  # the lowest address held so far
    for i in range(count):
        nbytes = sizes[i % len(sizes)] * MiB
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        kept.append(t)
        addr = t.data_ptr()
        prev = placed[-1]["address"] if placed else None
        placed.append({"size_mib": nbytes // MiB, "address": addr,
                       "above_previous": None if prev is None else addr > prev,
                       "below_everything": None if lowest is None else addr + nbytes <= lowest})
        lowest = addr if lowest is None else min(lowest, addr)
    now = {a for a, _ in _segments(torch)}
    up_mib = 0
    for p in placed:
        if p["below_everything"]:
            break
        up_mib += p["size_mib"]
    out = {"segments_held_before": held, "held_top": top, "held_bottom": bottom, "placed": placed,
           "each_its_own_segment": all(p["address"] in now for p in placed),
           "mib_placed_before_the_first_below_everything": up_mib,
           "n_above_previous": sum(1 for p in placed if p["above_previous"])}
    kept.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.count < 1:
        _parser().error("--count must be >= 1")
    if args.plan != "none":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import hf_memory_configs

        if args.plan not in hf_memory_configs.PLANS:
            _parser().error(f"--plan: unknown plan {args.plan!r} (plans: none, "
                            f"{', '.join(sorted(hf_memory_configs.PLANS))})")
    try:
        import torch
    except ImportError:
        print("segment_placement needs PyTorch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("segment_placement needs a CUDA GPU", file=sys.stderr)
        return 2
    model = _build(torch, args.plan)
    _reset(torch)
    first = _pass(torch, args.sizes_mib, args.count)
    _reset(torch)
    second = _pass(torch, args.sizes_mib, args.count)
    doc = {"plan": args.plan, "sizes_mib": args.sizes_mib, "count": args.count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
           "weights_allocated": torch.cuda.memory_allocated() if model is not None else 0,
           "first_pass": first, "after_release": second}
    text = json.dumps(doc)
    print(text)  # first: a bad --out must not lose a GPU run's figures
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
