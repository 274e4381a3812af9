"""Replay the shared real traces and print how gpumem compares.

Three tables, each measured side by side in one run (the machines are shared and noisy,
so only ratios within a run mean anything):

1. **Overhead** (peak reserved / peak live - 1) of every policy on every trace on a
   simulated device (default ``sim:h200-141gb``), beside the best peer measured on the
   real H200 (``shared/anchors.md``). Target: gpumem at most the best peer on every
   trace; goal: at most 1 %.
2. **Time per operation** of the gpumem allocator on the simulated device, as a ratio to
   a bare Python loop over the same operations (a dict insert per alloc, a dict pop per
   free). Goal: at most 10x.
3. With ``--cuda``: on a real GPU, wall time per operation of gpumem on ``cuda:0``
   beside CuPy's MemoryPool and PyTorch's caching allocator (and RMM's pool if rmm is
   installed) on the same traces. Goal: at or below CuPy's pool.

Usage::

    python benchmarks/replay_bench.py [--traces DIR] [--device SPEC] [--cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from gpumem.allocator import POLICIES
from gpumem.replay import replay_trace
from gpumem.trace import Trace, load_trace

#: Best peer overhead on the H200 (shared/anchors.md), by trace name.
BEST_PEER = {"gpt2_train": 0.069, "resnet_train": 0.006, "llama_generate": 0.053, "bert_varlen": 0.012}
#: CuPy MemoryPool cost per op on the H200, microseconds (shared/anchors.md).
CUPY_US = {"gpt2_train": 0.81, "resnet_train": 1.41, "llama_generate": 0.55, "bert_varlen": 0.89}
TRACE_FILES = ("gpt2_train.snapshot.pickle.gz", "resnet_train.snapshot.pickle.gz", "bert_varlen.trace.pickle.gz",
               "llama_generate.trace.pickle.gz", "resnet_train.rmm_log.csv.gz")


def default_traces_dir() -> Path:
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def bare_loop_ns_per_op(trace: Trace, repeat: int = 3) -> float:
    kinds, ids, sizes, _ = trace.as_lists()
    best = float("inf")
    for _ in range(repeat):
        live: dict[int, int] = {}
        t0 = time.perf_counter()
        for k, i, n in zip(kinds, ids, sizes):
            if k == 0:
                live[i] = n
            else:
                live.pop(i, None)
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / len(kinds)


def overhead_table(traces: list[Trace], device: str, rows: list[dict]) -> None:
    policies = list(POLICIES)
    print(f"\n## Overhead on {device} (peak reserved / peak live - 1)\n")
    print("| trace | ops | peak live GiB | " + " | ".join(policies) + " | best peer (H200) | gpumem <= peer | <= 1% |")
    print("|---" * (len(policies) + 6) + "|")
    for tr in traces:
        cells = []
        gp = None
        for pol in policies:
            res = replay_trace(tr, device, pol, progress=False)
            rows.append({"table": "overhead", **res.as_json()})
            cells.append(f"{res.overhead:.2%}" + (" OOM" if res.ooms else ""))
            if pol == "gpumem":
                gp = res
        peer = BEST_PEER.get(tr.name)
        assert gp is not None
        ok_peer = "n/a" if peer is None else ("yes" if gp.overhead <= peer else "NO")
        ok_goal = "yes" if gp.overhead <= 0.01 else "NO"
        print(f"| {tr.name} ({tr.source}) | {tr.n_ops:,} | {gp.peak_live_bytes / 2**30:.3f} | " + " | ".join(cells)
              + f" | {'' if peer is None else f'{peer:.1%}'} | {ok_peer} | {ok_goal} |")


def speed_table(traces: list[Trace], device: str, rows: list[dict]) -> None:
    print(f"\n## Time per operation on {device}, this machine, vs a bare Python loop (same run)\n")
    print("| trace | bare loop ns/op | gpumem ns/op | ratio | goal <= 10x | bestfit ns/op | ratio |")
    print("|---|---|---|---|---|---|---|")
    for tr in traces:
        bare = bare_loop_ns_per_op(tr)
        gp = min((replay_trace(tr, device, "gpumem", progress=False) for _ in range(2)), key=lambda r: r.ns_per_op)
        bf = min((replay_trace(tr, device, "bestfit", progress=False) for _ in range(2)), key=lambda r: r.ns_per_op)
        rows.append({"table": "speed", "trace": tr.name, "bare_ns_per_op": bare, "gpumem_ns_per_op": gp.ns_per_op,
                     "bestfit_ns_per_op": bf.ns_per_op, "gpumem_device_calls": gp.stats.device_calls})
        print(f"| {tr.name} | {bare:.0f} | {gp.ns_per_op:.0f} | {gp.ns_per_op / bare:.1f}x | "
              f"{'yes' if gp.ns_per_op <= 10 * bare else 'NO'} | {bf.ns_per_op:.0f} | {bf.ns_per_op / bare:.1f}x |")


def _time_ops(trace: Trace, alloc, free) -> float:
    kinds, ids, sizes, _ = trace.as_lists()
    ptrs: dict[int, object] = {}
    gc.disable()
    t0 = time.perf_counter()
    for k, i, n in zip(kinds, ids, sizes):
        if k == 0:
            ptrs[i] = alloc(n)
        else:
            p = ptrs.pop(i, None)
            if p is not None:
                free(p)
    dt = time.perf_counter() - t0
    gc.enable()
    for p in ptrs.values():
        free(p)
    return dt * 1e6 / len(kinds)


def cuda_table(traces: list[Trace], rows: list[dict], repeat: int) -> None:
    import cupy

    from gpumem.allocator import CachingAllocator
    from gpumem.specs import open_device

    runners: dict[str, object] = {}

    def gpumem_runner(policy):
        def run(tr):
            dev = open_device("cuda:0")
            a = CachingAllocator(dev, policy)
            us = _time_ops(tr, lambda n: a.allocate(n), a.free)
            st = a.snapshot_stats()
            a.close()
            dev.close()
            return us, st.overhead
        return run

    def cupy_run(tr):
        pool = cupy.cuda.MemoryPool()
        us = _time_ops(tr, pool.malloc, lambda p: None)  # dropping the MemoryPointer frees it
        pool.free_all_blocks()
        return us, None

    runners["gpumem"] = gpumem_runner("gpumem")
    runners["gpumem-bestfit"] = gpumem_runner("bestfit")
    runners["cupy-pool"] = cupy_run
    try:
        import torch

        def torch_run(tr):
            us = _time_ops(tr, torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete)
            torch.cuda.empty_cache()
            return us, None
        runners["pytorch"] = torch_run
    except ImportError:
        print("(PyTorch not installed: its column is skipped)")
    try:
        import rmm  # noqa: F401

        def rmm_run(tr):
            mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource())
            us = _time_ops(tr, mr.allocate, lambda p: None)
            return us, None
        runners["rmm-pool"] = rmm_run
    except ImportError:
        print("(rmm not installed: its column is skipped)")

    names = list(runners)
    print("\n## Cost per operation on cuda:0 (µs, median of runs, same process, same traces)\n")
    print("| trace | " + " | ".join(names) + " | gpumem / cupy-pool | gpumem overhead (real) |")
    print("|---" * (len(names) + 3) + "|")
    for tr in traces:
        med = {}
        over = None
        for name, run in runners.items():
            samples = []
            for _ in range(repeat):
                us, ov = run(tr)  # type: ignore[operator]
                samples.append(us)
                if name == "gpumem":
                    over = ov
            med[name] = statistics.median(samples)
        rows.append({"table": "cuda", "trace": tr.name, "us_per_op": med, "gpumem_overhead": over})
        print(f"| {tr.name} | " + " | ".join(f"{med[n]:.2f}" for n in names)
              + f" | {med['gpumem'] / med['cupy-pool']:.2f}x | {over:.2%} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=default_traces_dir(), help="folder of the shared traces")
    parser.add_argument("--device", default="sim:h200-141gb", help="simulated device for tables 1 and 2")
    parser.add_argument("--only", nargs="*", help="trace names to run (default: all)")
    parser.add_argument("--skip-sim", action="store_true", help="skip tables 1 and 2")
    parser.add_argument("--cuda", action="store_true", help="also run table 3 on cuda:0")
    parser.add_argument("--repeat", type=int, default=3, help="runs per allocator in table 3")
    parser.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    args = parser.parse_args()
    if not args.traces.is_dir():
        print(f"no traces folder at {args.traces}: pass --traces", file=sys.stderr)
        return 2
    traces = []
    for f in TRACE_FILES:
        path = args.traces / f
        if path.exists():
            tr = load_trace(path)
            if args.only and tr.name not in args.only:
                continue
            traces.append(tr)
    rows: list[dict] = []
    if not args.skip_sim:
        overhead_table(traces, args.device, rows)
        speed_table([t for t in traces if t.source != "rmm-log"], args.device, rows)
    if args.cuda:
        cuda_table([t for t in traces if t.source != "rmm-log"], rows, args.repeat)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
