"""Sweep how the virtual-memory backing grows and moves physical memory, by replaying real traces.

For each variant of the growth/move policy (a set of :class:`~gpumem.allocator.policy.AllocatorPolicy`
knobs) every trace in ``--traces DIR`` (default: the project's ``data/traces``) is replayed on a
simulated device (default ``sim:h200-141gb``) while the device calls the allocator makes are counted
by kind. The script prints one table per variant: calls per trace by kind, the modelled driver time
per operation on the H200 (:data:`H200_COSTS_US`, below) and the overhead (peak reserved / peak live
- 1), then a summary table of every variant.

Note [Modelled driver costs]
----------------------------
Measured on the H200 (issue 7, single runs): ``cuMemCreate`` of one 2 MiB page 14.6 µs, ``cuMemMap``
3.0 µs, ``cuMemSetAccess`` 38 µs over one page and 186 µs in one call over 32 one-page mappings,
``cuMemUnmap`` 23.6 µs, ``cuMemRelease`` 15.6 µs, an event's record + query + destroy 5.6 µs together.
What was not measured is assumed, and said so:

* ``cuMemCreate`` grows with the size (ASSUMPTION): 14.6 µs for the first 2 MiB plus
  :data:`CREATE_US_PER_GIB` per further GiB. The slope is taken from ``cudaMalloc`` on the same H200
  (``reports/anchors.md``: a malloc + free pair costs 153 µs at 64 MiB and 838 µs at 1 GiB, 0.71 µs per
  MiB; the simulator gives the malloc 60 % of a pair), i.e. about 440 µs per GiB: physical memory
  costs the driver the same per byte whichever call takes it.
* ``cuMemSetAccess`` grows by (186 - 38) / 31 = 4.8 µs per further *mapping* in its range (that is
  what was measured: 32 one-page mappings); a multi-page mapping is assumed to cost as one mapping
  (ASSUMPTION: not measured).
* ``cuMemMap``, ``cuMemUnmap`` and ``cuMemRelease`` cost the same whatever the size (ASSUMPTION: only
  2 MiB was measured; a mapping is one page-table update of its range).
* events: record, query and destroy 5.6 / 3 µs each, ``event_synchronize`` as a query (the wait
  itself is GPU time, not driver overhead).

Usage::

    python benchmarks/growth_sweep.py [--traces DIR] [--device SPEC] [--variants NAME,...] [--json OUT]
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
CREATE_US_PER_GIB = 440.0
"""Assumed growth of ``cuMemCreate`` with size (Note [Modelled driver costs])."""
SET_ACCESS_US_PER_MAPPING = (186.0 - 38.0) / 31
H200_COSTS_US: dict[str, float] = {
    "mem_create": 14.6,
    "mem_map": 3.0,
    "mem_set_access": 38.0,
    "mem_unmap": 23.6,
    "mem_release": 15.6,
    "event_record": 5.6 / 3,
    "event_query": 5.6 / 3,
    "event_synchronize": 5.6 / 3,
    "event_destroy": 5.6 / 3,
}
"""Cost of one call of a page (2 MiB) on the H200, microseconds (Note [Modelled driver costs])."""
KINDS = ("mem_create", "mem_map", "mem_set_access", "mem_unmap", "mem_release", "events")


def call_cost_us(kind: str, nbytes: int, n_mappings: int = 1) -> float:
    """Modelled H200 cost of one call of ``kind`` over ``nbytes`` (``n_mappings`` mappings for
    ``mem_set_access``), Note [Modelled driver costs]."""
    base = H200_COSTS_US[kind]
    if kind == "mem_create":
        return base + CREATE_US_PER_GIB * max(0, nbytes - PAGE_NBYTES) / GiB
    if kind == "mem_set_access":
        return base + SET_ACCESS_US_PER_MAPPING * max(0, n_mappings - 1)
    return base


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
                va, end = args[0], args[0] + nbytes
                while va < end:
                    va += self._maps.pop(va)
            elif kind == "mem_set_access":
                va, end, n_mappings = args[0], args[0] + nbytes, 0
                while va < end:
                    va += self._maps[va]
                    n_mappings += 1
            self.cost_us += call_cost_us(kind, nbytes, n_mappings)
            return result

        return wrapper


def run_variant(trace: Any, knobs: dict[str, Any], device_spec: str) -> dict[str, Any]:
    """Replay ``trace`` under the default policy with ``knobs``; return calls, cost and overhead."""
    policy = dataclasses.replace(get_policy("gpumem"), name="sweep", **knobs)
    dev = open_device(device_spec)
    counter = CallCounter(dev)
    alloc = CachingAllocator(dev, policy)
    result = replay(trace, alloc, progress=False)
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=REPO / "data" / "traces")
    ap.add_argument("--device", default="sim:h200-141gb")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of " + ", ".join(VARIANTS))
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    traces = [load_trace(p) for p in trace_files(args.traces)]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        knobs, about = VARIANTS[name]
        results[name] = {t.name: run_variant(t, knobs, args.device) for t in traces}
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
