"""DDP (NCCL) on gpumem, launched by torchrun: losses bit-identical to PyTorch's own allocator, figures per rank.

    python hil/ddp_probe.py run --nproc 2 --out-json R.json --out-md R.md [--steps 20]

runs the same training twice under ``torchrun --standalone --nproc_per_node N`` (one process per GPU,
NCCL): once on PyTorch's caching allocator (``native``), once with ``gpumem.torch_shim.install()``
(``gpumem``: the C++ shim where it builds, which passes record_stream on, as DDP's all-reduce on
NCCL's stream needs; gpumem's two C hooks otherwise, said in the record). Each rank trains a small
model on its own shard of a fixed data set (seeded; deterministic algorithms, TF32 off) and writes
its losses as exact float hex, the all-reduced mean loss of each step, gpumem's figures (peak
allocated and reserved, allocations) and the engine's consistency check. The record compares the
losses of each rank bit for bit between the two allocators.

``rank`` is the per-process entry torchrun starts (``hil/ddp_probe.py rank --allocator A --out-dir D``).
``--nproc 1`` runs DDP at world size 1 (one GPU: NCCL, the reducer and its buckets, no peer).

Exit status: 0 every rank's losses identical and every check clean; 1 a difference or a failed run;
2 bad input (fewer GPUs than ``--nproc``, bad options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ALLOCATORS = ("native", "gpumem")
N_SAMPLES = 4096
BATCH = 64


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024),
        torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(1024, 10)).cuda()


def rank_main(allocator: str, steps: int, out_dir: Path) -> int:
    """One torchrun process: train ``steps`` steps of DDP; write ``<allocator>-rank<r>.json`` in ``out_dir``."""
    path = "native"
    if allocator == "gpumem":
        import gpumem.torch_shim as ts

        path = ts.install().value   # before PyTorch touches the GPU
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    model = torch.nn.parallel.DistributedDataParallel(_model(torch), device_ids=[local], bucket_cap_mb=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(N_SAMPLES, 256, generator=gen)
    ys = torch.randint(0, 10, (N_SAMPLES,), generator=gen)
    torch.manual_seed(2 + rank)   # dropout: per rank, the same under both allocators
    losses, means = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        lo = ((step * world + rank) * BATCH) % N_SAMPLES
        x, y = xs[lo:lo + BATCH].cuda(non_blocking=True), ys[lo:lo + BATCH].cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()   # all-reduce of each bucket on NCCL's stream (record_stream on the buckets)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(loss.item()).hex())
        means.append(float(mean.item() / world).hex())
    torch.cuda.synchronize()
    out: dict[str, Any] = {"rank": rank, "world_size": world, "allocator": allocator, "install_path": path,
                           "losses": losses, "mean_losses": means, "wall_s": time.perf_counter() - t0,
                           "device": torch.cuda.get_device_name(local)}
    if allocator == "gpumem":
        import gpumem.torch as gt
        from gpumem.native import native_module

        st = gt.memory_stats(local)
        out["gpumem"] = {k: st[k] for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                            "allocated_bytes.all.current", "num_allocs") if k in st}
        # the engine PyTorch allocates from on this device (Note [One engine per device, shared with PyTorch])
        out["consistency_problems"] = native_module().CudaAllocator(local).consistency_problems()
    else:
        out["native"] = {"allocated_bytes.all.peak": torch.cuda.max_memory_allocated(local),
                         "reserved_bytes.all.peak": torch.cuda.max_memory_reserved(local)}
    dist.destroy_process_group()
    (out_dir / f"{allocator}-rank{rank}.json").write_text(json.dumps(out))
    return 0


@dataclasses.dataclass
class Comparison:
    """One rank's losses under both allocators."""

    rank: int
    identical: bool
    first_difference: int | None   # the first step whose loss differs
    gpumem: dict[str, Any]
    native: dict[str, Any]
    consistency_problems: list[str]


