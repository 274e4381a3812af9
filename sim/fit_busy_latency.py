"""Fit the busy-device terms of the simulator's latency model to the VMM probe, and check them on the rest.

Note [A busy device prices VMM calls higher] in :mod:`gpumem.sim.latency`. The probe
(``python -m hil.probes.vmm_stall``, ``reports/hil/vmm-stall-h200-2026-11-25/``) timed each VMM call idle and
with 20 ms of work queued, holding a handful of mappings (``vmm-stall.json``: queues ``one``, ``deep``,
``streams``), 1,000 (``vmm-stall-held1000.json``) or 3,000 (``vmm-stall-held3000.json``). The busy/idle
ratio of a call's medians is what the model applies to its idle cost.

* **Fit part**: the ``one`` queue with a handful held (taken as ``--few-mappings``, 2) and with 3,000 held;
  per level the geometric mean of the busy/idle ratios of the steal and of the five calls an allocator makes
  (unmap of an untouched mapping, map, set access, create, release); the line in ``log10(1 + n)`` through
  the two points gives ``busy_factor_base`` and ``busy_factor_per_decade``.
* **Check part**: the 1,000-held run (``one`` queue) and the ``deep`` and ``streams`` queues with a handful;
  every row's measured ratio against the model's, and the steal's busy time in µs against the model's idle
  steal (unmap + map + set access of one 2 MiB page) times the factor.

    python -m sim.fit_busy_latency [--dir reports/hil/vmm-stall-h200-2026-11-25] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from gpumem.sim.latency import LatencyModel
from gpumem.units import MiB

DIR = Path("reports/hil/vmm-stall-h200-2026-11-25")
#: the calls the factor is fitted over: a steal and the five an allocator makes
FIT_CALLS = ("steal", "unmap_untouched", "map", "set_access", "create", "release")


@dataclass(frozen=True)
class Level:
    """One set of probe rows: a file, its queue shape and the mappings it held."""

    part: str
    file: str
    queue: str
    n_mappings: int


def levels(few: int) -> list[Level]:
    return [Level("fit", "vmm-stall.json", "one", few), Level("fit", "vmm-stall-held3000.json", "one", 3000),
            Level("check", "vmm-stall-held1000.json", "one", 1000), Level("check", "vmm-stall.json", "deep", few),
            Level("check", "vmm-stall.json", "streams", few)]


def ratios(directory: Path, level: Level) -> dict[str, tuple[float, float]]:
    """``call -> (idle median µs, busy median µs)`` of one level."""
    rows = json.loads((directory / level.file).read_text(encoding="utf-8"))["rows"]
    return {r["call"]: (r["idle_median_us"], r["busy_median_us"]) for r in rows if r["queue"] == level.queue}


def geomean_ratio(rows: dict[str, tuple[float, float]]) -> float:
    return math.exp(sum(math.log(rows[c][1] / rows[c][0]) for c in FIT_CALLS) / len(FIT_CALLS))


def fit(directory: Path, few: int) -> tuple[float, float]:
    """``(busy_factor_base, busy_factor_per_decade)`` through the fit part's two levels."""
    (lo, hi) = [lv for lv in levels(few) if lv.part == "fit"]
    x0, x1 = math.log10(1 + lo.n_mappings), math.log10(1 + hi.n_mappings)
    y0, y1 = geomean_ratio(ratios(directory, lo)), geomean_ratio(ratios(directory, hi))
    per_decade = (y1 - y0) / (x1 - x0)
    return y0 - per_decade * x0, per_decade


def idle_steal_us(lat: LatencyModel) -> float:
    """The model's idle steal of one 2 MiB page: unmap + map + set access."""
    return lat.mem_unmap_cost_us(1, 2 * MiB) + lat.mem_map_us + lat.mem_set_access_cost_us(1, 2 * MiB)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.fit_busy_latency", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DIR, help="the probe's records")
    p.add_argument("--few-mappings", type=int, default=2, help="mappings the probe held without --held-mappings")
    p.add_argument("--json", type=Path, help="write the fit and every row here")
    args = p.parse_args(argv)
    base, per_decade = fit(args.dir, args.few_mappings)
    lat = LatencyModel.as_measured()
    print(f"fit: busy_factor_base {base:.3f}, busy_factor_per_decade {per_decade:.3f} "
          f"(LatencyModel.as_measured() holds {lat.busy_factor_base}, {lat.busy_factor_per_decade})\n")
    model = LatencyModel(busy_factor_base=round(base, 2), busy_factor_per_decade=round(per_decade, 2))
    out = {"busy_factor_base": base, "busy_factor_per_decade": per_decade, "rows": []}
    print("| part | run | queue | mappings held | call | idle µs | busy µs | measured busy/idle | model | "
          "model / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lv in levels(args.few_mappings):
        rows = ratios(args.dir, lv)
        f = model.busy_factor(lv.n_mappings)
        for call in FIT_CALLS + ("geomean",):
            if call == "geomean":
                idle = busy = float("nan")
                measured = geomean_ratio(rows)
            else:
                idle, busy = rows[call]
                measured = busy / idle
            out["rows"].append({"part": lv.part, "file": lv.file, "queue": lv.queue, "n_mappings": lv.n_mappings,
                                "call": call, "idle_us": idle, "busy_us": busy, "measured": measured, "model": f})
            cells = "| | |" if call == "geomean" else f"| {idle:.1f} | {busy:.1f} |"
            print(f"| {lv.part} | {lv.file.removesuffix('.json')} | {lv.queue} | {lv.n_mappings:,} | "
                  f"{'**geometric mean**' if call == 'geomean' else call} {cells} {measured:.2f} | {f:.2f} | "
                  f"{f / measured:.2f} |")
    steal = idle_steal_us(model)
    print(f"\nthe model's idle steal (one 2 MiB page): {steal:.1f} µs\n")
    print("| part | run | queue | mappings held | probe steal busy µs | model µs | model / probe |")
    print("|---|---|---|---|---|---|---|")
    for lv in levels(args.few_mappings):
        busy = ratios(args.dir, lv)["steal"][1]
        m = steal * model.busy_factor(lv.n_mappings)
        print(f"| {lv.part} | {lv.file.removesuffix('.json')} | {lv.queue} | {lv.n_mappings:,} | {busy:.1f} | "
              f"{m:.1f} | {m / busy:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
