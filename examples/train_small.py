"""A small PyTorch training loop for `gpumem record` and docs/out-of-memory.md: an MLP on random data.

    python examples/train_small.py                      # 30 steps, a few seconds on a GPU
    python examples/train_small.py --oom                # a batch sized to run out of memory in its first step
    gpumem record --out run1 --report -- python examples/train_small.py

--oom sizes the batch from the GPU's memory so that one activation takes a sixth of it: the forward
and backward passes need several such tensors at once, and under PyTorch's caching allocator the first
step fails with torch.OutOfMemoryError (on an H200: 99.24 GiB allocated and 23.27 GiB reserved but
unallocated when 23.30 GiB more were asked for). Under gpumem's allocator (`--allocator gpumem`) the
same steps ran on that H200: the memory PyTorch's allocator lost to fragmentation was enough
(reports/hil/record-h200-2026-11-25.md).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per step (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=4096, help="width of the hidden layers (default: %(default)s)")
    parser.add_argument("--oom", action="store_true", help="size the batch to run out of GPU memory")
    args = parser.parse_args()

    import torch
    from torch import nn

    if not torch.cuda.is_available():
        print("train_small: no CUDA device: this example needs a GPU")
        return 2
    device = torch.device("cuda")
    batch = args.batch_size
    if args.oom:
        total = torch.cuda.get_device_properties(device).total_memory
        batch = max(1, total // (6 * args.hidden * 4))
    model = nn.Sequential(nn.Linear(1024, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    print(f"train_small: batch {batch}, hidden {args.hidden}, {args.steps} steps", flush=True)
    for step in range(args.steps):
        x = torch.randn(batch, 1024, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    print(f"train_small: {args.steps} steps in {time.perf_counter() - t0:.2f} s; {_peaks(torch)}", flush=True)
    return 0


def _peaks(torch) -> str:
    """Peak allocated and reserved bytes, from gpumem.torch when it is PyTorch's allocator (PyTorch's own
    counters raise under a pluggable allocator), else from PyTorch."""
    import sys

    gtorch = sys.modules.get("gpumem.torch")
    if gtorch is not None and gtorch.installed():
        st, who = gtorch.memory_stats(), "gpumem"
        alloc, res = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
    else:
        alloc, res, who = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), "pytorch"
    return f"peak allocated {alloc / 2**20:.1f} MiB, peak reserved {res / 2**20:.1f} MiB ({who})"


if __name__ == "__main__":
    raise SystemExit(main())
