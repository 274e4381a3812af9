"""Sweep how the virtual-memory backing grows and moves physical memory, by replaying real traces.

For each variant of the growth/move policy (a set of :class:`~gpumem.allocator.policy.AllocatorPolicy`
knobs) every trace in ``--traces DIR`` (default: the project's ``data/traces``) is replayed on a
simulated device (default ``sim:h200-141gb``) while the device calls the allocator makes are counted
by kind. The script prints one table per variant: calls per trace by kind, the modelled driver time
per operation on the H200 (:func:`call_cost_us`, below) and the overhead (peak reserved / peak live
- 1), then a summary table of every variant.

Note [Modelled driver costs]
----------------------------
Measured on the H200 on 2026-11-22 (``reports/hil/calibrate-h200-2026-11-22.md``: the calibration probe,
median host time of one call from Python over 15 to 32 samples), less the binding's own 0.78 µs per call
(``null_call``), which a driver call from the native engine does not pay:

* ``cuMemCreate``: 14.0 µs for 2 MiB, 13.6 for 32 MiB, 22.3 for 256 MiB, 118 for 1 GiB; ``cuMemRelease``:
  14.9, 31.3, 161 and 586 µs. Sizes in between are interpolated linearly (:func:`interpolate_us`).
* ``cuMemSetAccess`` costs per *mapping* in its range: 36.1 µs over one page, 984 over 32 one-page
  mappings, 46.8 over one 64 MiB mapping; fitted exactly to those three: a fixed part per call, a part
  per mapping and a part per MiB (:func:`fit_per_mapping`), about 4.8 + 30.2 per mapping + 0.17 per MiB.
* ``cuMemUnmap`` likewise: 22.8 µs for one page, 660 for 32 one-page mappings, 28.3 for one 64 MiB
  mapping: about 1.5 + 20.4 per mapping + 0.09 per MiB.
* ``cuMemMap``: 3.2 µs for one page, 2.9 for 64 MiB (interpolated).
* events: ``cuEventCreate`` + ``cuEventRecord`` for a record (1.15 + 1.68 µs), ``cuEventQuery`` 1.34,
  ``cuEventSynchronize`` as an idle one 1.81 (the wait itself is GPU time, not driver overhead),
  ``cuEventDestroy`` 1.47.

Phase 1 of issue 7 used the issue's single runs and assumptions in their place (``cuMemCreate`` growing
by 440 µs per GiB, ``cuMemSetAccess`` by 4.8 µs per further mapping, unmap and release flat); what changed
is in ``reports/growth-sweep.md``.

Usage::

    python -m sim.growth_sweep [--traces DIR] [--device SPEC] [--variants NAME,...] [--engine E] [--json OUT]
    python -m sim.growth_sweep --engines ROUNDS   # wall time per op, Python vs native engine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpumem import open_device  # noqa: E402
from gpumem.allocator import CachingAllocator  # noqa: E402
from gpumem.allocator.policy import get_policy  # noqa: E402
from gpumem.replay import replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402
from gpumem.units import GiB, MiB  # noqa: E402

PAGE_NBYTES = 2 * MiB
BINDING_US = 0.78
"""The calibration's ``null_call``: the Python binding's own cost, taken off every measured figure."""
CREATE_US = {2 * MiB: 13.97, 32 * MiB: 13.61, 256 * MiB: 22.26, 1 * GiB: 118.39}
RELEASE_US = {2 * MiB: 14.90, 32 * MiB: 31.33, 256 * MiB: 161.33, 1 * GiB: 585.99}
MAP_US = {2 * MiB: 3.22, 64 * MiB: 2.94}
SET_ACCESS_US = (36.14, 983.73, 46.80)
"""``cuMemSetAccess`` over one page, over 32 one-page mappings, over one 64 MiB mapping (µs)."""
UNMAP_US = (22.83, 659.86, 28.25)
"""``cuMemUnmap`` over one page, over 32 one-page mappings, over one 64 MiB mapping (µs)."""
EVENT_US = {"event_record": 1.15 + 1.68 - BINDING_US, "event_query": 1.34, "event_synchronize": 1.81,
            "event_destroy": 1.47}
"""Medians of cuEventCreate + cuEventRecord, cuEventQuery, cuEventSynchronize (idle), cuEventDestroy (µs)."""


def interpolate_us(table: dict[int, float], nbytes: int) -> float:
    """The measured median for ``nbytes`` (linear between measured sizes, the nearest segment's slope
    outside them, never below the smallest figure), less the binding's overhead."""
    sizes = sorted(table)
    lo, hi = sizes[0], sizes[1]
    for a, b in zip(sizes, sizes[1:]):
        lo, hi = a, b
        if nbytes <= b:
            break
    us = table[lo] + (table[hi] - table[lo]) * (nbytes - lo) / (hi - lo)
    return max(us, min(table.values())) - BINDING_US


