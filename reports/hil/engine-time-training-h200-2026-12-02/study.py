"""The tables of ``reports/hil/engine-time-training-h200-2026-12-02.md`` (simulator and call logs, this machine's CPU)::

    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py cold      # the cold term, seconds
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py maps      # seconds
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py replays   # ~8 min, 2 processes
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py trace     # ~15 min
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py repeat    # ~1 min
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py policies  # ~1 min
    PYTHONPATH=. python reports/hil/engine-time-training-h200-2026-12-02/study.py steps     # seconds

``cold`` reads the compact call logs of the tuning runs (the four ``ct-`` servers of
``where-replays-part-2026-11-30`` and this record's GPT-2, MoE and ResNet-50 without step plans), takes each VMM
call's time less the run's median for that call made within 5 µs of the previous VMM call, and fits ``k * ln(1 +
gap / g)`` to it (least absolute error, each run weighed alike); the check run (Llama with variable lengths) is
tabled beside it. ``maps`` tables a map's time right after a create by the create's gap. ``replays`` replays every
shipped trace that has its GPU clock and live reserves on its clock, under each of :data:`MODELS`, and tables live
against predicted overhead by part. ``trace`` replays the scored rows
of ``python -m sim.predict_live`` under ``trace`` and ``model`` timing with and without the cold term. ``repeat``
replays the runs repeated after the decisions (``run/repeat``), ``policies`` every clocked run of Llama with variable
lengths under two policy knobs (a what-if), ``steps`` their step times from the traces' step marks.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import sys
from multiprocessing import Pool

import numpy as np

from gpumem.replay_compare import compare_live
from gpumem.sim import SimDevice, get_profile
from gpumem.sim.latency import MEASURED_COLD_VMM_US, LatencyModel

#: The models replayed: the shipped one, the cold term on the shipped unmap price (38.7 µs, the in-program median
#: of warm and cold unmaps together, so cold unmaps are priced twice), and the term with the unmap at its warm
#: in-program price (30.2 µs: the median of the tuning runs' warm-unmap medians), the model the logs give.
MODELS = {"shipped": LatencyModel(), "cold term": LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US),
          "cold term, warm unmap": LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US, mem_unmap_mapping_us=30.2)}
from gpumem.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
HIL = os.path.dirname(HERE)
RUN = os.path.join(HERE, "run")
W = os.path.join(HIL, "where-replays-part-2026-11-30")
VMM = ("cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemRelease")
FITTED = ("cuMemCreate", "cuMemUnmap", "cuMemMap", "cuMemRelease")
TUNING = ([(os.path.join(W, f"calls-{r}.tsv.gz"), os.path.join(W, f"ct-{r}.gmt.gz"))
           for r in ("a-b16", "a-b12", "b-b16", "b-b20")]
          + [(os.path.join(RUN, f"calls-{r}.tsv.gz"), os.path.join(RUN, r, f"{w}.gpumem.gmt.gz"))
             for r, w in (("gpt2", "gpt2_train"), ("moe", "moe_train"), ("resnet", "resnet50_train"))])
CHECK = [(os.path.join(RUN, "calls-varlen.tsv.gz"), os.path.join(RUN, "varlen", "llama_varlen_train.gpumem.gmt.gz"))]
EDGES = (0, 5, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, np.inf)


def _read_log(calls: str, trace: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A compact call log's names, starts (µs, on the trace's clock: the op's time plus the offset) and lengths."""
    tr = load_trace(trace, progress=False)
    with gzip.open(calls, "rt") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    op = np.array([int(r[0]) for r in rows])
    name = np.array([r[1] for r in rows])
    start = tr.times_us[np.minimum(op, len(tr.times_us) - 1)] + np.array([float(r[2]) for r in rows])
    return name, start, np.array([float(r[3]) for r in rows])


