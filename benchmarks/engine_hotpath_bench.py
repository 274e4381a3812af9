"""The native engine's cost per operation on every corpus trace, as CuPy's hook calls it, on this machine
(no GPU, no CuPy, no Python in the loop): the local yardstick for issue 19's "at or below CuPy's pool".

Compiles ``benchmarks/engine_hotpath_bench.cpp`` with the engine's sources (``gpumem/_native/engine.cpp``)
into ``build/``, writes each trace of ``data/traces`` as a binary op list there, and replays it through the
engine over an in-memory fake of the driver's VMM calls: one growth pass, then ``--passes`` timed passes.
The table gives the median ns per op (allocations and frees), the device calls of the last pass (0 in a
steady state that repeats) and the memory held (peak reserved).

Usage::

    python benchmarks/engine_hotpath_bench.py [--traces DIR] [--passes 5] [--page-slack F] [--two-calls]
                                              [--instructions [--against REV]] [--expandable]

``--two-calls``: the size read by a second engine call (``block_size``), as the hook did before it came
with the pointer. ``--instructions``: instructions per op in a steady state instead of time, counted by
callgrind (valgrind), the same on a loaded machine as on an idle one: a run of one growth pass and one
timed pass, and a run with three timed passes; the difference over two passes. ``--against REV``: the
engine of git revision REV (``engine.cpp``/``engine.h``/``backend.h`` from ``git show``) counted too,
side by side, with its device calls and memory (same decisions: they must match). ``--expandable``: the
engine under the ``expandable`` policy (pages of 2 / 20 MiB, growth by pages, no steal). Exit status: 0 done;
2 bad input (no traces, no C++ compiler, no valgrind or git where asked).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
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


def build(out: Path, two_calls: bool, root: Path = ROOT, name: str = "engine_hotpath_bench",
          expandable: bool = False) -> Path:
    """Compiles the benchmark (``-O3``, as setup.py builds the engine) against the engine under ``root``
    (``expandable``: under that policy, pages of 2 / 20 MiB); returns the executable."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    exe = out / (name + ("_two_calls" if two_calls else "") + ("_expandable" if expandable else ""))
    cmd = [cxx, "-std=c++17", "-O3", "-o", str(exe), str(root / SOURCE.relative_to(ROOT)),
           str(root / ENGINE.relative_to(ROOT)), "-pthread"]
    if two_calls:
        cmd.insert(1, "-DGPUMEM_BENCH_TWO_CALLS")
    if expandable:
        cmd.insert(1, "-DGPUMEM_BENCH_EXPANDABLE")
    subprocess.run(cmd, check=True)
    return exe


def checkout_engine(rev: str, out: Path) -> Path:
    """The engine's sources at git revision ``rev`` beside this benchmark's C++ (a tree under ``out``)."""
    root = out / f"rev-{re.sub(r'[^A-Za-z0-9_.-]', '_', rev)}"
    (root / "gpumem" / "_native").mkdir(parents=True, exist_ok=True)
    (root / "benchmarks").mkdir(parents=True, exist_ok=True)
    for name in ("engine.cpp", "engine.h", "backend.h"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:gpumem/_native/{name}"], check=True,
                              capture_output=True).stdout
        (root / "gpumem" / "_native" / name).write_bytes(text)
    shutil.copy(SOURCE, root / "benchmarks" / SOURCE.name)
    return root


@dataclasses.dataclass(frozen=True)
class Count:
    """One engine on one trace, under callgrind."""

    instructions_per_op: float   # steady state
    device_calls: int            # in the last pass
    peak_reserved_nbytes: int
    peak_allocated_nbytes: int   # live blocks at their peak: reserved above it is held above live


def count_instructions(exe: Path, ops: Path, n_ops: int, slack: list[str]) -> Count:
    """Instructions per op in a steady state: (three timed passes - one) / two passes."""
    def run(passes: int) -> tuple[int, list[str]]:
        done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(exe), str(ops),
                               str(passes)] + slack, check=True, capture_output=True, text=True)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise RuntimeError(f"callgrind printed no count: {done.stderr[-500:]}")
        return int(found.group(1)), done.stdout.split()

    one, _ = run(1)
    three, out = run(3)
    return Count((three - one) / 2 / max(n_ops, 1), int(out[1]), int(out[2]), int(out[4]))


