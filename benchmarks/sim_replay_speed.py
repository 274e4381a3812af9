"""Host time per replayed operation on the simulated device, for each GPU timing, beside another revision.

``replay_bench.py`` times replays with ``gpu_timing="idle"``, where no SimPy event ever runs; this one
times every GPU timing (``idle``, ``trace``, ``model``), where the program's kernels run as SimPy
processes and the device's clock (:mod:`gpumem.sim.clock`) matters. With ``--base REV`` it extracts
that revision of the checkout (``git archive``) into a temporary folder and runs it in alternation with
this checkout, each round in fresh processes, so that the ratio is measured side by side on a shared,
noisy machine; it also checks that both revisions give the same figures (every field of the
:class:`~gpumem.replay.ReplayResult` but the wall time). The base revision runs with this checkout's
built native engine (copied in): revisions whose engine differs cannot be compared this way.

Run: ``python benchmarks/sim_replay_speed.py [--base REV] [--rounds 3] [--only NAME ...] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
GPU_TIMINGS = ("idle", "trace", "model")
#: Small traces with several streams and many operations (the project's data/traces).
DEFAULT_TRACES = ("multistream_infer_h200", "unet_train_h200", "moe_train_h200")

_CHILD = r'''
import dataclasses, json, sys, time
from pathlib import Path
from gpumem.replay import replay_trace
from gpumem.trace import load_trace
out = {}
timings, device, paths = sys.argv[1].split(","), sys.argv[2], sys.argv[3:]
for path in paths:
    trace = load_trace(path)
    for timing in timings:
        best_s = None
        for _ in range(2):
            t0 = time.perf_counter()
            res = replay_trace(trace, device, "gpumem", progress=False, gpu_timing=timing)
            best_s = min(best_s or float("inf"), time.perf_counter() - t0)
        fields = dataclasses.asdict(res)
        fields.pop("wall_s")
        out[f"{trace.name} {timing}"] = {"s": best_s, "ops": res.n_ops, "figures": repr(sorted(fields.items()))}
print(json.dumps(out))
'''


def _trace_paths(names: Sequence[str]) -> list[str]:
    folder = REPO / "data" / "traces"
    paths = []
    for name in names:
        found = sorted(p for p in folder.glob(f"{name}.*") if not p.name.endswith(".md"))
        if not found:
            raise SystemExit(f"sim_replay_speed: no trace named {name!r} in {folder}")
        paths.append(str(found[0]))
    return paths


def _extract(rev: str, into: Path) -> Path:
    """``rev`` of this checkout as plain files in ``into``, with this checkout's built native engine."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True)
    if archive.returncode:
        raise SystemExit(f"sim_replay_speed: git archive {rev}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for built in (REPO / "gpumem").glob("_engine*.so"):
        shutil.copy2(built, into / "gpumem" / built.name)
    return into


def _run(tree: Path, paths: list[str], device: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", _CHILD, ",".join(GPU_TIMINGS), device, *paths], cwd=tree,
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"sim_replay_speed: the replay in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a git revision to time beside this checkout")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best is kept (default 3)")
    parser.add_argument("--only", nargs="*", default=list(DEFAULT_TRACES), help="trace names (data/traces)")
    parser.add_argument("--device", default="sim:h200-141gb")
    parser.add_argument("--json", type=Path, help="also write the figures there")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    paths = _trace_paths(args.only)
    with tempfile.TemporaryDirectory(prefix="gpumem-base-") as tmp:
        trees = {"this": REPO}
        if args.base:
            trees = {"base": _extract(args.base, Path(tmp)), "this": REPO}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(_run(tree, paths, args.device))
    rows = []
    for key in runs["this"][0]:
        row = {"case": key, "ops": runs["this"][0][key]["ops"]}
        for name in trees:
            row[f"{name}_us_per_op"] = min(r[key]["s"] for r in runs[name]) / row["ops"] * 1e6
        if args.base:
            row["ratio"] = row["this_us_per_op"] / row["base_us_per_op"]
            row["same_figures"] = len({r[key]["figures"] for name in trees for r in runs[name]}) == 1
        rows.append(row)
    base = f" beside {args.base}" if args.base else ""
    print(f"Replay host time per operation on {args.device}{base} (best of {args.rounds} rounds x 2)")
    if args.base:
        print("| trace, gpu timing | ops | base µs/op | this µs/op | this/base | same figures |\n|---|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['case']} | {r['ops']:,} | {r['base_us_per_op']:.2f} | {r['this_us_per_op']:.2f} "
                  f"| {r['ratio']:.3f} | {'yes' if r['same_figures'] else 'NO'} |")
    else:
        print("| trace, gpu timing | ops | µs/op |\n|---|---:|---:|")
        for r in rows:
            print(f"| {r['case']} | {r['ops']:,} | {r['this_us_per_op']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("same_figures", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