def fit_per_mapping(one_page_us: float, pages32_us: float, one_64mib_us: float) -> tuple[float, float, float]:
    """``(per call, per mapping, per MiB)`` µs, fitted exactly to a call over one page, over 32
    one-page mappings and over one 64 MiB mapping (less the binding's overhead)."""
    a, b, c = (x - BINDING_US for x in (one_page_us, pages32_us, one_64mib_us))
    per_mib = (c - a) / 62  # one mapping of 64 MiB vs one of 2 MiB
    per_mapping = (b - a - 62 * per_mib) / 31  # 32 mappings (64 MiB) vs one of 2 MiB
    return a - per_mapping - 2 * per_mib, per_mapping, per_mib


SET_ACCESS_FIT = fit_per_mapping(*SET_ACCESS_US)
UNMAP_FIT = fit_per_mapping(*UNMAP_US)
KINDS = ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release", "events")


def call_cost_us(kind: str, nbytes: int, n_mappings: int = 1) -> float:
    """Modelled H200 cost of one call of ``kind`` over ``nbytes`` (``n_mappings`` mappings for
    ``mem_set_access`` and ``mem_unmap``), Note [Modelled driver costs]."""
    if kind == "mem_create":
        return interpolate_us(CREATE_US, nbytes)
    if kind == "mem_release":
        return interpolate_us(RELEASE_US, nbytes)
    if kind == "mem_map":
        return interpolate_us(MAP_US, nbytes)
    if kind in ("mem_set_access", "mem_unmap"):
        per_call, per_mapping, per_mib = SET_ACCESS_FIT if kind == "mem_set_access" else UNMAP_FIT
        return per_call + per_mapping * n_mappings + per_mib * nbytes / MiB
    if kind in EVENT_US:
        return EVENT_US[kind] - BINDING_US
    raise ValueError(f"no modelled cost for {kind!r}")


#: name -> (policy knobs on top of the default policy, what it is)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "pages": ({"growth": "pages", "page_slack": 0.0},
              "before issue 7: one-page chunks, an empty page stolen before a chunk is created"),
    "pages+slack": ({"growth": "pages"},
                    "one-page chunks, created (not stolen) up to 0.5 % above the most pages ever touched"),
    "runs": ({"chunk_max_fraction": 1.0, "grow_ahead_fraction": 0.0},
             "one chunk per run of pages a block needs (uncapped), slack 0.5 %"),
    "runs<=32MiB": ({"chunk_max_fraction": 1.0, "chunk_max_nbytes": 32 << 20, "grow_ahead_fraction": 0.0},
                    "runs capped at 32 MiB, slack 0.5 %"),
    "chunks/64": ({"chunk_max_fraction": 1 / 64, "grow_ahead_fraction": 0.004},
                  "runs capped at 1/64 of the memory held, slack 0.5 %, grown ahead at the top to 0.4 % of held"),
    "chunks/128": ({"chunk_max_fraction": 1 / 128, "grow_ahead_fraction": 0.004},
                   "as chunks/64, capped at 1/128 of held"),
    "chunks+ahead": ({"grow_ahead_fraction": 0.004}, "as chunks/64, capped at 1/256 of held"),
    "chunks": ({}, "the default: runs capped at 1/256 of held, slack 0.5 %, never grown ahead"),
    "chunks/128-noahead": ({"chunk_max_fraction": 1 / 128}, "as chunks, capped at 1/128 of held"),
    "chunks/192-noahead": ({"chunk_max_fraction": 1 / 192}, "as chunks, capped at 1/192 of held"),
    "chunks-slack0.3": ({"page_slack": 0.003, "grow_ahead_fraction": 0.002},
                        "capped at 1/256, slack 0.3 %, grown ahead to 0.2 %"),
    "chunks/1024": ({"chunk_max_fraction": 1 / 1024, "grow_ahead_fraction": 0.004},
                    "as chunks/64, capped at 1/1024 of held"),
}


