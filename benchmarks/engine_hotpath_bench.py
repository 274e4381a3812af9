"""The native engine's cost per operation on every corpus trace, as CuPy's hook calls it, on this machine
(no GPU, no CuPy, no Python in the loop): the local yardstick for issue 19's "at or below CuPy's pool".

Compiles ``benchmarks/engine_hotpath_bench.cpp`` with the engine's sources (``gpumem/_native/engine.cpp``)
into ``build/``, writes each trace of ``data/traces`` as a binary op list there, and replays it through the
engine over an in-memory fake of the driver's VMM calls: one growth pass, then ``--passes`` timed passes.
The table gives the median ns per op (allocations and frees), the device calls of the last pass (0 in a
steady state that repeats) and the memory held (peak reserved).

Usage::

    python benchmarks/engine_hotpath_bench.py [--traces DIR] [--passes 5] [--page-slack F] [--two-calls]

``--two-calls``: the size read by a second engine call (``block_size``), as the hook did before it came
with the pointer. Exit status: 0 done; 2 bad input (no traces, no C++ compiler).
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from gpumem.progress import progress
from gpumem.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "engine_hotpath_bench.cpp"
ENGINE = ROOT / "gpumem" / "_native" / "engine.cpp"


def build(out: Path, two_calls: bool) -> Path:
    """Compiles the benchmark (``-O2``, as setup.py builds the engine); returns the executable."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    exe = out / ("engine_hotpath_bench_two_calls" if two_calls else "engine_hotpath_bench")
    cmd = [cxx, "-std=c++17", "-O2", "-o", str(exe), str(SOURCE), str(ENGINE), "-pthread"]
    if two_calls:
        cmd.insert(1, "-DGPUMEM_BENCH_TWO_CALLS")
    subprocess.run(cmd, check=True)
    return exe


def write_ops(trace_path: Path, out: Path) -> Path:
    """The trace as the benchmark reads it: allocation ids as dense slots, size-0 allocations dropped
    (CuPy's hook gives them no memory), frees of unknown ids kept (the replay skips them)."""
    kinds, ids, sizes, _ = load_trace(trace_path).as_lists()
    slots: dict[int, int] = {}
    rows = []
    for k, i, n in zip(kinds, ids, sizes):
        if k == 0 and not n:
            continue
        slot = slots.setdefault(i, len(slots))
        rows.append(struct.pack("<BIQ", k, slot, n if k == 0 else 0))
    path = out / (trace_path.name.removesuffix(".gz") + ".ops")
    path.write_bytes(struct.pack("<Q", len(rows)) + b"".join(rows))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=ROOT / "data" / "traces")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--page-slack", type=float, help="the engine's page_slack (default: the engine's default)")
    ap.add_argument("--two-calls", action="store_true", help="read the size with block_size (the old hook)")
    args = ap.parse_args(argv)
    paths = sorted(p for p in args.traces.glob("*.gz")) if args.traces.is_dir() else []
    if not paths or args.passes < 1:
        print(f"no traces in {args.traces}, or --passes < 1", file=sys.stderr)
        return 2
    out = ROOT / "build" / "engine_hotpath_bench"
    out.mkdir(parents=True, exist_ok=True)
    try:
        exe = build(out, args.two_calls)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"cannot build the benchmark: {exc}", file=sys.stderr)
        return 2
    print("| trace | ops | ns/op | device calls per pass | peak reserved MiB | reserved after MiB |\n|---|---|---|---|---|---|")
    with progress(len(paths), desc="traces", unit="trace") as bar:
        for p in paths:
            ops = write_ops(p, out)
            cmd = [str(exe), str(ops), str(args.passes)] + ([str(args.page_slack)] if args.page_slack is not None else [])
            ns, calls, peak, after = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
            n_ops = struct.unpack("<Q", ops.read_bytes()[:8])[0]
            print(f"| {p.name.removesuffix('.gz')} | {n_ops} | {float(ns):.1f} | {calls} | {int(peak) / 2**20:.0f} | "
                  f"{int(after) / 2**20:.0f} |", flush=True)
            bar.update()
    return 0


if __name__ == "__main__":
    sys.exit(main())
