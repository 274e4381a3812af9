"""Simulated soak: several workloads on a simulated multi-GPU host under pressure and injected faults.

A host of simulated GPUs (default: two 24 GB and two 80 GB profiles) shares one SimPy clock; every
device has another tenant running one of the pressure presets (step, ramp, spikes, random) and
injected faults (allocation calls that fail with out-of-memory at a rate, transient errors on some
calls). A :class:`~gpumem.managers.multi.MultiGpuMemoryManager` places the work of three workloads,
interleaved by a seeded generator:

* ``kv-cache``: 4-128 MiB pages of 64 named sequences (device affinity), up to 40 % of the host's
  usable memory;
* ``training``: 1 MiB - 1 GiB activations freed last-in first-out, a tenth of them named weights
  (affinity), up to 40 %;
* ``small``: 512 B - 1 MiB buffers, up to 1 % of the host, freed at random.

Between operations the workloads "compute" (simulated time passes), and one
:class:`~gpumem.managers.pressure.PressureMonitor` per device (releaser: that device's manager) reacts
to the tenants' events and polls every ``--poll-every`` operations. Every buffer gets a pattern written
at both ends, checked when it is freed and at the end.

At the end the soak checks, and exits 1 when any check fails:

* no lost buffer: the soak's ledger, the multi-manager's live allocations and the per-device
  allocated bytes are the same, and every pattern reads back intact;
* no overlap: live allocations on one device never overlap;
* the stats add up: per device and in total, allocated bytes = the sum of live sizes;
  allocations - frees = live count; after freeing everything, nothing is allocated, and after
  ``empty_cache`` and ``close`` the devices hold nothing of this process's.

It prints one table of what each device held and did. Usage::

    python -m sim.soak [--ops 300000] [--devices a10-24gb,a100-80gb,l4-24gb,h100-80gb]
                              [--seed 1] [--fail-rate 0.0005] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import simpy

import gpumem
from gpumem import sim
from gpumem.errors import TransientDeviceError
from gpumem.managers.multi import MultiGpuMemoryManager, MultiGpuOutOfMemoryError
from gpumem.managers.pressure import PressureMonitor
from gpumem.progress import progress
from gpumem.sim.pressure import PRESET_NAMES, preset
from gpumem.units import MiB, format_bytes

DEFAULT_DEVICES = ("a10-24gb", "a100-80gb", "l4-24gb", "h100-80gb")
PATTERN_NBYTES = 16


@dataclass
class Workload:
    """One stream of allocations: sizes, names, how much it keeps live, and how it frees."""

    name: str
    size: Callable[[random.Random], int]
    tensor_name: Callable[[random.Random], str | None]
    target_fraction: float
    """Live bytes it aims for, as a fraction of the host's usable memory."""
    lifo: bool = False
    live: deque = field(default_factory=deque)
    live_nbytes: int = 0
    allocs: int = 0
    frees: int = 0
    refused: int = 0


def workloads() -> list[Workload]:
    """The three workloads of the module docstring."""
    return [
        Workload("kv-cache", lambda r: r.randint(1, 32) * 4 * MiB, lambda r: f"seq{r.randrange(64)}", 0.40),
        Workload("training", lambda r: r.randint(1, 1024) * MiB,
                 lambda r: f"weights.{r.randrange(16)}" if r.random() < 0.1 else None, 0.40, lifo=True),
        Workload("small", lambda r: r.randint(512, 1 * MiB), lambda r: None, 0.01),
    ]


@dataclass
class DeviceReport:
    """What one device held and did during the soak."""

    index: int
    spec: str
    pressure: str
    total_nbytes: int
    usable_nbytes: int
    allocs: int = 0
    frees: int = 0
    peak_allocated_nbytes: int = 0
    injected_faults: int = 0
    tenant_denied: int = 0
    tenant_denied_cache_would_fit: int = 0
    """Denials where free bytes plus this process's cache would have covered the request. An upper
    estimate: "cache" is the device pages this process holds minus its live bytes, which also counts
    partly used chunks that ``empty_cache()`` cannot give back."""
    peak_level: str = "LOW"
    level_changes: int = 0
    releases: int = 0
    released_nbytes: int = 0


