"""The Python and the native engine side by side in segment mode (``malloc``'d segments: ``pytorch``, ``bestfit``):
microseconds per allocator call over the same ops, in one run::

    python -m benchmarks.segment_engine_bench [--traces DIR] [--policies pytorch,bestfit] [--new-tokens 100]
                                              [--repeat 3] [--limit N]

Workloads: the 7B Llama-style ``generate()`` of ``gpumem estimate`` (prompt 2048, ``--new-tokens``, full decode:
every step's ops, as ``gpumem estimate``'s full replay sends them) and each trace of ``--traces`` (default
``data/traces``; ``--limit``: the first N). Each workload is replayed on a fresh simulated H200 per engine and
policy by one plain Python loop calling ``allocate``/``free`` (the loop's own cost is in both columns); the time
is CPU seconds of this process (``time.process_time``, which other jobs on a shared machine disturb less than
wall time), the best of ``--repeat`` runs, divided by the calls made. ``same``: both engines returned the same
pointers and ended with the same stats (Note [An exact port] in ``gpumem/_native/engine.h``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import OutOfMemoryError

ROOT = Path(__file__).resolve().parents[1]


def _workloads(args: argparse.Namespace) -> list[tuple[str, list[int], list[int], list[int], list[int]]]:
    """(name, kinds, ids, nbytes, streams) of every workload."""
    from gpumem.estimate import ModelShape, inference_trace

    out = []
    if args.new_tokens > 0:
        shape = ModelShape(4096, 11008, 32, 32000, 32, 32)
        w = inference_trace(shape, 2, prompt_len=2048, new_tokens=args.new_tokens, full_decode=True)
        out.append((f"7B generate n={args.new_tokens}", *w.trace.as_lists()))
    tdir = Path(args.traces)
    if tdir.is_dir():
        from gpumem.trace import load_trace

        names = sorted(f for f in os.listdir(tdir) if not f.endswith(".md"))
        for name in names[:args.limit] if args.limit is not None else names:
            out.append((name.removesuffix(".gz").removesuffix(".pickle"), *load_trace(tdir / name).as_lists()))
    return out


def _replay(policy: str, engine: str, ops: tuple[list[int], list[int], list[int], list[int]]) -> tuple[float, int, list, dict]:
    """CPU seconds, calls made, the pointers returned and the final stats of one replay."""
    kinds, ids, sizes, streams = ops
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(dev, policy, engine=engine)
    allocate, free = alloc.allocate, alloc.free
    ptrs: dict[int, int] = {}
    returned: list = []
    calls = 0
    t0 = time.process_time()
    for k, i, n, s in zip(kinds, ids, sizes, streams):
        if k == 0:
            if n:
                calls += 1
                try:
                    p = ptrs[i] = allocate(n, s)
                except OutOfMemoryError:
                    p = None
                returned.append(p)
        else:
            p = ptrs.pop(i, 0)
            if p:
                calls += 1
                free(p)
    elapsed = time.process_time() - t0
    stats = alloc.snapshot_stats().as_dict()
    alloc.close()
    dev.close()
    return elapsed, calls, returned, stats


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.segment_engine_bench",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--traces", default=str(ROOT / "data" / "traces"), help="folder of traces (default data/traces)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N traces")
    ap.add_argument("--policies", default="pytorch,bestfit", help="comma-separated segment policies")
    ap.add_argument("--new-tokens", type=int, default=100, help="new tokens of the 7B generate() workload (0: none)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the best is kept (default 3)")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    print(f"segment mode, Python vs native engine, sim:h200-141gb; {platform.python_implementation()} "
          f"{platform.python_version()}; us per allocate/free call (CPU time, best of {args.repeat})")
    print(f"{'workload':<40} {'policy':<8} {'calls':>9} {'python us':>10} {'native us':>10} {'speedup':>8} {'same':>5}")
    for name, *ops in _workloads(args):
        for policy in policies:
            best: dict[str, float] = {}
            results = {}
            for engine in ("python", "native"):
                for _ in range(args.repeat):
                    t, calls, returned, stats = _replay(policy, engine, tuple(ops))
                    best[engine] = min(best.get(engine, t), t)
                    results[engine] = (returned, stats)
            same = results["python"] == results["native"]
            py_us, nat_us = best["python"] / calls * 1e6, best["native"] / calls * 1e6
            print(f"{name[:40]:<40} {policy:<8} {calls:>9} {py_us:>10.3f} {nat_us:>10.3f} "
                  f"{py_us / nat_us if nat_us else float('inf'):>7.1f}x {'yes' if same else 'NO':>5}", flush=True)


if __name__ == "__main__":
    main()
