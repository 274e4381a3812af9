"""CuPy's cost per allocation under its own pool and under gpumem's hook, side by side (issue 19).

Every trace of the corpus (``data/traces``: the tuning part and the check part of
:mod:`gpumem.trace.corpus`, or ``--traces DIR``) is replayed through ``cupy.cuda.alloc`` (a
``MemoryPointer`` per allocation, dropped to free it, as CuPy code does) with three allocators
installed in turn in one process:

- ``cupy-pool``: CuPy's ``MemoryPool`` (``cupy.cuda.set_allocator(pool.malloc)``), CuPy's default;
- ``gpumem``: ``gpumem.cupy_allocator.install()``, the native engine over the CUDA driver, called
  from C (Note [CuPy's allocator in C] in ``gpumem/_native/cuda_allocator.cpp``);
- ``gpumem-py`` (``--python-adapter``): the Python-adapter hook (``CupyMalloc`` over a
  ``CachingAllocator`` on ``cuda:<device>``), the fallback where the native engine is not built.

Steady state: a first pass grows each allocator's cache and is not timed; then ``--passes``
timed passes, interleaved between the allocators (pool, gpumem, pool, gpumem, ...) so that the
machine's drift hits both alike; the table gives the median µs per operation (allocations and frees
both count) and gpumem's ratio to CuPy's pool (target: at most 1 on every trace). ``--breakdown``
adds what one allocate+free pair costs in its parts (where time goes in the hook).

Usage::

    python benchmarks/cupy_hook_bench.py [--traces DIR] [--passes 5] [--device 0] [--python-adapter]
                                         [--breakdown] [--json OUT]

Exit status: 0 done (whatever the ratios); 2 bad input (no traces, no CuPy, no native engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpumem.progress import progress
from gpumem.trace.corpus import CHECK, TUNING, corpus_part

Alloc = Callable[[int], Any]


@dataclasses.dataclass
class Row:
    """One trace's figures."""

    trace: str
    part: str
    ops: int
    us_per_op: dict[str, float]          # allocator -> median µs per op of the timed passes
    passes_us: dict[str, list[float]]    # allocator -> every timed pass
    engine_calls: tuple[int, int]        # gpumem's device calls and event calls in its last timed pass
    held_nbytes: dict[str, int] = dataclasses.field(default_factory=dict)   # allocator -> memory held after the passes

    def ratio(self) -> float:
        return self.us_per_op["gpumem"] / self.us_per_op["cupy-pool"]


def replay(kinds: list[int], ids: list[int], sizes: list[int], alloc: Alloc) -> float:
    """µs per op of one pass of the trace through ``alloc`` (garbage collector paused); drops what is left."""
    live: dict[int, Any] = {}
    pop = live.pop
    gc.disable()
    try:
        t0 = time.perf_counter()
        for k, i, n in zip(kinds, ids, sizes):
            if k == 0:
                if n:
                    live[i] = alloc(n)
            else:
                pop(i, None)
        dt = time.perf_counter() - t0
    finally:
        live.clear()
        gc.enable()
    return dt * 1e6 / max(len(kinds), 1)


def trace_paths(folder: Path) -> list[Path]:
    """The corpus's traces in ``folder``, tuning part then check part, then any other trace file by name."""
    known = [folder / n for n in TUNING + CHECK if (folder / n).is_file()]
    other = sorted(p for p in folder.iterdir() if p.is_file() and p not in known and p.name != "README.md"
                   and any(s in p.suffixes for s in (".pickle", ".pkl", ".csv", ".gmt")))
    return known + other


def _part(path: Path) -> str:
    try:
        return corpus_part(path).value
    except Exception:  # noqa: BLE001 - a trace outside the corpus
        return "-"