def instructions_table(paths: list[Path], out: Path, exe: Path, base: Path | None, slack: list[str],
                       against: str | None) -> None:
    """Prints instructions per op (and, with a baseline, its figures and the ratio) per trace."""
    def above(c: Count) -> str:
        return f"{(c.peak_reserved_nbytes - c.peak_allocated_nbytes) / 2**20:.0f}"

    if base is None:
        print("| trace | ops | instructions per op | device calls per pass | peak reserved MiB | held above live MiB |\n"
              "|---|---|---|---|---|---|")
    else:
        print(f"| trace | ops | instructions per op: {against}, this tree, ratio | device calls per pass | "
              "peak reserved MiB | held above live MiB | same decisions |\n|---|---|---|---|---|---|---|")
    with progress(len(paths), desc="traces", unit="trace") as bar:
        for p in paths:
            ops = write_ops(p, out)
            n_ops = struct.unpack("<Q", ops.read_bytes()[:8])[0]
            new = count_instructions(exe, ops, n_ops, slack)
            name = p.name.removesuffix(".gz")
            if base is None:
                print(f"| {name} | {n_ops} | {new.instructions_per_op:.0f} | {new.device_calls} | "
                      f"{new.peak_reserved_nbytes / 2**20:.0f} | {above(new)} |", flush=True)
            else:
                old = count_instructions(base, ops, n_ops, slack)
                same = dataclasses.replace(old, instructions_per_op=0) == dataclasses.replace(new, instructions_per_op=0)
                print(f"| {name} | {n_ops} | {old.instructions_per_op:.0f}, {new.instructions_per_op:.0f}, "
                      f"{new.instructions_per_op / old.instructions_per_op:.2f} | {new.device_calls} | "
                      f"{new.peak_reserved_nbytes / 2**20:.0f} | {above(new)} | {'yes' if same else 'NO: ' + repr(old)} |",
                      flush=True)
            bar.update()


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
    ap.add_argument("--traces", type=Path, default=ROOT / "data" / "traces",
                    help="folder of traces (default: data/traces)")
    ap.add_argument("--passes", type=int, default=5,
                    help="passes over each trace; the later ones are steady state (default 5)")
    ap.add_argument("--page-slack", type=float, help="the engine's page_slack (default: the engine's default)")
    ap.add_argument("--two-calls", action="store_true", help="read the size with block_size (the old hook)")
    ap.add_argument("--instructions", action="store_true", help="count instructions per op (callgrind) instead of time")
    ap.add_argument("--against", metavar="REV", help="with --instructions: also the engine of git revision REV")
    ap.add_argument("--expandable", action="store_true",
                    help="the expandable policy (pages of 2 / 20 MiB) instead of the engine's defaults")
    args = ap.parse_args(argv)
    paths = sorted(p for p in args.traces.glob("*.gz")) if args.traces.is_dir() else []
    if not paths or args.passes < 1:
        print(f"no traces in {args.traces}, or --passes < 1", file=sys.stderr)
        return 2
    if args.against and not args.instructions:
        print("--against needs --instructions", file=sys.stderr)
        return 2
    if args.instructions and shutil.which("valgrind") is None:
        print("--instructions needs valgrind on PATH", file=sys.stderr)
        return 2
    out = ROOT / "build" / "engine_hotpath_bench"
    out.mkdir(parents=True, exist_ok=True)
    try:
        exe = build(out, args.two_calls, expandable=args.expandable)
        base = build(out, args.two_calls, checkout_engine(args.against, out), "engine_hotpath_bench_base",
                     args.expandable) if args.against else None
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"cannot build the benchmark: {exc}", file=sys.stderr)
        return 2
    slack = [str(args.page_slack)] if args.page_slack is not None else []
    if args.instructions:
        instructions_table(paths, out, exe, base, slack, args.against)
        return 0
    print("| trace | ops | ns/op | device calls per pass | peak reserved MiB | reserved after MiB |\n|---|---|---|---|---|---|")
    with progress(len(paths), desc="traces", unit="trace") as bar:
        for p in paths:
            ops = write_ops(p, out)
            cmd = [str(exe), str(ops), str(args.passes)] + ([str(args.page_slack)] if args.page_slack is not None else [])
            ns, calls, peak, after, _peak_allocated = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
            n_ops = struct.unpack("<Q", ops.read_bytes()[:8])[0]
            print(f"| {p.name.removesuffix('.gz')} | {n_ops} | {float(ns):.1f} | {calls} | {int(peak) / 2**20:.0f} | "
                  f"{int(after) / 2**20:.0f} |", flush=True)
            bar.update()
    return 0


if __name__ == "__main__":
    sys.exit(main())
