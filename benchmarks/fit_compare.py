"""Where the largest batch lands by each rule, on several simulated GPUs: ``find_max_batch``'s answer (replay
with margin), the peak-allocated estimate alone, a halving retry and a binary search without margin.

    python benchmarks/fit_compare.py [--out reports/estimate-fit-profiles.md]

Models: Llama-3-8B (GQA) and Llama-2-7B (multi-head) shapes, bf16, generate() with 16 new tokens after a
1024- or 4096-token prompt, under the ``pytorch`` and ``expandable`` policies.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gpumem.estimate import ModelShape, find_max_batch

MODELS = {
    "llama-3-8b": ModelShape(4096, 14336, 32, 128256, 32, 8),
    "llama-2-7b": ModelShape(4096, 11008, 32, 32000, 32, 32),
}
DEVICES = ["sim:rtx-4090-24gb", "sim:a100-40gb", "sim:a100-80gb", "sim:h200-141gb"]
PROMPTS = [1024, 4096]
POLICIES = ["pytorch", "expandable"]


def main(argv: list[str] | None = None) -> int:
    """Print (and with --out write) the Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    lines = ["# find_max_batch on simulated GPUs", "",
             f"generate(), bf16, {args.new_tokens} new tokens. *fit*: the replay fits with the policy's margin "
             "(the answer); *estimate*: the peak-allocated estimate alone fits; *halving*: a retry halving from "
             "a power of two settles; *binary search*: doubling and bisection on the replay without margin.", "",
             "| model | device | prompt | policy | fit | estimate | halving | binary search | halving loses |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, shape in MODELS.items():
        for dev in DEVICES:
            for prompt in PROMPTS:
                for policy in POLICIES:
                    t0 = time.perf_counter()
                    r = find_max_batch(shape, 2, device=dev, prompt_len=prompt, new_tokens=args.new_tokens,
                                       policy=policy, max_value=1024)
                    lost = f"{1 - r.halving / r.simulated:.0%}" if r.simulated else "-"
                    lines.append(f"| {name} | {dev} | {prompt} | {policy} | {r.simulated} | {r.estimate} | "
                                 f"{r.halving} | {r.binary_search} | {lost} |")
                    print(lines[-1], f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