def _extras(calls: str, trace: str) -> tuple[np.ndarray, np.ndarray]:
    """Per VMM call of :data:`FITTED`: the gap since the previous VMM call ended (µs) and its time less the run's
    warm median of that call."""
    name, start, dur = _read_log(calls, trace)
    idx = np.flatnonzero(np.isin(name, VMM))
    gap = np.full(len(name), np.nan)
    gap[idx[1:]] = np.maximum(start[idx[1:]] - (start[idx[:-1]] + dur[idx[:-1]]), 0.0)
    gaps, extra = [], []
    for n in FITTED:
        m = (name == n) & ~np.isnan(gap)
        warm = m & (gap < 5)
        if warm.sum() >= 5:
            gaps.append(gap[m])
            extra.append(dur[m] - np.median(dur[warm]))
    return np.concatenate(gaps), np.concatenate(extra)


def _pool(runs):
    parts = [_extras(c, t) for c, t in runs]
    g = np.concatenate([p[0] for p in parts])
    x = np.concatenate([p[1] for p in parts])
    w = np.concatenate([np.full(len(p[0]), 1.0 / len(p[0])) for p in parts])
    return g, x, w


def cold() -> None:
    g, x, w = _pool(TUNING)
    best = min((float(np.sum(w * np.abs(x - k * np.log1p(g / g0)))), float(k), g0)
               for g0 in (10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000) for k in np.arange(2, 40, 0.25))
    _, k, g0 = best
    print(f"fit on the tuning logs: extra = {k:g} µs * ln(1 + gap / {g0:g} µs)\n")
    gc, xc, _ = _pool(CHECK)
    print("| gap since the previous VMM call | tuning: calls | extra, median | model | check: calls | extra, median "
          "| model |\n|---|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(EDGES[:-1], EDGES[1:]):
        cells = []
        for gg, xx in ((g, x), (gc, xc)):
            s = (gg >= a) & (gg < b)
            cells += ([f"{s.sum():,}", f"{np.median(xx[s]):.1f} µs", f"{np.median(k * np.log1p(gg[s] / g0)):.1f} µs"]
                      if s.sum() >= 5 else ["", "", ""])
        print(f"| {a:g}-{b:g} µs | " + " | ".join(cells) + " |")
    warm = []
    for calls, trace in TUNING:
        name, start, dur = _read_log(calls, trace)
        idx = np.flatnonzero(np.isin(name, VMM))
        u = idx[1:][(name[idx[1:]] == "cuMemUnmap") & (start[idx[1:]] - (start[idx[:-1]] + dur[idx[:-1]]) < 5)]
        warm.append((os.path.basename(calls), len(u), float(np.median(dur[u])) if len(u) else float("nan")))
    print("warm unmaps (within 5 µs of the previous VMM call), per tuning log: "
          + ", ".join(f"{n} {c} at {m:.1f} µs" for n, c, m in warm)
          + f"; median of those with 5 or more: {np.median([m for _, c, m in warm if c >= 5]):.1f} µs")
    for label, (gg, xx) in (("tuning", (g, x)), ("check", (gc, xc))):
        s = gg >= 5
        err_us = np.median(np.abs(xx[s] - k * np.log1p(gg[s] / g0)))
        print(f"{label}, calls 5 µs or more after the previous: median |error| {err_us:.1f} µs "
              f"with the term, {np.median(np.abs(xx[s])):.1f} without")


def maps() -> None:
    """How long a ``cuMemMap`` right after a ``cuMemCreate`` takes, by that create's gap since the VMM call before."""
    print("| log | map after a create made within 5 µs | 5-500 µs | 0.5-5 ms | 5 ms or more |\n|---|---|---|---|---|")
    for calls, trace in TUNING + CHECK:
        name, start, dur = _read_log(calls, trace)
        idx = np.flatnonzero(np.isin(name, VMM))
        pairs = [(start[j] - (start[h] + dur[h]), dur[i]) for h, j, i in zip(idx, idx[1:], idx[2:])
                 if name[i] == "cuMemMap" and name[j] == "cuMemCreate"]
        gap, map_us = np.array(pairs).T
        cells = []
        for lo, hi in ((0, 5), (5, 500), (500, 5000), (5000, np.inf)):
            s = (gap >= lo) & (gap < hi)
            cells.append(f"{s.sum():,}: {np.median(map_us[s]):.1f} µs (p90 {np.percentile(map_us[s], 90):.1f})"
                         if s.sum() else "")
        print(f"| {os.path.basename(calls)} | " + " | ".join(cells) + " |")


def _clock_traces() -> list[str]:
    out = []
    for f in sorted(glob.glob(os.path.join(HIL, "**", "*.gmt.gz"), recursive=True)):
        with gzip.open(f, "rt") as fh:
            h = json.loads(fh.readline())
        if h.get("version") == 6 and h.get("gpu_clock") is True and "multistream" not in f:
            out.append(f)
    return out


def _part(f: str) -> str:
    """The tuning rows: the ``ct-`` servers (whose call logs fitted the term), this record's GPT-2, MoE and ResNet-50,
    and the tuning workloads' traces (GPT-2, bf16 GPT-2, ResNet-50, MoE training); the rest check."""
    tuning = ("where-replays-part" in f or ("engine-time-training" in f and "varlen" not in f)
              or ("workloads-today" in f and ("gpt2_train_bf16" in f or "moe_train" in f))
              or ("live-reserve" in f and ("gpt2_train" in f or "resnet50" in f)))
    return "tuning" if tuning else "check"


def _by_trace(fn, jobs: list[tuple[str, str]]) -> dict[str, dict[str, tuple[float, float]]]:
    """``fn`` over ``jobs`` (``(trace, variant)``) in two processes, its ``(trace, variant, a, b)`` results as
    trace -> variant -> ``(a, b)``."""
    with Pool(2) as pool:
        got = pool.map(fn, jobs)
    by: dict[str, dict[str, tuple[float, float]]] = {}
    for f, key, a, b in got:
        by.setdefault(f, {})[key] = (a, b)
    return by


def _replay(args: tuple[str, str]) -> tuple[str, str, float, float]:
    f, model = args
    dev = SimDevice(dataclasses.replace(get_profile("h200-141gb"), latency=MODELS[model]))
    c = compare_live(load_trace(f, progress=False), dev, gpu_timing="gpu-clock")
    peak = c.result.peak_live_bytes
    return f, model, 100 * (c.live_peak_reserved_nbytes / peak - 1), 100 * (c.replayed_peak_reserved_nbytes / peak - 1)


def replays() -> None:
    by = _by_trace(_replay, [(f, m) for f in _clock_traces() for m in MODELS])
    print("| trace | part | live | " + " | ".join(MODELS) + " |\n|---|---|---:|" + "---:|" * len(MODELS))
    for f, v in by.items():
        live = v["shipped"][0]
        print(f"| {os.path.relpath(f, HIL)} | {_part(f)} | {live:.2f} % | "
              + " | ".join(f"{v[m][1]:.2f} % ({v[m][1] - live:+.2f})" for m in MODELS) + " |")
    for part in ("tuning", "check"):
        for m in MODELS:
            e = [abs(v[m][1] - v[m][0]) for f, v in by.items() if _part(f) == part]
            print(f"{part}, {m}: {len(e)} rows, mean |error| {np.mean(e):.3f} pp, worst {max(e):.2f}, "
                  f"within 1 pp {sum(x <= 1 for x in e)}, within 0.5 pp {sum(x <= 0.5 for x in e)}")


def _trace_row(args):
    """One scored row of ``python -m sim.predict_live``: its part and (candidate label, |error| in points) pairs."""
    import sim.predict_live as pl   # noqa: E402 - the repository's sim/ package

    row, cands = args
    pl.LATENCIES["cold term"] = MODELS["cold term"]
    trace = load_trace(row.trace, progress=False)
    policy = pl.LIVE_POLICIES[row.policy]
    return row.part, [(c.label, abs(pl._replay(trace, policy, c) - row.live) * 100) for c in cands]   # noqa: SLF001


def trace_timing() -> None:
    """The scored live rows of ``python -m sim.predict_live`` under the default ``trace`` timing and under ``model``,
    each with the shipped latency model and with the cold term."""
    import sim.predict_live as pl   # noqa: E402 - the repository's sim/ package (run from the repository's root)

    cands = [pl.Candidate("trace", lat, 2.0) for lat in ("idle-priced", "cold term")]
    cands += [pl.Candidate("model", lat) for lat in ("idle-priced", "cold term")]
    rows = [r for r in pl.live_rows() if r.not_scored is None]
    errs: dict[tuple[str, str], list[float]] = {}
    with Pool(2) as pool:
        for part, got in pool.map(_trace_row, [(r, cands) for r in rows]):
            for label, e in got:
                errs.setdefault((part, label), []).append(e)
    for (part, label), e in sorted(errs.items()):
        print(f"{part}, {label}: {len(e)} rows, mean |error| {np.mean(e):.3f} pp, worst {max(e):.2f}")


VARLEN = sorted(glob.glob(os.path.join(RUN, "repeat", "v*", "*.gmt.gz"))) + [
    os.path.join(RUN, "varlen", "llama_varlen_train.gpumem.gmt.gz"),
    os.path.join(HIL, "check-gpu-clock-h200-2026-12-02", "run", "llama_varlen_train.gpumem.gmt.gz"),
    os.path.join(HIL, "workloads-today-h200-2026-11-30", "run-a", "llama_varlen_train.gpumem.gmt.gz")]


def repeat() -> None:
    """The repeated runs (``run/repeat``: three of Llama with variable lengths, two of GPT-2 without step plans, made
    after every decision above) replayed on their clocks under each of :data:`MODELS`."""
    fs = sorted(glob.glob(os.path.join(RUN, "repeat", "*", "*.gmt.gz")))
    by = _by_trace(_replay, [(f, m) for f in fs for m in MODELS])
    print("| run | live | " + " | ".join(MODELS) + " |\n|---|---:|" + "---:|" * len(MODELS))
    for f, v in by.items():
        live = v["shipped"][0]
        print(f"| {os.path.relpath(f, RUN)} | {live:.2f} % | "
              + " | ".join(f"{v[m][1]:.2f} % ({v[m][1] - live:+.2f})" for m in MODELS) + " |")


def _policy_replay(args: tuple[str, str]) -> tuple[str, str, float, float]:
    from gpumem.allocator.policy import POLICIES
    from gpumem.replay import replay_trace
    from gpumem.specs import open_device

    f, knob = args
    policy = POLICIES["gpumem"] if knob == "default" else dataclasses.replace(POLICIES["gpumem"], **{knob: True})
    dev = open_device("sim:h200-141gb")
    try:
        r = replay_trace(load_trace(f, progress=False), dev, policy, progress=False)
    finally:
        dev.close()
    return f, knob, 100 * r.overhead, r.sim_time_s


def policies() -> None:
    """Every run of Llama with variable lengths that has its clock, replayed on it under the default policy and with
    ``wait_own_stream`` or ``stream_ordered_steal`` on (a what-if: the live runs had the default)."""
    knobs = ("default", "wait_own_stream", "stream_ordered_steal")
    by = _by_trace(_policy_replay, [(f, k) for f in VARLEN for k in knobs])
    print("| run | " + " | ".join(knobs) + " |\n|---|" + "---:|" * len(knobs))
    for f, v in by.items():
        base_s = v["default"][1]
        print(f"| {os.path.relpath(f, HIL)} | " + " | ".join(
            f"{v[k][0]:.2f} % ({100 * (v[k][1] / base_s - 1):+.1f} % time)" for k in knobs) + " |")


def steps() -> None:
    """Each clocked Llama run's step times from its trace's step marks (ms; the probe times steps 7 onward)."""
    for f in VARLEN[:-1] + [os.path.join(HIL, "wait-own-varlen-h200-2026-12-02", "run", "on-rec",
                                         "llama_varlen_train.gpumem.gmt.gz")]:
        tr = load_trace(f, progress=False)
        t = [e.time_us for e in tr.plan_events if e.kind.name == "MARK"]
        ms = [round((b - a) / 1e3) for a, b in zip(t, t[1:])]
        print(f"| {os.path.relpath(f, HIL)} | {ms[5]} | {ms[6]} | {ms[7]} | {min(ms[8:])}-{max(ms[8:])} |")


COMMANDS = {"cold": cold, "maps": maps, "replays": replays, "trace": trace_timing, "repeat": repeat,
            "policies": policies, "steps": steps}


if __name__ == "__main__":
    what = sys.argv[1:2]
    if what in (["-h"], ["--help"]):
        print(__doc__)
    elif len(sys.argv) != 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"{__doc__}\nunknown command {' '.join(sys.argv[1:])!r}: use one of {', '.join(COMMANDS)}")
    else:
        COMMANDS[sys.argv[1]]()