def compare(results: dict[str, list[dict[str, Any]]]) -> list[Comparison]:
    """Rank by rank: are the per-step losses and means bit-identical between ``native`` and ``gpumem``?"""
    out = []
    for nat, gm in zip(sorted(results["native"], key=lambda r: r["rank"]), sorted(results["gpumem"], key=lambda r: r["rank"])):
        a, b = nat["losses"] + nat["mean_losses"], gm["losses"] + gm["mean_losses"]
        diff = next((k for k, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        out.append(Comparison(nat["rank"], diff is None, diff, gm.get("gpumem", {}), nat.get("native", {}),
                              list(gm.get("consistency_problems", []))))
    return out


def launch(allocator: str, nproc: int, steps: int, out_dir: Path, timeout_s: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "rank", "--allocator", allocator, "--steps", str(steps),
           "--out-dir", str(out_dir)]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, (proc.stdout + proc.stderr)[-4000:]


def render(comparisons: list[Comparison], meta: dict[str, Any]) -> str:
    lines = [f"# DDP on gpumem: {meta['nproc']} rank(s), torchrun + NCCL ({meta['date']})", "",
             f"{meta['device']}; torch {meta['torch']}; {meta['steps']} steps per rank; gpumem installed through "
             f"{meta['install_path']}.", "",
             "| rank | losses bit-identical | first differing step | gpumem peak allocated | gpumem peak reserved "
             "| native peak reserved | gpumem allocations | consistency |", "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.rank} | {'yes' if c.identical else 'NO'} | {c.first_difference if c.first_difference is not None else '-'} "
                     f"| {c.gpumem.get('allocated_bytes.all.peak')} | {c.gpumem.get('reserved_bytes.all.peak')} "
                     f"| {c.native.get('reserved_bytes.all.peak')} | {c.gpumem.get('num_allocs')} "
                     f"| {'consistent' if not c.consistency_problems else '; '.join(c.consistency_problems)} |")
    if meta.get("failures"):
        lines += ["", "Failed runs:", ""] + [f"- {a}: exit {rc}\n\n```\n{tail}\n```" for a, rc, tail in meta["failures"]]
    return "\n".join(lines) + "\n"


def run_main(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("the DDP probe needs PyTorch with CUDA (pip install torch); it is not installed", file=sys.stderr)
        return 2

    if args.nproc < 1 or args.steps < 1:
        print("--nproc and --steps must be at least 1", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < args.nproc:
        print(f"DDP with {args.nproc} ranks needs {args.nproc} GPUs; this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    failures = []
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ddp-probe-") as tmp:
        out_dir = Path(tmp)
        for allocator in ALLOCATORS:
            rc, tail = launch(allocator, args.nproc, args.steps, out_dir, args.timeout_s)
            if rc != 0:
                failures.append((allocator, rc, tail))
            results[allocator] = [json.loads(p.read_text()) for p in sorted(out_dir.glob(f"{allocator}-rank*.json"))]
    comparisons = compare(results) if all(len(results[a]) == args.nproc for a in ALLOCATORS) else []
    gm = results.get("gpumem") or [{}]
    meta = {"nproc": args.nproc, "steps": args.steps, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device": gm[0].get("device", torch.cuda.get_device_name(0)), "install_path": gm[0].get("install_path", "?"),
            "failures": failures}
    text = render(comparisons, meta)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({"meta": meta, "results": results,
                                                   "comparisons": [dataclasses.asdict(c) for c in comparisons]}, indent=1))
    ok = not failures and comparisons and all(c.identical and not c.consistency_problems for c in comparisons)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python hil/ddp_probe.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rank", help="one torchrun process (torchrun starts it; not for direct use)")
    r.add_argument("--allocator", choices=ALLOCATORS, required=True, help="PyTorch's own allocator or gpumem's")
    r.add_argument("--steps", type=int, default=20, help="training steps")
    r.add_argument("--out-dir", type=Path, required=True, help="where <allocator>-rank<r>.json is written")
    run = sub.add_parser("run", help="both allocators under torchrun, compared")
    run.add_argument("--nproc", type=int, default=2, help="ranks, one GPU each (default 2)")
    run.add_argument("--steps", type=int, default=20, help="training steps per rank (default 20)")
    run.add_argument("--timeout-s", type=float, default=240.0, help="limit of each torchrun launch (default 240)")
    run.add_argument("--out-json", help="write the losses, figures and comparison as JSON here")
    run.add_argument("--out-md", help="write the comparison table as Markdown here")
    args = ap.parse_args(argv)
    if args.cmd == "rank":
        return rank_main(args.allocator, args.steps, args.out_dir)
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
