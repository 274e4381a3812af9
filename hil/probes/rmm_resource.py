"""gpumem as RMM's memory resource on a real GPU (issue 19, point 4): traces replayed as ``rmm.DeviceBuffer``
allocations, and CuPy on RMM's allocator, checked against CuPy's own pool.

Each case runs in its own process, so that every figure is that run's alone (the native engine is one per
device and process):

* ``replay TRACE gpumem`` - every allocation of the trace is an ``rmm.DeviceBuffer`` on gpumem's resource
  (:func:`gpumem.rmm_resource.install`), freed when the trace frees it, on an RMM stream per trace
  stream; then the same once more with every buffer stamped with its id on its stream and read back when
  freed (the data check); then the engine's consistency check;
* ``replay TRACE pool`` - the same replay on ``rmm.mr.PoolMemoryResource`` over ``CudaMemoryResource``
  (initial size 0: it grows as needed, by at least its size so far, and never shrinks);
* ``cupy`` - one CuPy computation (matmul, FFT, sort, reductions, shapes changing in a loop) under CuPy's
  pool, then under ``rmm.allocators.cupy.rmm_cupy_allocator`` with gpumem the device's RMM resource: the
  results must be bit-identical, and CuPy must have allocated through gpumem;
* ``stream_lifetime`` - a block freed on a stream that is then destroyed, its memory needed by another
  stream: what the engine does (Note [Streams outlive the engine's use of them] in gpumem/rmm_resource.py).

Run on the GPU from the checkout's root: ``python -m hil.probes.rmm_resource --out DIR [--traces a,b]``;
it writes ``DIR/rmm-resource.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"
DEFAULT_TRACES = ("resnet_train.rmm_log.csv.gz", "gpt2_fp32_train_h200.snapshot.pickle.gz",
                  "multistream_infer_h200.snapshot.pickle.gz")
RESOURCES = ("gpumem", "pool")


class ProbeError(Exception):
    """A case that did not give its figures (said in one line)."""


def _replay(trace: Any, rmm: Any, mr: Any, stamp: bool, streams: dict[int, Any]) -> dict[str, Any]:
    """Replay ``trace`` as DeviceBuffers on ``mr``, an RMM stream per trace stream (kept in ``streams``,
    which the caller keeps alive: Note [Streams outlive the engine's use of them] in gpumem/rmm_resource.py);
    with ``stamp``, write each buffer's id into it on its stream and check it when freed. Returns the wall
    time per op and the stamp mismatches."""
    import cupy
    import numpy as np

    def rmm_stream(s: int) -> Any:
        if s not in streams:
            streams[s] = rmm.pylibrmm.stream.DEFAULT_STREAM if s == 0 else rmm.pylibrmm.stream.Stream()
        return streams[s]

    def first_word(buf: Any) -> Any:
        return cupy.ndarray((1,), np.int64, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buf.ptr, 8, buf), 0))

    live: dict[int, tuple[Any, Any]] = {}
    mismatches = 0
    kinds, ids, sizes, trace_streams = trace.as_lists()
    t0 = time.perf_counter()
    for kind, aid, nbytes, s in zip(kinds, ids, sizes, trace_streams):
        if kind == 0:
            stream = rmm_stream(s)
            buf = rmm.DeviceBuffer(size=nbytes, stream=stream, mr=mr)
            if stamp and nbytes >= 8:
                with cupy.cuda.ExternalStream(stream.__cuda_stream__()[1]):
                    first_word(buf).fill(aid)
            live[aid] = (buf, stream)
        else:
            entry = live.pop(aid, None)
            if entry is None:
                continue
            buf, stream = entry
            if stamp and buf.size >= 8:
                cs = cupy.cuda.ExternalStream(stream.__cuda_stream__()[1])
                mismatches += int(first_word(buf).get(stream=cs)[0]) != aid
            del buf, entry
    elapsed_s = time.perf_counter() - t0
    live.clear()
    cupy.cuda.runtime.deviceSynchronize()
    return {"us_per_op": 1e6 * elapsed_s / max(1, len(kinds)), "stamp_mismatches": mismatches}


def child_replay(trace_path: str, resource: str) -> dict[str, Any]:
    import rmm

    from gpumem.trace import load_trace

    trace_name = Path(trace_path).name
    trace = load_trace(trace_path)
    out: dict[str, Any] = {"trace": trace_name, "resource": resource, "ops": int(trace.n_ops),
                           "peak_live_nbytes": int(trace.summary().peak_live_nbytes)}
    if resource == "gpumem":
        import gpumem.rmm_resource as grr

        mr = grr.install(0)
        out["resource_repr"] = repr(mr)
        streams: dict[int, Any] = {}
        timed = _replay(trace, rmm, mr, False, streams)
        peaks = mr.allocator.peaks()
        checked = _replay(trace, rmm, mr, True, streams)
        check = mr.check()
        out.update(us_per_op=timed["us_per_op"], stamp_mismatches=checked["stamp_mismatches"],
                   peak_reserved_nbytes=int(peaks["peak_reserved_nbytes"]),
                   peak_allocated_nbytes=int(peaks["peak_allocated_nbytes"]), device_calls=int(peaks["device_calls"]),
                   consistent=check.ok, problems=list(check.problems), allocated_nbytes_at_end=check.allocated_nbytes,
                   reserved_nbytes_at_end=check.reserved_nbytes)
    else:
        mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=0)
        rmm.mr.set_per_device_resource(0, mr)
        timed = _replay(trace, rmm, mr, False, {})
        out.update(us_per_op=timed["us_per_op"], peak_reserved_nbytes=int(mr.pool_size()))
    return out


def _computation(cupy: Any) -> dict[str, Any]:
    """One CuPy computation with shapes that change; returns its results as host arrays."""
    import numpy as np

    rng = np.random.default_rng(19)
    a = cupy.asarray(rng.standard_normal((1024, 768), dtype=np.float32))
    b = cupy.asarray(rng.standard_normal((768, 512), dtype=np.float32))
    v = cupy.asarray(rng.standard_normal(1 << 22))
    out = {"matmul": (a @ b).get(), "rfft": cupy.fft.rfft(v).get(), "sort": cupy.sort(v).get(),
           "sum": float(cupy.sum(v * v)), "cumsum": cupy.cumsum(v[: 1 << 16]).get()}
    churn = []
    for i in range(200):
        n = int(rng.integers(1, 1 << 20))
        x = cupy.arange(n, dtype=cupy.float64) * (i + 1)
        churn.append(float(x.sum()))
    out["churn"] = np.asarray(churn)
    return out


def child_cupy() -> dict[str, Any]:
    import cupy
    import numpy as np
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator

    import gpumem.rmm_resource as grr

    plans = cupy.fft.config.get_plan_cache()
    plans.set_size(0)   # no cuFFT plan (a work area from the first allocator) outlives its call
    reference = _computation(cupy)          # CuPy's own pool
    cupy.get_default_memory_pool().free_all_blocks()
    mr = grr.install(0)
    before = mr.allocator.peaks()["num_allocs"]
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        ours = _computation(cupy)
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    cupy.cuda.runtime.deviceSynchronize()
    allocations = mr.allocator.peaks()["num_allocs"] - before
    identical = {k: bool(np.array_equal(np.asarray(reference[k]), np.asarray(ours[k]))) for k in reference}
    check = mr.check()
    return {"case": "cupy", "rmm": rmm.__version__, "cupy": cupy.__version__,
            "allocations_through_gpumem": int(allocations), "identical": identical,
            "consistent": check.ok, "problems": list(check.problems),
            "allocated_nbytes_at_end": check.allocated_nbytes}


def child_stream_lifetime() -> dict[str, Any]:
    """What happens when a stream that RMM freed a block on is destroyed while gpumem still caches the block,
    and another stream then needs that memory (Note [Streams outlive the engine's use of them])."""
    import gc

    import rmm

    import gpumem.rmm_resource as grr

    mr = grr.install(0)
    nbytes = 64 << 20
    stream = rmm.pylibrmm.stream.Stream()
    ptr = mr.allocate(nbytes, stream)
    mr.deallocate(ptr, nbytes, stream)
    del stream
    gc.collect()                       # the CUDA stream is destroyed; gpumem caches the block freed on it
    try:
        again = mr.allocate(nbytes)    # on the default stream: the same memory, if the engine reuses it
        mr.deallocate(again, nbytes)
        released = mr.allocator.empty_cache()
        outcome = f"no error (reused the block: {again == ptr}; empty_cache released {released} B)"
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        outcome = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    check = mr.check()
    return {"case": "stream_lifetime", "outcome": outcome, "consistent": check.ok, "problems": list(check.problems)}


def _run_child(args: list[str], timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "hil.probes.rmm_resource", "--child", *args],
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise ProbeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("rmm-cu13", "librmm-cu13", "rapids-logger", "cuda-bindings", "cupy-cuda13x", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hil.probes.rmm_resource",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":.") + ".")
    ap.add_argument("--out", type=Path, help="folder for rmm-resource.json")
    ap.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="trace files of data/traces, comma-separated")
    ap.add_argument("--traces-dir", type=Path, default=TRACES_DIR, help="the folder of the traces (default: data/traces)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        if ns.child[0] == "cupy":
            result = child_cupy()
        elif ns.child[0] == "stream_lifetime":
            result = child_stream_lifetime()
        else:
            result = child_replay(ns.child[1], ns.child[2])
        print(json.dumps(result))
        return 0
    record: dict[str, Any] = {"versions": versions(), "replays": [], "cupy": None, "stream_lifetime": None,
                              "errors": []}
    for name in [t for t in ns.traces.split(",") if t]:
        for resource in RESOURCES:
            try:
                record["replays"].append(_run_child(["replay", str(ns.traces_dir / name), resource], ns.timeout))
            except (ProbeError, subprocess.TimeoutExpired) as exc:
                record["errors"].append(str(exc))
    for case in ("cupy", "stream_lifetime"):
        try:
            record[case] = _run_child([case], ns.timeout)
        except (ProbeError, subprocess.TimeoutExpired) as exc:
            record["errors"].append(str(exc))
    print(f"{'trace':44} {'resource':8} {'us/op':>7} {'peak held MiB':>14} {'peak live MiB':>14} consistent stamps")
    for r in record["replays"]:
        print(f"{r['trace']:44} {r['resource']:8} {r['us_per_op']:7.2f} {r['peak_reserved_nbytes'] / 2**20:14.1f} "
              f"{r['peak_live_nbytes'] / 2**20:14.1f} {r.get('consistent', '-')!s:10} {r.get('stamp_mismatches', '-')}")
    print("cupy:", json.dumps(record["cupy"]))
    print("stream_lifetime:", json.dumps(record["stream_lifetime"]))
    for e in record["errors"]:
        print("ERROR:", e)
    if ns.out:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "rmm-resource.json").write_text(json.dumps(record, indent=1))
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
