"""The studies of ``reports/hil/where-replays-part-2026-11-30.md``: where replays of live gpumem.torch traces part
from the live run, on the traces shipped beside earlier reports (simulator only, this machine's CPU)::

    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py placement    # ~6 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py fence 2.5    # seen latency, ~1 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py busy 2.5     # after busy work, ~1 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py gaps         # live growth ops, seconds
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py oracle 20    # ~2 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py estimate 2.5 # the estimate's b16, b8
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py scale mem_unmap_mapping_us=2.02  # ~1 min
    PYTHONPATH=. python reports/hil/where-replays-part-2026-11-30/study.py set event_record_us=31 [--runs ct]

``fence``, ``busy`` and ``oracle`` change the simulated device by patching its methods here (what-ifs, not
shipped): ``fence L`` completes an event recorded on a stream with no unfinished work only ``L`` µs after its
record; ``busy D`` completes one recorded behind work ``D`` µs after that work ends; ``oracle P`` prices each
allocation's VMM calls so that they fill the time the live op took (the gap to the next op less ``P`` µs, spread
evenly over the calls a first replay made there). ``scale FIELD=K ...`` multiplies fields of the
device's :class:`~gpumem.sim.latency.LatencyModel` (``mem_create_points=1.55`` scales a curve's costs); ``set
FIELD=V ...`` sets them. Both run the five check runs, or with ``--runs ct`` the four ``ct-`` runs of section 5. ``estimate L`` replays the estimate's workload of the two
batch x 4,096-token requests of ``reports/hil/estimate-lag-h200-2026-11-30.md`` (``gpu_timing="model"``, the
estimate's own figure) with and without ``fence L``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

import numpy as np

import gpumem.replay_compare as rc
from gpumem.sim import SimDevice, get_profile
from gpumem.sim import device as simdev
from gpumem.sim.streams import DONE
from gpumem.trace import OpKind, load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
HIL = os.path.dirname(HERE)
CHECK = [os.path.join(HIL, "gpu-clock-bounds-h200-2026-11-30", s + ".gmt.gz")
         for s in ("check-b12", "check-b14", "check-b16", "check-b20", "final-b12")]
VMM_NAMES = ("mem_create", "mem_map", "mem_set_access", "mem_unmap")


class _Seen(simdev.SimEvent):
    __slots__ = ("recorded_s",)


def _patch_fence(idle_us: float, busy_us: float) -> None:
    """The what-if event completions of ``fence`` and ``busy`` (module docstring)."""
    record, query, synchronize = (simdev.SimDevice._do_event_record, simdev.SimDevice._do_event_query,
                                  simdev.SimDevice._do_event_synchronize)

    def do_record(self, stream):
        ev = record(self, stream)
        seen = _Seen(self, ev.stream, ev.work)
        seen.recorded_s = self._clock.now
        return seen

    def seen_s(ev):
        if ev.work is None:
            return ev.recorded_s + idle_us * 1e-6
        return ev.work.end_s + busy_us * 1e-6

    def do_query(self, ev):
        return query(self, ev) and self._clock.now >= seen_s(ev)

    def do_synchronize(self, ev):
        synchronize(self, ev)
        now, until = self._clock.now, seen_s(ev)
        if now < until:
            self._clock.advance(until - now)

    simdev.SimDevice._do_event_record = do_record
    simdev.SimDevice._do_event_query = do_query
    simdev.SimDevice._do_event_synchronize = do_synchronize


def _row(path: str, c) -> str:
    trace = load_trace(path, progress=False) if isinstance(path, str) else path
    live = int(trace.live_reserved_nbytes.max()) / c.result.peak_live_bytes - 1
    f = c.first
    where = "none" if f is None else f"op {f.op:,}: {f.gap_nbytes / 2**20:+,.0f} MiB, GPU {f.gpu_lag_us:.0f} µs behind"
    agree = c.allocations_compared - c.allocations_differing
    return (f"| {os.path.basename(path).split('.')[0]} | {live:.2%} | {c.result.overhead:.2%} | "
            f"{(c.result.overhead - live) * 100:+.2f} pp | {agree:,} of {c.allocations_compared:,} | {where} |")


def _compare(path: str, latency=None):
    profile = get_profile("h200-141gb")
    if latency is not None:
        profile = dataclasses.replace(profile, latency=latency)
    dev = SimDevice(profile)
    try:
        return rc.compare_live(load_trace(path, progress=False), dev, engine="native")
    finally:
        dev.close()


def placement() -> None:
    print("| trace | live | replay | allocations agreeing (reserve) | placed as live | first placed otherwise |")
    print("|---|---:|---:|---:|---:|---|")
    for path in sorted(glob.glob(os.path.join(HIL, "*", "*.gmt.gz"))):
        trace = load_trace(path, progress=False)
        if trace.live_reserved_nbytes is None:
            continue
        c = _compare(path)
        live = int(trace.live_reserved_nbytes.max()) / c.result.peak_live_bytes - 1
        print(f"| {os.path.relpath(path, HIL)} | {live:.2%} | {c.result.overhead:.2%} | "
              f"{c.allocations_compared - c.allocations_differing:,} of {c.allocations_compared:,} | "
              f"{c.placed_as_live:,} of {c.placements_compared:,} | {c.first_placed_otherwise_op} |", flush=True)


CT = [os.path.join(HERE, f"ct-{r}.gmt.gz") for r in ("a-b16", "a-b12", "b-b16", "b-b20")]


def check_table(title: str, latency=None, runs=None) -> None:
    print(f"{title}\n\n| run | live | replay | replay - live | allocations agreeing | first difference |")
    print("|---|---:|---:|---:|---:|---|")
    for path in runs or CHECK:
        print(_row(path, _compare(path, latency)), flush=True)


def scale(settings: list[str], absolute: bool = False) -> None:
    runs = CT if "--runs" in settings and settings[settings.index("--runs") + 1] == "ct" else CHECK
    settings = [s for s in settings if "=" in s]
    lat = get_profile("h200-141gb").latency
    changes = {}
    for item in settings:
        field, _, k = item.partition("=")
        value = getattr(lat, field)
        if absolute:
            changes[field] = float(k)
        else:
            changes[field] = (tuple((n, c * float(k)) for n, c in value) if isinstance(value, tuple)
                              else value * float(k))
    check_table(("Latency model set: " if absolute else "Latency model scaled: ") + ", ".join(settings),
                dataclasses.replace(lat, **changes), runs)


def gaps() -> None:
    """How long live ops took (the time to the next op) where the live engine grew, against the model's price of
    that growth made as one chunk (create, map, set access: a lower bound of its price, as several chunks cost
    more), and against large allocations (64 MiB or more) that did not grow."""
    lat = get_profile("h200-141gb").latency
    print("| run | allocations where live grew | time to the next op: median, p90 | the model's price of the growth: "
          "median | ratio: median, p90 | large allocations that did not grow: median, p90 |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in CHECK:
        t = load_trace(path, progress=False)
        r = t.live_reserved_nbytes
        a = np.flatnonzero((t.kinds == OpKind.ALLOC) & (r >= 0))
        a = a[a + 1 < t.n_ops]
        dt = t.times_us[a + 1] - t.times_us[a]
        growth = np.zeros(len(a), np.int64)
        growth[1:] = r[a[1:]] - r[a[:-1]]
        grew = growth > 0
        price = np.array([lat.mem_create_cost_us(int(g)) + lat.mem_map_us + lat.mem_set_access_cost_us(1, int(g))
                          for g in growth[grew]])
        ratio = dt[grew] / price
        large = ~grew & (t.nbytes[a] >= 64 * 2**20)
        print(f"| {os.path.basename(path).split('.')[0]} | {grew.sum():,} of {len(a):,} | "
              f"{np.median(dt[grew]):,.0f}, {np.percentile(dt[grew], 90):,.0f} µs | {np.median(price):,.0f} µs | "
              f"{np.median(ratio):.1f}x, {np.percentile(ratio, 90):.1f}x | "
              f"{np.median(dt[large]):,.0f}, {np.percentile(dt[large], 90):,.0f} µs |")


def hook_vmm_calls(price) -> None:
    """Route each VMM call a replay's allocation makes through ``price(k, name, cost_us) -> cost_us`` (``k``: the
    allocation's index among those :class:`~gpumem.replay_compare.ReserveCapture` captures; calls made once the
    replay is over, by the allocator's close, are not routed)."""
    state: dict = {"cap": None}
    init = rc.ReserveCapture.__init__

    def capture_init(self, *args):
        init(self, *args)
        state["cap"] = self

    call = simdev.SimDevice._call

    def routed_call(self, name, cost_us, nbytes=0):
        cap = state["cap"]
        if cap is not None and name in VMM_NAMES and len(cap.reserves) < len(cap.ops):
            cost_us = price(len(cap.reserves), name, cost_us)
        return call(self, name, cost_us, nbytes)

    rc.ReserveCapture.__init__ = capture_init
    simdev.SimDevice._call = routed_call


