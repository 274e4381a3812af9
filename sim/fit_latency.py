"""Fit the simulator's device-call latencies to several calibrations of one GPU, and show their spread.

::

    python -m sim.fit_latency reports/hil/calibrate-h200-2026-11-22.json reports/hil/hil-nvidia-h200-2026-11-22.json ...

Each file is either a calibration record (``python -m sim.calibrate --out``, with ``costs_us``)
or a HIL record / fidelity JSON whose fidelity part holds the calibration it measured (``calibration``) or,
in older records, only its latency rows. Every call is put on the model's footing (Note [Latency
calibration]: the binding's own cost taken off driver calls) by :func:`hil.fidelity.compare_latency`.

It prints, per call, every run's figure, their geometric mean (what the model should hold: the ratio to
the farthest run is then as small as it can be), the spread (largest / smallest) and the model's figure
now, and then the linear fits of ``cuMemSetAccess`` and ``cuMemUnmap`` (per call, per mapping, per MiB)
through the geometric means. A spread above 4x means no single figure is within 2x of every run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hil.fidelity import LATENCY_FACTOR, compare_latency

_MIB = 1 << 20


def rows_of(path: Path) -> dict[str, float]:
    """``call -> measured µs`` (on the model's footing) of one file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if "costs_us" in data:
        return {r.call: r.measured_us for r in compare_latency(data)}
    for result in data.get("results", {}).values():  # a HIL record: its fidelity part
        data = result.get("fidelity") or {}
        break
    if data.get("calibration", {}).get("costs_us"):
        return {r.call: r.measured_us for r in compare_latency(data["calibration"])}
    if data.get("latency"):
        return {r["call"]: float(r["measured_us"]) for r in data["latency"]}
    raise ValueError(f"{path}: neither a calibration (costs_us) nor a record with fidelity latency rows")


def solve3(points: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """``a + b k + c n = cost`` through three ``(k mappings, n MiB, cost)`` points (exactly)."""
    import numpy as np

    m = np.array([[1.0, k, n] for k, n, _ in points])
    a, b, c = np.linalg.solve(m, np.array([cost for _, _, cost in points]))
    return float(a), float(b), float(c)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.fit_latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="calibration records or HIL records")
    args = parser.parse_args(argv)
    try:
        runs = [rows_of(p) for p in args.files]
    except (OSError, ValueError) as exc:
        print(f"fit_latency: {exc}", file=sys.stderr)
        return 2
    from hil.fidelity import _model_costs
    from gpumem.sim.latency import LatencyModel

    model = _model_costs(LatencyModel())
    model["cuEventCreate+cuEventRecord"] = LatencyModel().event_record_us
    calls = [c for c in runs[0] if all(c in r for r in runs)]
    means: dict[str, float] = {}
    print("| call | " + " | ".join(p.name[:28] for p in args.files) + " | geometric mean | spread | model now |")
    print("|---|" + "---|" * (len(args.files) + 3))
    for call in calls:
        values = [r[call] for r in runs]
        gm = math.exp(sum(math.log(max(v, 1e-3)) for v in values) / len(values))
        means[call] = gm
        spread = max(values) / min(values)
        flag = " (no figure within 2x of all)" if spread > LATENCY_FACTOR ** 2 else ""
        print(f"| {call} | " + " | ".join(f"{v:.2f}" for v in values)
              + f" | {gm:.2f} | {spread:.2f}x{flag} | {model.get(call, float('nan')):.2f} |")
    for name in ("cuMemSetAccess", "cuMemUnmap"):
        keys = (f"{name}_1page", f"{name}_32maps", f"{name}_64MiB_1map")
        if all(k in means for k in keys):
            a, b, c = solve3([(1, 2, means[keys[0]]), (32, 64, means[keys[1]]), (1, 64, means[keys[2]])])
            print(f"{name}: {a:.2f} + {b:.2f} k + {c:.4f} n µs (k mappings, n MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