class CallCounter:
    """Counts a device's VMM and event calls (wraps its public methods on the instance)."""

    def __init__(self, device: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.cost_us = 0.0
        self.pages: Counter[str] = Counter()
        self._maps: dict[int, int] = {}
        """va -> nbytes of every mapping made through the device (to count those an access call covers)."""
        for kind in ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release",
                     "event_record", "event_query", "event_synchronize", "event_destroy"):
            setattr(device, kind, self._wrap(getattr(device, kind), kind))

    def _wrap(self, fn: Any, kind: str) -> Any:
        counts, pages = self.counts, self.pages
        size_arg = {"mem_create": 0, "mem_map": 1, "mem_set_access": 1, "mem_unmap": 1}.get(kind)

        def wrapper(*args: Any) -> Any:
            result = fn(*args)
            if size_arg is not None:
                nbytes = args[size_arg]
            elif kind == "mem_release":
                nbytes = args[0].nbytes
            else:
                nbytes = 0
            key = "events" if kind.startswith("event_") else kind
            counts[key] += 1
            pages[key] += nbytes // PAGE_NBYTES
            n_mappings = 1
            if kind == "mem_map":
                self._maps[args[0]] = nbytes
            elif kind == "mem_unmap":
                va, end, n_mappings = args[0], args[0] + nbytes, 0
                while va < end:
                    va += self._maps.pop(va)
                    n_mappings += 1
            elif kind == "mem_set_access":
                va, end, n_mappings = args[0], args[0] + nbytes, 0
                while va < end:
                    va += self._maps[va]
                    n_mappings += 1
            self.cost_us += call_cost_us(kind, nbytes, n_mappings)
            return result

        return wrapper


def run_variant(trace: Any, knobs: dict[str, Any], device_spec: str, engine: str | None = None) -> dict[str, Any]:
    """Replay ``trace`` under the default policy with ``knobs``; return calls, cost and overhead. Both
    engines make the same device calls (tests/allocator/test_native_differential.py): the native one
    only replays faster."""
    policy = dataclasses.replace(get_policy("gpumem"), name="sweep", **knobs)
    dev = open_device(device_spec)
    counter = CallCounter(dev)
    alloc = CachingAllocator(dev, policy, engine=engine)
    result = replay(trace, alloc, progress=False, gpu_timing="idle")
    alloc.check_consistency()
    return {
        "ops": result.n_ops,
        "calls": dict(counter.counts),
        "pages": dict(counter.pages),
        "driver_us": counter.cost_us,
        "driver_us_per_op": counter.cost_us / result.n_ops,
        "overhead": result.overhead,
        "peak_reserved_nbytes": result.peak_reserved_bytes,
        "peak_live_nbytes": result.peak_live_bytes,
    }


