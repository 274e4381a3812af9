"""How large a PyTorch snapshot ``gpumem report`` handles, and how long it takes.

Builds a snapshot ``--copies`` times the size of a bundled one (its entries repeated, addresses and times
shifted so that every copy is a new stretch of the same program), then runs ``gpumem report`` on it in a
child process and prints a table: entries, operations, file size, wall time and the child's peak
resident memory.

    python benchmarks/report_scale.py --copies 1 2 4 --no-fit

Results on the 2-core, 24 GB development machine are in docs/reports.md.
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpumem.trace import load_snapshot_dict


def tiled_snapshot(src: Path, copies: int, dst: Path) -> tuple[int, int]:
    """Write ``src`` repeated ``copies`` times to ``dst``; returns (entries, allocs)."""
    data = load_snapshot_dict(src)
    entries = data["device_traces"][0]
    span_us = (max(e["time_us"] for e in entries) - min(e["time_us"] for e in entries)) + 1
    out = []
    for j in range(copies):
        shift = j << 44  # far above any real address: a new range for every copy
        for e in entries:
            f = dict(e)
            f["addr"] = e["addr"] + shift
            f["time_us"] = e["time_us"] + j * span_us
            out.append(f)
    with gzip.open(dst, "wb", compresslevel=3) as f:
        pickle.dump({"segments": [], "device_traces": [out]}, f, protocol=4)
    return len(out), sum(1 for e in out if e["action"] == "alloc")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="data/traces/llama_generate.trace.pickle.gz")
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-fit", action="store_true", help="pass --no-fit to gpumem report")
    parser.add_argument("--policy", action="append", help="policies (default: all)")
    args = parser.parse_args()
    print(f"{'copies':>6} {'entries':>10} {'allocs':>9} {'file MiB':>9} {'report s':>9} {'peak RSS GiB':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.copies:
            snap = Path(tmp) / f"x{k}.pickle.gz"
            n_entries, n_allocs = tiled_snapshot(Path(args.trace), k, snap)
            cmd = [sys.executable, "-m", "gpumem", "report", str(snap), "--out", str(Path(tmp) / f"r{k}"),
                   "--json"]
            cmd += ["--no-fit"] if args.no_fit else []
            for p in args.policy or ["all"]:
                cmd += ["--policy", p]
            t0 = time.perf_counter()
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            if proc.returncode != 0:
                print(f"copies {k}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
                return 1
            peak = max(rss, before) / (1 << 20)  # ru_maxrss is in KiB on Linux
            print(f"{k:>6} {n_entries:>10,} {n_allocs:>9,} {os.path.getsize(snap) / (1 << 20):>9.1f} {wall:>9.1f} "
                  f"{peak:>13.2f}", flush=True)
            os.unlink(snap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