@dataclass
class SoakResult:
    """The soak's figures and the outcome of its checks."""

    ops: int
    wall_s: float
    sim_s: float
    allocs: int
    frees: int
    refused: int
    """Allocations no device accepted (MultiGpuOutOfMemoryError)."""
    transient_retries: int
    spills: int
    peak_live_nbytes: int
    devices: list[DeviceReport]
    workloads: dict[str, dict[str, int]]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _pattern(serial: int) -> bytes:
    return serial.to_bytes(8, "little") * 2


def run_soak(ops: int = 300_000, *, devices: Sequence[str] = DEFAULT_DEVICES, seed: int = 1,
             fail_rate: float = 0.0005, poll_every: int = 500, compute_s: float = 20e-6,
             manager_factory: Callable[[Any], Any] | None = None, show_progress: bool | None = None) -> SoakResult:
    """Run the soak (see the module docstring) and return what it found; never raises for a failed check."""
    rng = random.Random(seed)
    env = simpy.Environment()
    devs = []
    for k, profile in enumerate(devices):
        plan = sim.FaultPlan(malloc_failure_rate=fail_rate,
                             transient_error_calls=frozenset(range(50 + k, 10**6, 997)))
        devs.append(gpumem.open_device(f"sim:{profile}", env=env, seed=seed * 100 + k, faults=plan))
    pressures = [PRESET_NAMES[k % len(PRESET_NAMES)] for k in range(len(devs))]
    multi = MultiGpuMemoryManager(devs, manager_factory=manager_factory)
    monitors = [PressureMonitor(d, interval_s=3600.0, releasers=[multi.manager(k)])
                for k, d in enumerate(devs)]
    for m in monitors:
        m.start()  # reacts to tenant events at once; the thread itself sleeps (polls below are explicit)
    per_device_live = [0] * len(devs)
    denials_with_cache: list[tuple[int, Any]] = []

    def watch_denials(k: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            if event.kind.value == "tenant_denied":
                cached = devs[k].process_used_nbytes - per_device_live[k]
                if event.free_nbytes + cached >= event.nbytes:
                    denials_with_cache.append((k, event))
        return on_event

    subscriptions = [d.subscribe(watch_denials(k)) for k, d in enumerate(devs)]
    for k, d in enumerate(devs):  # tenants start once the monitors watch
        d.add_tenant(preset(pressures[k], d.properties().total_nbytes), name=f"pressure-{pressures[k]}")
    host_usable = sum(int(m.usable_memory) for m in multi.managers)
    reports = [DeviceReport(k, d.spec, pressures[k], d.properties().total_nbytes, int(multi.manager(k).usable_memory))
               for k, d in enumerate(devs)]
    ws = workloads()
    ledger: dict[int, tuple[int, Any, int, Workload]] = {}  # id(allocation) -> (device, allocation, serial, workload)
    problems: list[str] = []
    refused = transient = serial = 0
    live_nbytes = peak_live = 0

    def check_pattern(i: int, a: Any, s: int) -> None:
        d = devs[i]
        n = min(PATTERN_NBYTES, a.nbytes)
        want = _pattern(s)[:n]
        if d.read(a.ptr, n) != want or d.read(a.ptr + a.nbytes - n, n) != want:
            problems.append(f"buffer {s} on device {i} lost its pattern")

    def free_one(w: Workload) -> None:
        nonlocal live_nbytes
        a = w.live.pop() if w.lifo else w.live.popleft() if rng.random() < 0.5 else _pop_random(w.live, rng)
        i, _, s, _ = ledger.pop(id(a))
        check_pattern(i, a, s)
        for attempt in range(3):
            try:
                multi.deallocate(a)
                break
            except TransientDeviceError:
                continue
        w.frees += 1
        w.live_nbytes -= a.nbytes
        live_nbytes -= a.nbytes
        per_device_live[i] -= a.nbytes
        reports[i].frees += 1

    bar = progress(ops, "soak", "op", enabled=show_progress)
    t0 = time.perf_counter()
    done = 0
    try:
        for done in range(1, ops + 1):
            w = ws[rng.randrange(len(ws))]
            want_free = w.live and (w.live_nbytes > w.target_fraction * host_usable or rng.random() < 0.3)
            if want_free:
                free_one(w)
            else:
                nbytes = w.size(rng)
                name = w.tensor_name(rng)
                placed = None
                for attempt in range(3):
                    try:
                        placed = multi.allocate_on_best_device(nbytes, name)
                        break
                    except TransientDeviceError:
                        transient += 1
                    except MultiGpuOutOfMemoryError:
                        break
                if placed is None:
                    refused += 1
                    w.refused += 1
                    if w.live:  # make room, as a serving loop would by evicting
                        free_one(w)
                else:
                    i, a = placed
                    serial += 1
                    n = min(PATTERN_NBYTES, a.nbytes)
                    devs[i].write(a.ptr, _pattern(serial)[:n])
                    devs[i].write(a.ptr + a.nbytes - n, _pattern(serial)[:n])
                    ledger[id(a)] = (i, a, serial, w)
                    w.live.append(a)
                    w.allocs += 1
                    w.live_nbytes += a.nbytes
                    live_nbytes += a.nbytes
                    peak_live = max(peak_live, live_nbytes)
                    per_device_live[i] += a.nbytes
                    reports[i].allocs += 1
                    reports[i].peak_allocated_nbytes = max(reports[i].peak_allocated_nbytes, per_device_live[i])
            devs[done % len(devs)].advance(compute_s)
            if done % poll_every == 0:
                for m in monitors:
                    m.poll_once()
            if done % 1000 == 0:
                bar.update(1000)
        bar.update(done % 1000)
    finally:
        bar.close()
        for m in monitors:
            m.stop()
        for sub in subscriptions:
            sub.cancel()
    wall_s = time.perf_counter() - t0

    # -- the checks -----------------------------------------------------------------------------------
    live = multi.live_allocations()
    if sorted(id(a) for _, a in live) != sorted(ledger):
        problems.append(f"the multi-manager holds {len(live)} allocations, the soak's ledger {len(ledger)}")
    stats = multi.get_memory_stats()
    for d in stats.devices:
        mine = sum(a.nbytes for i, a in live if i == d.index)
        if d.allocated_nbytes != mine or mine != per_device_live[d.index]:
            problems.append(f"device {d.index}: allocated {d.allocated_nbytes}, live sizes {mine}, "
                            f"ledger {per_device_live[d.index]}")
        if reports[d.index].allocs - reports[d.index].frees != d.n_allocations:
            problems.append(f"device {d.index}: {reports[d.index].allocs} allocs - {reports[d.index].frees} frees "
                            f"!= {d.n_allocations} live")
        ranges = sorted((a.ptr, a.ptr + a.nbytes) for i, a in live if i == d.index)
        for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
            if e0 > s1:
                problems.append(f"device {d.index}: [{s0:#x}, {e0:#x}) overlaps [{s1:#x}, {e1:#x})")
    if stats.allocated_nbytes != live_nbytes:
        problems.append(f"total allocated {stats.allocated_nbytes} != live {live_nbytes}")
    for i, a, s, _ in ledger.values():
        check_pattern(i, a, s)
    for w in ws:
        while w.live:
            free_one(w)
    after = multi.get_memory_stats()
    if after.allocated_nbytes or after.n_allocations:
        problems.append(f"after freeing everything: {after.allocated_nbytes} bytes in {after.n_allocations} "
                        f"allocations still counted")
    sim_s = env.now
    for k, (d, m) in enumerate(zip(devs, monitors)):
        ms = m.stats()
        r = reports[k]
        r.injected_faults = d.stats.injected_faults
        r.tenant_denied = sum(1 for e in d.events.history if e.kind.value == "tenant_denied")
        r.tenant_denied_cache_would_fit = sum(1 for i, _ in denials_with_cache if i == k)
        r.peak_level, r.level_changes = ms.peak_level.name, ms.level_changes
        r.releases, r.released_nbytes = ms.releases, ms.released_nbytes
    spills = after.spills
    multi.close()
    for k, d in enumerate(devs):
        if d.process_used_nbytes:
            problems.append(f"device {k} ({d.spec}): {format_bytes(d.process_used_nbytes)} still held after close")
        try:
            d.check_invariants()
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            problems.append(f"device {k}: {exc}")
        d.close()
    return SoakResult(
        ops=done, wall_s=wall_s, sim_s=float(sim_s), allocs=sum(w.allocs for w in ws),
        frees=sum(w.frees for w in ws), refused=refused, transient_retries=transient, spills=spills,
        peak_live_nbytes=peak_live, devices=reports,
        workloads={w.name: {"allocs": w.allocs, "frees": w.frees, "refused": w.refused} for w in ws},
        problems=problems)


def _pop_random(q: deque, rng: random.Random) -> Any:
    q.rotate(-rng.randrange(len(q)))
    return q.popleft()


def render(result: SoakResult) -> str:
    """The soak's report as Markdown tables."""
    lines = [
        f"Soak: {result.ops:,} operations ({result.allocs:,} allocations, {result.frees:,} frees, "
        f"{result.refused:,} refused by every device, {result.spills:,} spilled, {result.transient_retries:,} "
        f"transient retries) in {result.wall_s:.1f} s wall, {result.sim_s:.3f} s simulated; peak live "
        f"{format_bytes(result.peak_live_nbytes)}.",
        "",
        "| device | profile | pressure | usable | allocs | frees | peak allocated | injected faults | "
        "tenant denied (cache would have fit) | peak level | level changes | releases | released |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.devices:
        lines.append(f"| {r.index} | {r.spec} | {r.pressure} | {format_bytes(r.usable_nbytes)} | {r.allocs:,} | "
                     f"{r.frees:,} | {format_bytes(r.peak_allocated_nbytes)} | {r.injected_faults:,} | "
                     f"{r.tenant_denied:,} ({r.tenant_denied_cache_would_fit:,}) | {r.peak_level} | {r.level_changes:,} | {r.releases:,} | "
                     f"{format_bytes(r.released_nbytes)} |")
    lines += ["", "| workload | allocs | frees | refused |", "|---|---|---|---|"]
    for name, c in result.workloads.items():
        lines.append(f"| {name} | {c['allocs']:,} | {c['frees']:,} | {c['refused']:,} |")
    lines.append("")
    if result.ok:
        lines.append("Checks: no lost buffer, no overlap, stats add up, nothing held after close: **all passed**.")
    else:
        lines.append(f"Checks: **{len(result.problems)} failed**:")
        lines += [f"- {p}" for p in result.problems[:50]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the soak, print the tables; exit 1 when a check failed."""
    ap = argparse.ArgumentParser(prog="python -m sim.soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=300_000, help="operations in all (default 300000)")
    ap.add_argument("--devices", default=",".join(DEFAULT_DEVICES),
                    help="comma-separated simulated profiles (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fail-rate", type=float, default=0.0005,
                    help="probability that an allocation call fails with an injected out-of-memory")
    ap.add_argument("--poll-every", type=int, default=500, help="operations between explicit polls")
    ap.add_argument("--json", type=Path, help="also write the result as JSON here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.ops <= 0 or args.poll_every <= 0:
        ap.error("--ops and --poll-every must be positive")
    result = run_soak(args.ops, devices=[s.strip() for s in args.devices.split(",") if s.strip()], seed=args.seed,
                      fail_rate=args.fail_rate, poll_every=args.poll_every,
                      show_progress=False if args.no_progress else None)
    print(render(result))
    if args.json:
        payload = asdict(result)
        payload["ok"] = result.ok
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