def engine_table(traces: list[Any], device_spec: str, rounds: int) -> str:
    """Wall time per op of a replay (``gpumem.replay.replay``, as ``gpumem replay`` runs it) with the
    Python and the native engine, under the default policy and ``growth=PAGES`` with no slack, best of
    ``rounds`` interleaved runs each (the simulated device's own cost included); the device calls
    must be the same in both engines."""
    import gc
    import time

    pages = {"growth": "pages", "page_slack": 0.0}
    out = ["| trace | ops | policy | python ns/op | native ns/op | speedup | VMM calls/op | event calls/op | overhead |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for trace in traces:
        for label, knobs in (("chunks (default)", {}), ("pages, slack 0", pages)):
            policy = dataclasses.replace(get_policy("gpumem"), name="sweep", **knobs)
            best: dict[str, tuple[float, Any]] = {}
            for _ in range(rounds):
                for engine in ("python", "native"):
                    dev = open_device(device_spec)
                    alloc = CachingAllocator(dev, policy, engine=engine)
                    gc.collect()
                    t0 = time.perf_counter()
                    result = replay(trace, alloc, progress=False, gpu_timing="idle")
                    wall_s = time.perf_counter() - t0
                    alloc.close()
                    if engine not in best or wall_s < best[engine][0]:
                        best[engine] = (wall_s, result)
            (py_s, py), (nat_s, nat) = best["python"], best["native"]
            if (py.stats.device_calls, py.stats.event_calls) != (nat.stats.device_calls, nat.stats.event_calls):
                raise SystemExit(f"{trace.name}: the engines made different device calls")
            n = py.n_ops
            out.append(f"| {trace.name} | {n:,} | {label} | {py_s / n * 1e9:,.0f} | {nat_s / n * 1e9:,.0f} | "
                       f"{py_s / nat_s:.1f}x | {py.stats.device_calls / n:.4f} | {py.stats.event_calls / n:.4f} | "
                       f"{py.overhead:.2%} |")
    return "\n".join(out)


def trace_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and (".trace." in p.name or ".snapshot." in p.name))
    if not files:
        raise SystemExit(f"no trace files in {folder}")
    return files


def table(name: str, about: str, rows: dict[str, dict[str, Any]]) -> str:
    out = [f"### {name}", "", about, "",
           "| trace | ops | " + " | ".join(KINDS) + " | calls/op | driver µs/op | overhead |",
           "|---|---:|" + "---:|" * (len(KINDS) + 3)]
    for trace, r in rows.items():
        calls = r["calls"]
        total = sum(calls.values())
        out.append(f"| {trace} | {r['ops']:,} | " + " | ".join(f"{calls.get(k, 0):,}" for k in KINDS)
                   + f" | {total / r['ops']:.4f} | {r['driver_us_per_op']:.3f} | {r['overhead']:.2%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.growth_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=REPO / "data" / "traces")
    ap.add_argument("--device", default="sim:h200-141gb")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of " + ", ".join(VARIANTS))
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--engine", choices=("python", "native"), default=None,
                    help="the allocator engine (default: the allocator's own choice)")
    ap.add_argument("--engines", type=int, metavar="ROUNDS", default=0,
                    help="instead of the sweep: time replays with both engines, best of ROUNDS each")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    traces = [load_trace(p) for p in trace_files(args.traces)]
    if args.engines:
        print("### Wall time per op, Python vs native engine\n")
        print(engine_table(traces, args.device, args.engines))
        return 0
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        knobs, about = VARIANTS[name]
        results[name] = {t.name: run_variant(t, knobs, args.device, args.engine) for t in traces}
        print(table(name, about, results[name]), "\n", flush=True)
    tnames = [t.name for t in traces]
    print("### Summary: driver µs per op (overhead)\n")
    print("| variant | " + " | ".join(tnames) + " |")
    print("|---|" + "---:|" * len(tnames))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[name][t]['driver_us_per_op']:.3f} ({results[name][t]['overhead']:.2%})"
                                          for t in tnames) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