def make_allocators(cupy: Any, device: int, python_adapter: bool) -> dict[str, tuple[Alloc, Callable[[], None]]]:
    """allocator name -> (the function installed in CuPy, what gives its cache back after a trace)."""
    import gpumem.cupy_allocator as gca

    pool = cupy.cuda.MemoryPool()
    native = gca.native_hook()
    engine = gca._engine_module().CudaAllocator(device)
    out: dict[str, tuple[Alloc, Callable[[], None]]] = {
        "cupy-pool": (pool.malloc, pool.free_all_blocks),
        "gpumem": (native, engine.empty_cache),
    }
    if python_adapter:
        from gpumem.allocator import CachingAllocator
        from gpumem.specs import open_device

        adapter = CachingAllocator(open_device(f"cuda:{device}"), "gpumem")
        out["gpumem-py"] = (gca.make_malloc(adapter), adapter.empty_cache)
    return out


def run_trace(cupy: Any, path: Path, allocators: dict[str, tuple[Alloc, Callable[[], None]]], passes: int) -> Row:
    import gpumem.cupy_allocator as gca
    from gpumem.trace import load_trace

    kinds, ids, sizes, _ = load_trace(path).as_lists()
    times: dict[str, list[float]] = {name: [] for name in allocators}
    for name, (fn, _release) in allocators.items():   # growth pass: not timed
        cupy.cuda.set_allocator(fn)
        replay(kinds, ids, sizes, cupy.cuda.alloc)
    engine = gca._engine_module().CudaAllocator(cupy.cuda.Device().id)
    calls = (0, 0)
    for k in range(passes):
        order = list(allocators) if k % 2 == 0 else list(reversed(allocators))
        for name in order:
            cupy.cuda.set_allocator(allocators[name][0])
            before = engine.peaks()
            times[name].append(replay(kinds, ids, sizes, cupy.cuda.alloc))
            if name == "gpumem":
                after = engine.peaks()
                calls = (after["device_calls"] - before["device_calls"], after["event_calls"] - before["event_calls"])
    cupy.cuda.set_allocator(None)
    cupy.cuda.Device().synchronize()
    held = {"gpumem": engine.reserved_nbytes()}
    pool = getattr(allocators.get("cupy-pool", (None,))[0], "__self__", None)   # pool.malloc's pool
    if pool is not None:
        held["cupy-pool"] = pool.total_bytes()
    for _fn, release in allocators.values():
        release()
    name = path.name.split(".")[0]
    return Row(name, _part(path), len(kinds), {n: statistics.median(t) for n, t in times.items()}, times, calls, held)


def best_us(fn: Callable[[], Any], n: int, repeats: int = 3) -> float:
    """µs per call of ``fn``: the best of ``repeats`` timings of ``n`` calls, after 1,000 warm-up calls, with the
    garbage collector off while timing."""
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(repeats):
        gc.disable()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / n)
        gc.enable()
    return best


def breakdown(cupy: Any, device: int, n: int = 200_000) -> list[tuple[str, float]]:
    """µs per call of the parts of one allocate+free (512 B, steady state)."""
    import gpumem.cupy_allocator as gca

    mem = cupy.cuda.memory
    hook = gca.native_hook()
    engine = gca._engine_module().CudaAllocator(device)
    pool = cupy.cuda.MemoryPool()
    stream_ptr = cupy.cuda.get_current_stream
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("cupy-pool: pool.malloc(512), dropped", lambda: pool.malloc(512)),
        ("gpumem: hook(512), dropped", lambda: hook(512)),
        ("  CudaAllocator.allocate(512) + free", lambda: engine.free(engine.allocate(512))),
        ("  hook.current_device() (the hook's device lookup)", hook.current_device),
        ("  hook.current_stream() (the hook's stream lookup)", hook.current_stream),
        ("  cupy.cuda.runtime.getDevice()", cupy.cuda.runtime.getDevice),
        ("  cupy.cuda.get_current_stream().ptr", lambda: stream_ptr().ptr),
        ("  UnownedMemory + MemoryPointer (no owner)", lambda: mem.MemoryPointer(mem.UnownedMemory(1 << 40, 512, None, device), 0)),
        ("python: empty lambda", lambda: None),
    ]
    out = [(label, best_us(fn, n)) for label, fn in cases]
    pool.free_all_blocks()
    engine.empty_cache()
    return out


