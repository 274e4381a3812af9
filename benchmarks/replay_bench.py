"""Replay real traces and print how gpumem compares with its peers.

Three tables, each measured side by side in one run (the machines are shared and noisy,
so only ratios within a run mean anything):

1. **Overhead** (peak reserved / peak live - 1) of every policy on every trace on a
   simulated device (default ``sim:h200-141gb``), beside the best peer measured on the
   real H200 (:data:`BEST_PEER`). Target: gpumem at most the best peer on every trace;
   goal: at most 1 %. Replayed with the GPU idle (``gpu_timing="idle"``: no GPU work runs
   beside the replay, every freed block is reusable at once), so its figures are those of
   ``gpumem replay TRACE --gpu-timing idle``; ``gpumem replay``'s default on a simulated
   device, ``--gpu-timing trace`` (GPU time from the trace's clock), gives higher overheads
   on traces whose frees wait for queued work (docs/allocator.md has both columns).
2. **Time per operation** of the gpumem allocator on the simulated device (GPU idle too), as a ratio to
   a bare Python loop over the same operations (a dict insert per alloc, a dict pop per
   free). Goal: at most 10x.
3. With ``--cuda``: on a real GPU, wall time per operation of gpumem on ``cuda:0``
   beside CuPy's MemoryPool and PyTorch's caching allocator (and RMM's pool if rmm is
   installed) on the same traces. Goal: at or below CuPy's pool. Two gpumem columns:
   ``gpumem`` (a ``CachingAllocator`` over the CuPy-based device adapter: the engine's
   device calls go through Python) and ``gpumem-native`` (``gpumem._engine.CudaAllocator``:
   the native engine calling the CUDA driver itself, as under PyTorch).

The traces are every trace file in ``--traces DIR`` (default: the project's
``data/traces``): PyTorch snapshots (``.pickle``, ``.pkl``), RMM logs (``.csv``) and
gpumem traces (``.gmt``), each possibly gzipped. A folder that is missing, holds no
trace file or only unreadable ones is an error (exit 2).

Each peer allocator (each gpumem policy; on a GPU, CuPy's pool, PyTorch and RMM) runs
in its own process, so that one that fails (RMM's out-of-memory, a crash) is reported
as failed in its cells, and memory one peer holds never shrinks what the next one gets.

Exit status: 0 every table complete (peers other than gpumem may have failed: see the
notes under the tables); 1 gpumem itself failed on some trace; 2 bad input (no traces,
unreadable traces, bad options).

Usage::

    python benchmarks/replay_bench.py [--traces DIR] [--device SPEC] [--cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gpumem.trace.corpus import CHECK, TUNING

REPO = Path(__file__).resolve().parents[1]

#: Best peer overhead on the H200 (PyTorch with expandable segments), by trace name.
BEST_PEER = {"gpt2_train": 0.069, "resnet_train": 0.006, "llama_generate": 0.053, "bert_varlen": 0.012}
#: CuPy MemoryPool cost per op on the H200, microseconds.
CUPY_US = {"gpt2_train": 0.81, "resnet_train": 1.41, "llama_generate": 0.55, "bert_varlen": 0.89}
#: The project's traces, in the order of docs/allocator.md's tables; other files in a folder follow, by name.
#: The five of those tables first, then the rest of the corpus (gpumem.trace.corpus: tuning, then check).
_README_TRACES = ("gpt2_train.snapshot.pickle.gz", "resnet_train.snapshot.pickle.gz", "bert_varlen.trace.pickle.gz",
                  "llama_generate.trace.pickle.gz", "resnet_train.rmm_log.csv.gz")
TRACE_FILES = _README_TRACES + tuple(n for n in TUNING + CHECK if n not in _README_TRACES)
#: File name endings of trace files (each also with ``.gz``).
TRACE_SUFFIXES = (".pickle", ".pkl", ".csv", ".gmt")
#: The policies of table 1, in column order (each in its own process).
SIM_POLICIES = ("gpumem", "bestfit", "pytorch", "cupy")
#: The allocators of table 3, in column order (each in its own process).
CUDA_PEERS = ("gpumem", "gpumem-native", "gpumem-bestfit", "cupy-pool", "pytorch", "rmm-pool")
#: How long one peer's process may run (all traces), seconds.
DEFAULT_PEER_TIMEOUT_S = 4 * 3600


class BenchInputError(Exception):
    """Bad input to the benchmark: exit 2 with this message."""


def default_traces_dir() -> Path:
    """The traces that ship with the project."""
    return REPO / "data" / "traces"


def _is_trace_name(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return bool(suffixes) and suffixes[-1] in TRACE_SUFFIXES


def find_trace_files(folder: Path) -> list[Path]:
    """Every trace file in ``folder`` (not recursive): the project's names first, in table order, then the
    others by name. Raises :class:`BenchInputError` for a missing or unreadable folder or one without traces."""
    if not folder.is_dir():
        raise BenchInputError(f"--traces: no such folder: {folder}")
    try:
        entries = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError as exc:
        raise BenchInputError(f"--traces: cannot list {folder}: {exc.strerror or exc}") from None
    files = [p for p in entries if _is_trace_name(p)]
    if not files:
        seen = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise BenchInputError(f"--traces: no trace file in {folder} (looked for "
                              + ", ".join(f"*{s}[.gz]" for s in TRACE_SUFFIXES) + (f"; found {seen}" if seen else "")
                              + ")")
    order = {name: i for i, name in enumerate(TRACE_FILES)}
    return sorted(files, key=lambda p: (order.get(p.name, len(order)), p.name))


# -- workers: one process per peer allocator -----------------------------------------------------------------
def _time_ops(trace: Any, alloc: Callable[[int], Any], free: Callable[[Any], None]) -> float:
    """Microseconds per op of replaying ``trace`` through ``alloc``/``free`` (garbage collector paused)."""
    if str(REPO) not in sys.path:  # the HIL tooling (hil/) is imported from the checkout's root
        sys.path.append(str(REPO))
    from hil.peers import _time_ops as time_lists

    kinds, ids, sizes, _ = trace.as_lists()
    return time_lists(kinds, ids, sizes, alloc, free)


def _cuda_runner(peer: str) -> Callable[[Any], tuple[float, float | None]]:
    """A function ``trace -> (µs per op, overhead or None)`` for one table-3 allocator; ImportError if missing."""
    if peer in ("gpumem", "gpumem-bestfit"):
        from gpumem.allocator import CachingAllocator
        from gpumem.specs import open_device

        policy = "gpumem" if peer == "gpumem" else "bestfit"

        def run_gpumem(tr: Any) -> tuple[float, float | None]:
            dev = open_device("cuda:0")
            try:
                a = CachingAllocator(dev, policy)
                try:
                    us = _time_ops(tr, a.allocate, a.free)
                    return us, a.snapshot_stats().overhead
                finally:
                    a.close()
            finally:
                dev.close()
        return run_gpumem
    if peer == "gpumem-native":
        # the native engine over the CUDA driver (gpumem._engine.CudaAllocator): no Python device calls
        from gpumem.native import native_module

        try:
            engine_mod = native_module()
        except Exception as exc:  # noqa: BLE001 - reported as this peer being unavailable
            raise ImportError(str(exc)) from exc

        def run_native(tr: Any) -> tuple[float, float | None]:
            a = engine_mod.CudaAllocator(0)
            us = _time_ops(tr, a.allocate, a.free)
            a.empty_cache()
            return us, None
        return run_native
    if peer == "cupy-pool":
        import cupy

        def run_cupy(tr: Any) -> tuple[float, float | None]:
            pool = cupy.cuda.MemoryPool()
            us = _time_ops(tr, pool.malloc, lambda p: None)  # dropping the MemoryPointer frees it
            pool.free_all_blocks()
            return us, None
        return run_cupy
    if peer == "pytorch":
        import torch

        def run_torch(tr: Any) -> tuple[float, float | None]:
            us = _time_ops(tr, torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete)
            torch.cuda.empty_cache()
            return us, None
        return run_torch
    if peer == "rmm-pool":
        import rmm

        def run_rmm(tr: Any) -> tuple[float, float | None]:
            mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource())
            us = _time_ops(tr, lambda n: (mr.allocate(n), n), lambda p: mr.deallocate(p[0], p[1]))
            del mr
            return us, None
        return run_rmm
    raise ValueError(f"unknown peer {peer!r}")


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def worker(task: dict[str, Any]) -> int:
    """Run one peer allocator over every trace of ``task``, one JSON line per trace on stdout."""
    from gpumem.trace import load_trace

    kind = task["kind"]
    runner: Callable[[Any], dict[str, Any]]
    if kind == "sim":
        from gpumem.replay import replay_trace

        def sim_run(tr: Any) -> dict[str, Any]:
            res = replay_trace(tr, task["device"], task["policy"], progress=False, gpu_timing="idle")
            out = res.as_json()
            best = res.ns_per_op
            if tr.source != "rmm-log":
                for _ in range(int(task.get("timing_repeat", 0))):
                    best = min(best, replay_trace(tr, task["device"], task["policy"], progress=False, gpu_timing="idle").ns_per_op)
            out["best_ns_per_op"] = best
            return out
        runner = sim_run
    elif kind == "cuda":
        try:
            run = _cuda_runner(task["peer"])
        except ImportError as exc:
            _emit({"unavailable": f"{type(exc).__name__}: {exc}"})
            return 0

        def cuda_run(tr: Any) -> dict[str, Any]:
            samples, over = [], None
            for _ in range(int(task.get("repeat", 3))):
                us, ov = run(tr)
                samples.append(us)
                over = ov if ov is not None else over
            return {"us_per_op": statistics.median(samples), "overhead": over}
        runner = cuda_run
    else:
        raise ValueError(f"unknown worker kind {kind!r}")
    for path in task["traces"]:
        try:
            _emit({"trace": path, "result": runner(load_trace(path))})
        except Exception as exc:  # noqa: BLE001 - reported as this peer's failure on this trace
            _emit({"trace": path, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return 0


def run_peer(task: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``task`` in a fresh Python process; returns ``{"results": {path: dict}, "errors": {path: str},
    "unavailable": reason or None}``. A crash, a kill or a timeout fails the traces it had not finished."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    unavailable = None
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(task)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, stderr, ended = proc.stdout, proc.stderr, f"the process exited with status {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ended = f"timed out after {timeout_s:g} s"
    for line in stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if "unavailable" in rec:
            unavailable = str(rec["unavailable"])
        elif "result" in rec:
            results[rec["trace"]] = rec["result"]
        elif "error" in rec:
            errors[rec["trace"]] = str(rec["error"])
    if unavailable is None:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
        for path in task["traces"]:
            if path not in results and path not in errors:
                errors[path] = ended + (f": {tail[0][:300]}" if tail else "")
    return {"results": results, "errors": errors, "unavailable": unavailable}


# -- tables ----------------------------------------------------------------------------------------------------
def bare_loop_ns_per_op(trace: Any, repeat: int = 3) -> float:
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
    return best * 1e9 / max(len(kinds), 1)


def _failure_notes(failures: list[tuple[str, str, str]]) -> None:
    if failures:
        print()
        for peer, trace, error in failures:
            print(f"- {peer} failed on {trace}: {error}")


def sim_tables(traces: list[tuple[Path, Any]], device: str, rows: list[dict], timeout_s: float) -> bool:
    """Tables 1 and 2; returns whether gpumem completed every trace."""
    paths = [str(p) for p, _ in traces]
    by_policy = {}
    for policy in SIM_POLICIES:
        timing = 1 if policy in ("gpumem", "bestfit") else 0
        by_policy[policy] = run_peer({"kind": "sim", "policy": policy, "device": device, "traces": paths,
                                      "timing_repeat": timing}, timeout_s)

    def result_of(policy: str, path: Path) -> dict[str, Any] | None:
        return by_policy[policy]["results"].get(str(path)) if policy in by_policy else None

    failures: list[tuple[str, str, str]] = []
    gpumem_ok = True
    print(f"\n## Overhead on {device} (peak reserved / peak live - 1)\n")
    print("| trace | ops | peak live GiB | " + " | ".join(SIM_POLICIES)
          + " | best peer (H200) | gpumem <= peer | <= 1% |")
    print("|---" * (len(SIM_POLICIES) + 6) + "|")
    for path, tr in traces:
        cells = []
        for policy in SIM_POLICIES:
            res = by_policy[policy]["results"].get(str(path))
            if res is None:
                error = by_policy[policy]["errors"].get(str(path), "no result")
                failures.append((policy, tr.name, error))
                rows.append({"table": "overhead", "trace": tr.name, "policy": policy, "failed": error})
                cells.append("failed")
                continue
            rows.append({"table": "overhead", **res})
            cells.append(f"{res['overhead']:.2%}" + (" OOM" if res["ooms"] else ""))
        gp = result_of("gpumem", path)
        gpumem_ok &= gp is not None
        peer = BEST_PEER.get(tr.name)
        ok_peer = "n/a" if peer is None or gp is None else ("yes" if gp["overhead"] <= peer else "NO")
        ok_goal = "n/a" if gp is None else ("yes" if gp["overhead"] <= 0.01 else "NO")
        peak = f"{tr.peak_live_nbytes / 2**30:.3f}"
        print(f"| {tr.name} ({tr.source}) | {tr.n_ops:,} | {peak} | " + " | ".join(cells)
              + f" | {'' if peer is None else f'{peer:.1%}'} | {ok_peer} | {ok_goal} |")
    _failure_notes(failures)

    print(f"\n## Time per operation on {device}, this machine, vs a bare Python loop (same run)\n")
    print("| trace | bare loop ns/op | gpumem ns/op | ratio | goal <= 10x | bestfit ns/op | ratio |")
    print("|---|---|---|---|---|---|---|")
    for path, tr in traces:
        if tr.source == "rmm-log":
            continue
        bare = bare_loop_ns_per_op(tr)
        gp = result_of("gpumem", path)
        bf = result_of("bestfit", path)
        gp_ns = gp["best_ns_per_op"] if gp else None
        bf_ns = bf["best_ns_per_op"] if bf else None
        rows.append({"table": "speed", "trace": tr.name, "bare_ns_per_op": bare, "gpumem_ns_per_op": gp_ns,
                     "bestfit_ns_per_op": bf_ns, "gpumem_device_calls": gp["device_calls"] if gp else None})
        gp_cells = (f"{gp_ns:.0f} | {gp_ns / bare:.1f}x | {'yes' if gp_ns <= 10 * bare else 'NO'}" if gp_ns
                    else "failed | | n/a")
        bf_cells = f"{bf_ns:.0f} | {bf_ns / bare:.1f}x" if bf_ns else "failed |"
        print(f"| {tr.name} | {bare:.0f} | {gp_cells} | {bf_cells} |")
    return gpumem_ok


def cuda_table(traces: list[tuple[Path, Any]], rows: list[dict], repeat: int, timeout_s: float) -> bool:
    """Table 3; returns whether gpumem completed every trace."""
    paths = [str(p) for p, _ in traces]
    runs = {peer: run_peer({"kind": "cuda", "peer": peer, "traces": paths, "repeat": repeat}, timeout_s)
            for peer in CUDA_PEERS}
    for peer, run in runs.items():
        if run["unavailable"]:
            print(f"({peer} is not installed: its column is skipped: {run['unavailable']})")
    names = [p for p in CUDA_PEERS if not runs[p]["unavailable"]]
    failures: list[tuple[str, str, str]] = []
    gpumem_ok = True
    print("\n## Cost per operation on cuda:0 (µs, median of runs, one process per allocator, same traces)\n")
    print("| trace | " + " | ".join(names) + " | gpumem / cupy-pool | gpumem-native / cupy-pool "
          "| gpumem overhead (real) |")
    print("|---" * (len(names) + 4) + "|")
    for path, tr in traces:
        us: dict[str, float | None] = {}
        for peer in names:
            res = runs[peer]["results"].get(str(path))
            if res is None:
                failures.append((peer, tr.name, runs[peer]["errors"].get(str(path), "no result")))
            us[peer] = res["us_per_op"] if res else None
        gp = runs["gpumem"]["results"].get(str(path)) if "gpumem" in names else None
        gpumem_ok &= gp is not None
        over = gp["overhead"] if gp else None
        rows.append({"table": "cuda", "trace": tr.name, "us_per_op": us, "gpumem_overhead": over,
                     "failed": {p: e for p, t, e in failures if t == tr.name}})
        ratios = [f"{us[p] / us['cupy-pool']:.2f}x" if us.get(p) and us.get("cupy-pool") else "n/a"
                  for p in ("gpumem", "gpumem-native")]
        print(f"| {tr.name} | " + " | ".join("failed" if us[n] is None else f"{us[n]:.2f}" for n in names)
              + f" | {ratios[0]} | {ratios[1]} | {'n/a' if over is None else f'{over:.2%}'} |")
    _failure_notes(failures)
    return gpumem_ok


def plain_text(doc: str) -> str:
    """The module docstring as plain text for ``--help``: no reStructuredText/Sphinx markup
    (``**bold**``, ``:data:`NAME```, double backquotes, ``Usage::``)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)  # :data:`BEST_PEER` -> BEST_PEER
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)  # **Overhead** -> Overhead
    text = re.sub(r"``([^`]+)``", r"\1", text)  # ``--traces`` -> --traces
    text = re.sub(r"::$", ":", text, flags=re.MULTILINE)  # Usage:: -> Usage:
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain_text(__doc__ or ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=default_traces_dir(),
                        help="folder whose trace files to replay (default: the project's data/traces)")
    parser.add_argument("--device", default="sim:h200-141gb", help="simulated device for tables 1 and 2")
    parser.add_argument("--only", nargs="*", help="trace names to run (default: all)")
    parser.add_argument("--skip-sim", action="store_true", help="skip tables 1 and 2")
    parser.add_argument("--cuda", action="store_true", help="also run table 3 on cuda:0")
    parser.add_argument("--repeat", type=int, default=3, help="runs per allocator in table 3")
    parser.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT_S, metavar="SECONDS",
                        help="how long one peer allocator's process may run over all traces (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one peer's process
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    from gpumem.errors import TraceFormatError
    from gpumem.trace import load_trace

    try:
        if args.repeat < 1:
            raise BenchInputError("--repeat must be at least 1")
        if args.json is not None and not (args.json.parent if str(args.json.parent) else Path(".")).is_dir():
            raise BenchInputError(f"--json: no such folder {args.json.parent}")
        files = find_trace_files(args.traces)
    except BenchInputError as exc:
        print(f"replay_bench: {exc}", file=sys.stderr)
        return 2
    traces: list[tuple[Path, Any]] = []
    unreadable = 0
    for path in files:
        try:
            tr = load_trace(path)
        except (TraceFormatError, OSError) as exc:
            unreadable += 1
            print(f"replay_bench: cannot read {path}: {exc}", file=sys.stderr)
            continue
        if tr.n_ops == 0:
            unreadable += 1
            print(f"replay_bench: {path} holds no allocations or frees", file=sys.stderr)
            continue
        if args.only and tr.name not in args.only:
            continue
        traces.append((path, tr))
    if not traces:
        print(f"replay_bench: nothing to replay in {args.traces}"
              + (f" (names given to --only: {' '.join(args.only)})" if args.only else ""), file=sys.stderr)
        return 2
    rows: list[dict] = []
    ok = True
    if not args.skip_sim:
        ok &= sim_tables(traces, args.device, rows, args.peer_timeout)
    if args.cuda:
        ok &= cuda_table([t for t in traces if t[1].source != "rmm-log"], rows, args.repeat, args.peer_timeout)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    if unreadable:
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