def oracle(program_us: float) -> None:
    state: dict = {"counts": None, "calls": None}

    def price(k, name, cost_us):
        if state["counts"] is not None:
            state["counts"][k] = state["counts"].get(k, 0) + 1
        elif state["calls"] and state["calls"].get(k):
            cost_us = max(cost_us, max(0.0, state["gap_us"][k] - program_us) / state["calls"][k])
        return cost_us

    hook_vmm_calls(price)
    print(f"VMM calls priced to fill the live op (less {program_us:g} µs)\n")
    print("| run | live | replay | replay - live | allocations agreeing | first difference |")
    print("|---|---:|---:|---:|---:|---|")
    for path in CHECK:
        t = load_trace(path, progress=False)
        ops = np.flatnonzero((t.kinds == OpKind.ALLOC) & (t.nbytes > 0))
        gap = np.zeros(len(ops))
        gap[:-1] = t.times_us[ops[:-1] + 1] - t.times_us[ops[:-1]]
        state.update(counts={}, calls=None, gap_us=gap)
        _compare(path)   # the calls each allocation makes, before any is priced otherwise
        state.update(calls=state["counts"], counts=None)
        print(_row(path, _compare(path)), flush=True)


def estimate(idle_us: float) -> None:
    from benchmarks.estimate_speed import LLAMA_7B
    from gpumem.estimate import inference_trace
    from gpumem.replay import replay_trace

    live = {16: 54_974_742_528, 8: 34_244_395_008}   # live gpumem.torch, reports/hil/estimate-lag-h200-2026-11-30.md
    traces = {b: inference_trace(LLAMA_7B, 2, batch_size=b, prompt_len=4096, new_tokens=32, full_decode=True).trace
              for b in live}
    figures = {b: replay_trace(t, "sim:h200-141gb", "gpumem", gpu_timing="model").peak_reserved_bytes
               for b, t in traces.items()}
    _patch_fence(idle_us, 0.0)
    print(f"| batch x 4,096 | live | estimate | estimate, fence seen {idle_us:g} µs after record |\n|---|---:|---:|---:|")
    for b, t in traces.items():
        what_if = replay_trace(t, "sim:h200-141gb", "gpumem", gpu_timing="model").peak_reserved_bytes
        print(f"| {b} | {live[b]:,} | {figures[b] - live[b]:+,} | {what_if - live[b]:+,} |")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    arg = float(sys.argv[2]) if len(sys.argv) > 2 and what not in ("scale", "set") else 0.0
    if what == "placement":
        placement()
    elif what == "fence":
        _patch_fence(arg, 0.0)
        check_table(f"An event on an idle stream seen done {arg:g} µs after its record")
    elif what == "busy":
        _patch_fence(0.0, arg)
        check_table(f"An event behind work seen done {arg:g} µs after the work ends")
    elif what == "base":
        check_table("As shipped")
    elif what == "gaps":
        gaps()
    elif what == "oracle":
        oracle(arg)
    elif what == "estimate":
        estimate(arg)
    elif what in ("scale", "set"):
        scale(sys.argv[2:], absolute=what == "set")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
