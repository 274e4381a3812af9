"""The peer benchmark on a real GPU: every trace through gpumem and through the allocators it replaces.

::

    python -m hil.peers --device cuda:0 [--traces DIR] [--repeat N] [--json OUT.json]

For every trace in ``--traces`` (default: the project's ``data/traces``) and every peer of
:data:`PEERS` - gpumem through its Python API, its CuPy hook and its PyTorch integration; PyTorch's
caching allocator with and without expandable segments; CuPy's ``MemoryPool``; RMM's pool; and
``cudaMallocAsync`` - it measures peak reserved bytes, the overhead (peak reserved / peak live - 1,
peak live being the trace's) and the cost of one operation (one alloc or one free called from
Python, µs, median of ``--repeat`` timed passes).

Note [One process per peer and trace]
-------------------------------------
Each peer replays each trace in a fresh Python process: memory a peer caches (PyTorch's and CuPy's
pools, RMM's pool, the async pool) never shrinks what the next one gets, PyTorch reads
``PYTORCH_CUDA_ALLOC_CONF`` only once per process (default and expandable segments cannot share one),
gpumem's PyTorch allocator can be installed only before PyTorch's first allocation, and the peak
figures some peers keep (RMM's statistics, the async pool's high-water mark) cannot be reset: a
fresh process starts them at zero. A peer whose import fails is *unavailable*; an exception, a crash,
a kill or a timeout makes it *failed* on that trace, with the process's last line; neither stops the
benchmark.

Note [How each peer's peak reserved is read]
--------------------------------------------
- gpumem (all three ways in): the allocator's own ``peak_reserved_nbytes``.
- PyTorch: ``torch.cuda.max_memory_reserved()``.
- CuPy's pool: the largest ``pool.total_bytes()`` after an allocation, read in an untimed pass
  (reading it after every call would slow the timed ones).
- RMM's pool: the peak bytes a ``StatisticsResourceAdaptor`` under the pool saw the pool take from
  ``cudaMalloc`` (the pool starts empty and grows: ``initial_pool_size=0``).
- cudaMallocAsync (CuPy's ``MemoryAsyncPool`` on the device's default pool): the pool's
  ``cudaMemPoolAttrReservedMemHigh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hil.process import MAX_TIMEOUT_S, kill_group, timeout_seconds

log = logging.getLogger("hil.peers")

#: Every peer, in table order: (name, what it is).
PEERS: tuple[tuple[str, str], ...] = (
    ("gpumem", "gpumem's CachingAllocator through its Python API"),
    ("gpumem-cupy", "gpumem under CuPy (gpumem.cupy_allocator)"),
    ("gpumem-torch", "gpumem under PyTorch (gpumem.torch.install)"),
    ("pytorch", "PyTorch's caching allocator, default settings"),
    ("pytorch-expandable", "PyTorch's caching allocator, expandable_segments:True"),
    ("cupy-pool", "CuPy's MemoryPool"),
    ("rmm-pool", "RMM's PoolMemoryResource over cudaMalloc"),
    ("cuda-malloc-async", "cudaMallocAsync (CuPy's MemoryAsyncPool, the device's default pool)"),
)
PEER_NAMES = tuple(name for name, _ in PEERS)
GPUMEM_PEERS = ("gpumem", "gpumem-cupy", "gpumem-torch")
TRACE_SUFFIXES = (".pickle", ".pkl", ".csv", ".gmt")
DEFAULT_TIMEOUT_S = 600.0
#: Test hook: ``GPUMEM_PEERS_FAKE=crash:PEER``, ``hang:PEER`` or ``missing:PEER`` makes that peer's process
#: crash, hang (with a child process that hangs too), or report its library missing (how the benchmark
#: survives each is tested without a GPU).
FAKE_ENV = "GPUMEM_PEERS_FAKE"


class PeersInputError(Exception):
    """Bad input: one clear line, exit status 2."""


@dataclasses.dataclass
class PeerCell:
    """One peer on one trace."""

    peer: str
    trace: str
    status: str  # "ok", "unavailable", "failed"
    peak_reserved_nbytes: int | None = None
    overhead: float | None = None
    us_per_op: float | None = None
    reason: str = ""


def default_traces_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "data" / "traces"


def find_traces(folder: Path) -> list[Path]:
    """Every trace file in ``folder`` (PyTorch snapshots, RMM logs, gpumem traces, maybe gzipped), by name."""
    if not folder.is_dir():
        raise PeersInputError(f"--traces: no such folder: {folder}")
    found = []
    for p in sorted(folder.iterdir()):
        name = p.name[:-3] if p.name.endswith(".gz") else p.name
        if p.is_file() and Path(name).suffix in TRACE_SUFFIXES:
            found.append(p)
    if not found:
        raise PeersInputError(f"--traces: {folder} holds no trace file (*.pickle, *.pkl, *.csv, *.gmt, maybe .gz)")
    return found


def trace_label(path: str | Path) -> str:
    name = Path(path).name
    for suffix in (".gz", ".pickle", ".pkl", ".csv", ".gmt", ".snapshot", ".trace", ".rmm_log"):
        name = name.removesuffix(suffix)
    return name + (" (RMM log)" if ".csv" in Path(path).name else "")


# -- the worker: one peer, one trace, in its own process ----------------------------------------------------------
def _time_ops(kinds: list[int], ids: list[int], sizes: list[int], alloc: Callable[[int], Any],
              free: Callable[[Any], None]) -> float:
    """µs per op of one pass (garbage collector paused); frees what is left live at the end."""
    ptrs: dict[int, Any] = {}
    gc.disable()
    try:
        t0 = time.perf_counter()
        for k, i, n in zip(kinds, ids, sizes):
            if k == 0:
                if n:
                    ptrs[i] = alloc(n)
            else:
                p = ptrs.pop(i, None)
                if p is not None:
                    free(p)
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
        for p in ptrs.values():
            free(p)
        ptrs.clear()
    return dt * 1e6 / max(len(kinds), 1)


def _max_after_allocs(kinds: list[int], ids: list[int], sizes: list[int], alloc: Callable[[int], Any],
                      free: Callable[[Any], None], read: Callable[[], int]) -> int:
    """An untimed pass that reads ``read()`` after every allocation; returns the largest value."""
    ptrs: dict[int, Any] = {}
    peak = 0
    for k, i, n in zip(kinds, ids, sizes):
        if k == 0:
            if n:
                ptrs[i] = alloc(n)
                peak = max(peak, read())
        else:
            p = ptrs.pop(i, None)
            if p is not None:
                free(p)
    for p in ptrs.values():
        free(p)
    return peak


def _cuda_index(device: str) -> int:
    return int(device.split(":", 1)[1])


def _runner(peer: str, device: str) -> Callable[[list, list, list, int], tuple[list[float], int]]:
    """``(kinds, ids, sizes, repeat) -> (µs per op of each pass, peak reserved)`` for ``peer``; ImportError
    when the peer's library is missing."""
    index = _cuda_index(device)
    if peer in ("gpumem", "gpumem-cupy"):
        from gpumem.allocator import CachingAllocator
        from gpumem.specs import open_device

        if peer == "gpumem-cupy":
            import cupy

            import gpumem.cupy_allocator as gca

        def run_gpumem(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times, peak = [], 0
            dev = open_device(device)
            try:
                for _ in range(repeat):
                    alloc = CachingAllocator(dev, "gpumem")
                    try:
                        if peer == "gpumem":
                            times.append(_time_ops(kinds, ids, sizes, alloc.allocate, alloc.free))
                        else:
                            with cupy.cuda.Device(index), gca.using(alloc):
                                times.append(_time_ops(kinds, ids, sizes, cupy.cuda.alloc, lambda p: None))
                        peak = max(peak, alloc.snapshot_stats().peak_reserved_nbytes)
                    finally:
                        alloc.close()
            finally:
                dev.close()
            return times, peak
        return run_gpumem
    if peer == "gpumem-torch":
        import gpumem.torch as gtorch

        gtorch.install(index)
        import torch

        def run_gtorch(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times = []
            with torch.cuda.device(index):
                for _ in range(repeat):
                    times.append(_time_ops(kinds, ids, sizes, torch.cuda.caching_allocator_alloc,
                                           torch.cuda.caching_allocator_delete))
                    gtorch.empty_cache(index)
            return times, int(gtorch.memory_stats(index)["reserved_bytes.all.peak"])
        return run_gtorch
    if peer in ("pytorch", "pytorch-expandable"):
        import torch

        def run_torch(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times, peak = [], 0
            with torch.cuda.device(index):
                for _ in range(repeat):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    times.append(_time_ops(kinds, ids, sizes, torch.cuda.caching_allocator_alloc,
                                           torch.cuda.caching_allocator_delete))
                    peak = max(peak, torch.cuda.max_memory_reserved())
            return times, peak
        return run_torch
    if peer == "cupy-pool":
        import cupy

        def run_cupy(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times = []
            with cupy.cuda.Device(index):
                for _ in range(repeat):
                    pool = cupy.cuda.MemoryPool()
                    times.append(_time_ops(kinds, ids, sizes, pool.malloc, lambda p: None))
                    pool.free_all_blocks()
                pool = cupy.cuda.MemoryPool()
                peak = _max_after_allocs(kinds, ids, sizes, pool.malloc, lambda p: None, pool.total_bytes)
                pool.free_all_blocks()
            return times, peak
        return run_cupy
    if peer == "rmm-pool":
        import rmm

        def run_rmm(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times, peak = [], 0
            rmm.mr.set_current_device_resource(rmm.mr.CudaMemoryResource())
            for _ in range(repeat):
                upstream = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
                pool = rmm.mr.PoolMemoryResource(upstream, initial_pool_size=0)
                times.append(_time_ops(kinds, ids, sizes, lambda n: (pool.allocate(n), n),
                                       lambda p: pool.deallocate(p[0], p[1])))
                counts = upstream.allocation_counts  # a dict in older RMM, an object with fields in newer
                peak = max(peak, int(counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes))
                del pool, upstream
                gc.collect()
            return times, peak
        return run_rmm
    if peer == "cuda-malloc-async":
        import cupy
        from cuda.bindings import runtime as cudart

        def reserved_high() -> int:
            err, pool = cudart.cudaDeviceGetDefaultMemPool(index)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaDeviceGetDefaultMemPool: {err}")
            err, value = cudart.cudaMemPoolGetAttribute(pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemHigh)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemPoolGetAttribute: {err}")
            return int(value)

        def run_async(kinds: list, ids: list, sizes: list, repeat: int) -> tuple[list[float], int]:
            times = []
            with cupy.cuda.Device(index):
                pool = cupy.cuda.MemoryAsyncPool()
                for _ in range(repeat):
                    times.append(_time_ops(kinds, ids, sizes, pool.malloc, lambda p: None))
                    cupy.cuda.Device(index).synchronize()
                return times, reserved_high()
        return run_async
    raise ValueError(f"unknown peer {peer!r}")


def worker(task: dict[str, Any]) -> int:
    """One peer on one trace (Note [One process per peer and trace]): prints one JSON line."""
    from gpumem.trace import load_trace

    fake = os.environ.get(FAKE_ENV, "")
    if fake == f"crash:{task['peer']}":
        os.abort()
    if fake == f"hang:{task['peer']}":
        if not task.get("fake_child"):  # a hanging helper of its own, as a library's worker processes would be
            subprocess.Popen([sys.executable, "-m", "hil.peers", "--worker",
                              json.dumps({**task, "fake_child": True})])
        time.sleep(3600)
    try:
        if fake == f"missing:{task['peer']}":
            raise ImportError(f"No module named {task['peer']!r} ({FAKE_ENV})")
        run = _runner(task["peer"], task["device"])
    except ImportError as exc:
        print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
        return 0
    trace = load_trace(task["trace"])
    kinds, ids, sizes, _ = trace.as_lists()
    times, peak = run(kinds, ids, sizes, int(task["repeat"]))
    print(json.dumps({"us_per_op": statistics.median(times), "peak_reserved_nbytes": int(peak),
                      "peak_live_nbytes": int(trace.peak_live_nbytes)}))
    return 0


def _run_worker(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[str, str, int | None]:
    """Run a worker in a new session; ``(stdout, stderr, exit status)``, the status None when it ran past
    ``timeout_s``: then the whole process group is killed, so no worker (or anything it started) is left
    holding the GPU. Any other exception while waiting (Ctrl-C) kills the group too, then propagates."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return stdout or "", stderr or "", proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            stdout, stderr = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            proc.kill()
            stdout, stderr = "", ""
        return stdout or "", stderr or "", None
    except BaseException:
        kill_group(proc)
        raise


def run_cell(peer: str, trace: Path, device: str, repeat: int, timeout_s: float) -> tuple[PeerCell, int | None]:
    """Run one peer on one trace in a fresh process; never raises for the peer's own failures."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    if peer == "pytorch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif peer == "pytorch":
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    task = {"peer": peer, "trace": str(trace), "device": device, "repeat": repeat}
    label = trace_label(trace)
    stdout, stderr, returncode = _run_worker([sys.executable, "-m", "hil.peers", "--worker", json.dumps(task)],
                                             env, timeout_s)
    ended = (f"the process exited with status {returncode}" if returncode is not None
             else f"timed out after {timeout_s:g} s")
    for line in reversed(stdout.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "unavailable" in rec:
            return PeerCell(peer, label, "unavailable", reason=str(rec["unavailable"])[:300]), None
        if isinstance(rec, dict) and "us_per_op" in rec:
            live = int(rec["peak_live_nbytes"])
            peak = int(rec["peak_reserved_nbytes"])
            return PeerCell(peer, label, "ok", peak_reserved_nbytes=peak,
                            overhead=(peak / live - 1.0) if live else None,
                            us_per_op=round(float(rec["us_per_op"]), 3)), live
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
    return PeerCell(peer, label, "failed", reason=(ended + (f": {tail[0][:300]}" if tail else ""))), None


# -- tables -----------------------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.2f}%"


def _cell_text(c: PeerCell | None, what: str) -> str:
    if c is None:
        return "—"
    if c.status == "unavailable":
        return "n/a"
    if c.status == "failed":
        return "failed"
    return _pct(c.overhead) if what == "overhead" else f"{c.us_per_op:.2f}"


def render_markdown(cells: list[PeerCell], traces: list[str], live: dict[str, int], peers: Sequence[str]) -> str:
    by = {(c.peer, c.trace): c for c in cells}
    head = "| trace | peak live | " + " | ".join(peers) + " | gpumem / best other |"
    sep = "|---" * (len(peers) + 3) + "|"
    lines = ["### Overhead: peak reserved / peak live − 1 (lower is better)", "", head, sep]
    for t in traces:
        ok = [by.get((p, t)) for p in peers]
        others = [c.overhead for c in ok if c and c.status == "ok" and c.peer not in GPUMEM_PEERS
                  and c.overhead is not None]
        g = by.get(("gpumem", t))
        ratio = "—"
        if g and g.status == "ok" and others:
            ratio = f"{_pct(g.overhead)} vs {_pct(min(others))}"
        lines.append(f"| {t} | {live.get(t, 0) / 2**30:.2f} GiB | "
                     + " | ".join(_cell_text(by.get((p, t)), "overhead") for p in peers) + f" | {ratio} |")
    lines += ["", "### Cost per operation (one alloc or one free, called from Python; µs, median of passes)", "",
              "| trace | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
    for t in traces:
        lines.append(f"| {t} | " + " | ".join(_cell_text(by.get((p, t)), "us") for p in peers) + " |")
    notes = [c for c in cells if c.status != "ok"]
    if notes:
        lines += ["", "Peers that did not run:", ""]
        lines += [f"- {c.peer} on {c.trace}: {c.status}: {c.reason}" for c in notes]
    lines += ["", "Each peer replays each trace in a fresh process (Note [One process per peer and trace] in "
              "`hil/peers.py`); peak reserved as Note [How each peer's peak reserved is read] says."]
    return "\n".join(lines) + "\n"


def run_benchmark(device: str, traces: list[Path], peers: Sequence[str], repeat: int, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    started_utc = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    cells: list[PeerCell] = []
    live: dict[str, int] = {}
    for trace in traces:
        for peer in peers:
            log.info("%s on %s ...", peer, trace.name)
            cell, peak_live = run_cell(peer, trace, device, repeat, timeout_s)
            log.info("%s on %s: %s %s", peer, trace.name, cell.status,
                     _pct(cell.overhead) if cell.status == "ok" else cell.reason)
            if peak_live is not None:
                live[cell.trace] = peak_live
            cells.append(cell)
    labels = [trace_label(t) for t in traces]
    gpumem_failed = [c for c in cells if c.peer in GPUMEM_PEERS and c.status == "failed"]
    # gpumem's own Python API needs nothing but gpumem: unavailable there means gpumem itself is missing
    gpumem_missing = [c for c in cells if c.peer == "gpumem" and c.status == "unavailable"]
    missing = sorted({c.peer for c in cells if c.status != "ok"})
    n_ok = sum(c.status == "ok" for c in cells)
    if gpumem_failed or gpumem_missing:
        status = "failed"
        reason = "; ".join([f"{c.peer} failed on {c.trace}: {c.reason}" for c in gpumem_failed]
                           + [f"gpumem itself is unavailable on {c.trace}: {c.reason}" for c in gpumem_missing])
    elif n_ok == 0:
        # nothing measured proves nothing: never "passed"
        status = "skipped"
        reason = (f"nothing measured: no peer ran on any trace ({len(cells)} cells: "
                  + ", ".join(f"{c.peer} {c.status}" for c in cells[:8]) + (", ..." if len(cells) > 8 else "") + ")"
                  if cells else "nothing measured: no trace or no peer given")
    else:
        status, reason = "passed", ""
    return {
        "status": status,
        "reason": reason,
        "summary": f"{len(labels)} traces × {len(peers)} peers: {n_ok} measured"
                   + (f"; did not run: {', '.join(missing)}" if missing else ""),
        "markdown": render_markdown(cells, labels, live, peers),
        "device": device, "repeat": repeat, "traces": labels, "peers": list(peers),
        "peak_live_nbytes": live, "cells": [dataclasses.asdict(c) for c in cells],
        "started_utc": started_utc, "duration_s": round(time.monotonic() - started, 1),
    }


def _write(path: Path | None, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=1, default=str) + "\n"
    if path is None:
        sys.stdout.write(text)
    else:
        path.write_text(text, encoding="utf-8")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (:class:`PeersInputError`, exit status 2), without the usage."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise PeersInputError(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m hil.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0", help="the real GPU (cuda:N); a sim: spec records the part "
                                                            "as skipped")
    parser.add_argument("--traces", type=Path, default=None, help="folder of traces (default: data/traces)")
    parser.add_argument("--peers", default=",".join(PEER_NAMES), help="comma-separated peers (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per peer and trace (default 3)")
    parser.add_argument("--timeout-s", type=timeout_seconds, default=DEFAULT_TIMEOUT_S,
                        help=f"per peer and trace, seconds (default {DEFAULT_TIMEOUT_S:g}, at most {MAX_TIMEOUT_S:g})")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON here (default: stdout)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(argv)
    except PeersInputError as exc:
        print(f"python -m hil.peers: {exc}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(json.loads(args.worker))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        unknown = [p for p in peers if p not in PEER_NAMES]
        if unknown or not peers:
            raise PeersInputError(f"--peers: unknown {', '.join(unknown) or '(none given)'}; the peers are: "
                                  f"{', '.join(PEER_NAMES)}")
        if not 1 <= args.repeat <= 100:
            raise PeersInputError(f"--repeat must be from 1 to 100, got {args.repeat}")
        if not (args.device.startswith("cuda:") or args.device.startswith("sim:")):
            raise PeersInputError(f"--device: {args.device!r} is not cuda:N or sim:PROFILE")
        if args.device.startswith("cuda:") and not args.device[5:].isdigit():
            raise PeersInputError(f"--device: {args.device!r}: the index must be a whole number")
        traces = find_traces(args.traces or default_traces_dir())
    except PeersInputError as exc:
        print(f"python -m hil.peers: {exc}", file=sys.stderr)
        return 2
    if args.device.startswith("sim:"):
        _write(args.json, {"status": "skipped", "reason": f"needs a real GPU ({args.device} is simulated)",
                           "summary": "", "markdown": "", "duration_s": 0.0,
                           "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
        return 0
    _write(args.json, run_benchmark(args.device, traces, peers, args.repeat, args.timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