def _stream_path(hook: Any) -> str:
    """How the hook reads CuPy's current stream (Note [CuPy's stream in C])."""
    if getattr(hook, "reads_stream_by_device", lambda: False)():
        return "in C: cupy_backends' get_stream_ptr(device)"
    return "in C: cupy.cuda.stream's get_current_stream_ptr()" if hook.reads_stream_in_c() else "through Python"


def render(rows: list[Row], names: list[str]) -> str:
    head = ("| trace | part | ops | " + " | ".join(f"{n} µs/op" for n in names) +
            " | gpumem / cupy-pool | gpumem device calls, event calls per pass | held MiB: cupy-pool, gpumem |")
    lines = [head, "|" + "---|" * (len(names) + 6)]
    for r in rows:
        cells = " | ".join(f"{r.us_per_op[n]:.2f}" for n in names)
        held = ", ".join(f"{r.held_nbytes[n] / 2**20:.0f}" if n in r.held_nbytes else "-" for n in ("cupy-pool", "gpumem"))
        lines.append(f"| {r.trace} | {r.part} | {r.ops} | {cells} | {r.ratio():.2f} | {r.engine_calls[0]}, "
                     f"{r.engine_calls[1]} | {held} |")
    worst = max(rows, key=Row.ratio)
    lines.append("")
    lines.append(f"gpumem at or below CuPy's pool on {sum(r.ratio() <= 1.0 for r in rows)}/{len(rows)} traces; "
                 f"worst ratio {worst.ratio():.2f} ({worst.trace}); median ratio "
                 f"{statistics.median(r.ratio() for r in rows):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "traces",
                    help="folder of traces to replay (default: data/traces)")
    ap.add_argument("--passes", type=int, default=5, help="timed passes per allocator and trace (after one growth pass)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    ap.add_argument("--python-adapter", action="store_true", help="also time the Python-adapter hook (slow)")
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of one allocate+free")
    ap.add_argument("--page-slack", type=float, help="the engine's page_slack (default: CuPy's hook's, "
                    "gpumem.cupy_allocator.CUPY_PAGE_SLACK); more slack, fewer steals of empty pages in steady "
                    "state, more memory held")
    ap.add_argument("--json", type=Path, help="write the figures there as JSON")
    args = ap.parse_args(argv)
    if args.passes < 1:
        print("--passes must be at least 1", file=sys.stderr)
        return 2
    try:
        import cupy

        import gpumem.cupy_allocator as gca

        import gpumem.torch as gtorch

        gca.native_hook()
        # the policy install() gives the engines, before one is made (at the first allocation)
        policy = gca.cupy_policy()
        if args.page_slack is not None:
            policy = dataclasses.replace(policy, name=f"page_slack={args.page_slack}", page_slack=args.page_slack)
        gtorch.configure(policy)
    except Exception as exc:  # noqa: BLE001 - reported as bad input
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    if not args.traces.is_dir() or not (paths := trace_paths(args.traces)):
        print(f"no trace files in {args.traces}", file=sys.stderr)
        return 2
    with cupy.cuda.Device(args.device):
        allocators = make_allocators(cupy, args.device, args.python_adapter)
        hook = allocators["gpumem"][0]
        print(f"engine policy: the default with page_slack={policy.page_slack}; "
              f"CuPy {cupy.__version__}, device {args.device} ({cupy.cuda.runtime.getDeviceProperties(args.device)['name'].decode()}); "
              f"the hook reads CuPy's stream {_stream_path(hook)}")
        rows = []
        with progress(len(paths), desc="traces", unit="trace") as bar:
            for p in paths:
                rows.append(run_trace(cupy, p, allocators, args.passes))
                bar.update()
        names = list(allocators)
        print(render(rows, names))
        parts = breakdown(cupy, args.device) if args.breakdown else []
        if parts:
            print("\n| one allocate + free, 512 B | µs |\n|---|---|")
            for label, us in parts:
                print(f"| {label} | {us:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": [dataclasses.asdict(r) | {"ratio": r.ratio()} for r in rows],
                                         "breakdown_us": dict(parts), "passes": args.passes,
                                         "hook_stream": _stream_path(hook)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
