"""Real pressure from a second process, seen through NVML: the PressureMonitor gives cache back in time.

This process holds *live* buffers (filled with a pattern) and a large *cache* (memory a
:class:`~gpumem.allocator.CachingAllocator` reserved and then had freed to it), and keeps working
(allocating and freeing scratch buffers). A second process (PyTorch, else CuPy) takes device memory
in steps on a schedule, holds it and gives it back, several cycles. A
:class:`~gpumem.managers.pressure.PressureMonitor` polls NVML (so the other process's memory counts)
and, at HIGH or CRITICAL, empties the allocator's cache. Sizes are chosen so that the other process's
peak does **not** fit unless the cache is given back.

The check passes when: the monitor sampled through NVML and saw the level rise to HIGH or above; the
cache was given back; neither process hit an out-of-memory error; every live buffer reads back its
pattern at the end. It writes ``nvml-pressure-<device>-<date>.md`` and ``.json`` to ``--out`` and
exits 0 when it passed, 1 when a check failed, 2 when it could not run (no GPU, no CuPy/PyTorch).

The other process reports its events (with sequence numbers, and its own counts at the end) through a
pipe of its own; a lost event is reported as such. When it runs out of memory it retries for 2 s, then
gives the step up and skips the rest of that ramp, so the control run (``--no-release``) ends by itself.

On a real GPU::

    python -m hil.probes.nvml_pressure --device cuda:0 --out "$OUT"

The same check runs on a simulated device, with a simulated tenant in place of the second process
(this is how the test suite exercises it)::

    python -m hil.probes.nvml_pressure --device sim:a100-80gb --out build/nvml-pressure
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import gpumem
from gpumem.allocator import CachingAllocator
from gpumem.device import Device, DeviceKind
from gpumem.errors import GpumemError, OutOfMemoryError
from gpumem.managers.pressure import MemoryPressure, PressureChange, PressureMonitor, SampleSource
from gpumem.units import MiB, format_bytes


@dataclass(frozen=True)
class Plan:
    """Sizes and schedule, as fractions of the device's total memory."""

    live_fraction: float = 0.15
    cache_fraction: float = 0.55
    hog_peak_fraction: float = 0.40
    hog_steps: int = 20
    step_s: float = 0.2
    hold_s: float = 2.0
    pause_s: float = 2.0
    cycles: int = 3
    buffer_nbytes: int = 256 * MiB
    scratch_nbytes: int = 64 * MiB
    interval_s: float = 0.02
    pattern_nbytes: int | None = None
    """Bytes of pattern written and checked at each end of a live buffer (None: the whole buffer)."""

    def schedule(self, total_nbytes: int) -> list[tuple[float, int]]:
        """``(time_s, delta_nbytes)`` for the other process: ramp up in steps, hold, give all back."""
        step = int(total_nbytes * self.hog_peak_fraction / self.hog_steps)
        out: list[tuple[float, int]] = []
        t = 1.0
        for _ in range(self.cycles):
            for _ in range(self.hog_steps):
                out.append((round(t, 3), step))
                t += self.step_s
            t += self.hold_s
            out.append((round(t, 3), -step * self.hog_steps))
            t += self.pause_s
        return out


@dataclass
class Record:
    """What happened; written as JSON and summarised as Markdown."""

    device: str
    device_name: str
    total_nbytes: int
    date: str
    host: str
    hog_backend: str
    release: bool
    plan: dict
    schedule: list
    live_nbytes: int = 0
    cache_nbytes: int = 0
    samples_by_source: dict = field(default_factory=dict)
    peak_level: str = "LOW"
    peak_used_fraction: float = 0.0
    changes: list = field(default_factory=list)
    releases: int = 0
    released_nbytes: int = 0
    cache_refills: int = 0
    scratch_allocs: int = 0
    our_ooms: list = field(default_factory=list)
    hog_events: list = field(default_factory=list)
    hog_ooms: int = 0
    hog_took: int = 0
    """Steps the other process took, as it reports them itself (cross-checked with its events)."""
    hog_exit: int | None = None
    hog_unparsed: list = field(default_factory=list)
    hog_output: str = ""
    live_intact: bool = False
    wall_s: float = 0.0
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# -- the other process ---------------------------------------------------------------------------------
# The child writes one JSON line per event to a pipe of its own (``argv[3]``), with one ``os.write`` each
# (a line is far shorter than PIPE_BUF, so it arrives whole); its stdout and stderr go to a log file that
# is only read for diagnostics. Each event carries a sequence number, and the last one ("done") carries
# the child's own counts, so that the parent can tell when an event went missing instead of counting
# fewer steps. (Events used to go through a temporary file shared with the child: the parent's
# ``seek(0)`` moved the file offset the child wrote at, so a line written at that moment overwrote
# earlier lines, and 2 "took" events and the "ready" event of a real run were lost.)
HOG_SCRIPT = r"""
import json, os, sys, time
index, schedule, fd = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
retry_s = float(opts.get("retry_s", 2.0))
seq = 0
counts = {"took": 0, "oom": 0, "gave_up": 0, "skipped": 0, "returned": 0, "returned_nbytes": 0}
def out(**kw):
    global seq
    kw["seq"] = seq
    seq += 1
    kw["t"] = round(time.monotonic() - t0, 4)
    data = (json.dumps(kw) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]
t0 = time.monotonic()
try:
    import torch
    dev = torch.device(f"cuda:{index}")
    def take(n): return torch.empty(n, dtype=torch.uint8, device=dev)
    def release(): torch.cuda.synchronize(dev); torch.cuda.empty_cache()
    oom = torch.cuda.OutOfMemoryError
    backend = "torch " + torch.__version__
except ImportError:
    import cupy
    cupy.cuda.Device(index).use()
    pool = cupy.get_default_memory_pool()
    def take(n): return cupy.empty(n, dtype=cupy.uint8)
    def release(): cupy.cuda.Device(index).synchronize(); pool.free_all_blocks()
    oom = cupy.cuda.memory.OutOfMemoryError
    backend = "cupy " + cupy.__version__
t0 = time.monotonic()
x = take(1)
x.fill_(0) if hasattr(x, "fill_") else x.fill(0)
del x
out(event="ready", backend=backend)
held = []
skip = False  # after a step was given up, the rest of that ramp is skipped (the control run ends in time)
for at, delta in schedule:
    time.sleep(max(0.0, at - (time.monotonic() - t0)))
    if delta > 0:
        if skip:
            counts["skipped"] += 1
            out(event="skipped", nbytes=delta)
            continue
        first, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                x = take(delta)
                x.fill_(7) if hasattr(x, "fill_") else x.fill(7)
                held.append(x)
                x = None
                counts["took"] += 1
                out(event="took", nbytes=delta, attempts=attempt)
                break
            except oom:
                x = None
                counts["oom"] += 1
                out(event="oom", nbytes=delta, attempt=attempt)
                if time.monotonic() - first >= retry_s:
                    counts["gave_up"] += 1
                    out(event="gave_up", nbytes=delta, attempts=attempt)
                    skip = True
                    break
                time.sleep(0.05)
    else:
        n = sum(int(x.nbytes) for x in held)
        held.clear()
        release()
        counts["returned"] += 1
        counts["returned_nbytes"] += n
        out(event="returned", nbytes=n)
        skip = False
out(event="done", backend=backend, events=seq, **counts)
os.close(fd)
"""

COUNTED_EVENTS = ("took", "oom", "gave_up", "skipped", "returned")
"""Events that the child counts itself and reports again in its "done" event."""


class SubprocessHog:
    """The second process (PyTorch, else CuPy) following the schedule on GPU ``index``.

    ``script`` is the child's program (tests pass a fake one); it is run as
    ``python -c script index schedule_json event_fd options_json`` and writes its events to ``event_fd``."""

    def __init__(self, index: int, schedule: list[tuple[float, int]], *, script: str = HOG_SCRIPT,
                 retry_s: float = 2.0, start_timeout_s: float = 120.0) -> None:
        self.index = index
        self.schedule = schedule
        self.script = script
        self.retry_s = retry_s
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.unparsed: list[str] = []
        self._eof = threading.Event()
        self._reader: threading.Thread | None = None
        self.backend = "?"

    def start(self) -> None:
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", self.script, str(self.index), json.dumps(self.schedule), str(w),
                 json.dumps({"retry_s": self.retry_s})],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)  # only the child holds the write end now: end of file comes when it exits
        self._reader = threading.Thread(target=self._read, args=(r,), name="hog-events", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:  # wait until its CUDA context exists: the schedule starts then
            if any(e.get("event") == "ready" for e in self.events()):
                return
            if self._eof.is_set():
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the second process did not start: {self.output()[-2000:]}")

    def _read(self, fd: int) -> None:
        """Read events until the child closes its end; a line is taken only once it is complete."""
        buf = b""
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                self._add(lines)
            if buf.strip():  # a last line without its newline
                self._add([buf])
        finally:
            os.close(fd)
            self._eof.set()

    def _add(self, lines: list[bytes]) -> None:
        parsed, bad = [], []
        for line in lines:
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                if not isinstance(e, dict):
                    raise ValueError(line)
                parsed.append(e)
            except ValueError:
                bad.append(line.decode(errors="replace")[:500])
        with self._lock:
            self._events.extend(parsed)
            self.unparsed.extend(bad)
            for e in parsed:
                if e.get("backend"):
                    self.backend = e["backend"]

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def output(self) -> str:
        """What the child wrote to stdout and stderr."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def finished(self) -> bool:
        """The child exited and every event it wrote was read."""
        return self.proc is not None and self.proc.poll() is not None and self._eof.is_set()

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)
        return rc

    def stop(self) -> None:
        """Kill the child if it still runs (the check was stopped)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.wait(10)

    def step(self, device: Device, dt_s: float) -> None:
        time.sleep(dt_s)


def tally_hog(events: list[dict], expected_steps: int) -> tuple[int, int, list[str]]:
    """``(steps taken, out-of-memory errors, problems)`` from the other process's events.

    The counts come from the child's own "done" event, cross-checked against the events that arrived
    and their sequence numbers: a lost event is reported as such, not as a step that was not taken."""
    problems: list[str] = []
    seen = {k: sum(1 for e in events if e.get("event") == k) for k in COUNTED_EVENTS}
    seqs = [e["seq"] for e in events if isinstance(e.get("seq"), int)]
    if seqs:
        missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
        if missing or len(seqs) != len(set(seqs)) or len(seqs) != len(events):
            problems.append(f"events were lost between the processes: {len(missing)} missing "
                            f"(sequence numbers {missing[:10]}), {len(events) - len(set(seqs))} without one "
                            f"or repeated")
    done = [e for e in events if e.get("event") == "done"]
    if not done:
        problems.append("the other process did not report its end (its counts are unknown)")
        took, ooms = seen["took"], seen["oom"]
    else:
        d = done[-1]
        took, ooms = int(d.get("took", seen["took"])), int(d.get("oom", seen["oom"]))
        if isinstance(d.get("events"), int) and seqs and d["events"] != max(seqs):
            problems.append(f"the other process wrote {d['events']} events before its end, "
                            f"{len([s for s in seqs if s < d['events']])} arrived")
        for k in COUNTED_EVENTS:
            if k in d and int(d[k]) != seen[k]:
                problems.append(f"the other process reports {d[k]} '{k}' events, {seen[k]} arrived")
    if took < expected_steps:
        problems.append(f"the other process took {took} of {expected_steps} steps")
    return took, ooms, problems


class SimTenantHog:
    """The same schedule as a simulated tenant (for the simulator and the tests)."""

    backend = "simulated tenant"

    def __init__(self, schedule: list[tuple[float, int]]) -> None:
        self.schedule = schedule
        self._events: list[dict] = []
        self._done = False
        self.device: Any = None

    def start_on(self, device: Any) -> None:
        from gpumem.sim.pressure import Scenario

        hog = self

        class _Schedule(Scenario):
            def process(self, ctx):  # a SimPy process
                origin = ctx.env.now
                for at, delta in hog.schedule:
                    if origin + at > ctx.env.now:
                        yield ctx.env.timeout(origin + at - ctx.env.now)
                    if delta > 0:
                        hog._out("took" if ctx.take(delta) else "oom", ctx.env.now - origin, nbytes=delta)
                    else:
                        n = ctx.held_nbytes
                        ctx.give(n)
                        hog._out("returned", ctx.env.now - origin, nbytes=n)
                counts = {k: sum(1 for e in hog._events if e["event"] == k) for k in COUNTED_EVENTS}
                hog._out("done", ctx.env.now - origin, backend=hog.backend, events=len(hog._events), **counts)
                hog._done = True

        self.device = device
        device.add_tenant(_Schedule(), name="hog")

    def _out(self, event: str, t: float, **kw: Any) -> None:
        self._events.append({"event": event, **kw, "seq": len(self._events), "t": t})

    def start(self) -> None:
        raise RuntimeError("use start_on(device)")

    def stop(self) -> None:
        pass

    def events(self) -> list[dict]:
        return list(self._events)

    def finished(self) -> bool:
        return self._done

    def wait(self, timeout_s: float) -> int | None:
        return 0

    def step(self, device: Device, dt_s: float) -> None:
        device.advance(dt_s)  # type: ignore[attr-defined]


# -- the check ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _pattern_base(nwords: int) -> np.ndarray:
    base = np.arange(nwords, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    base.setflags(write=False)
    return base


def _pattern(k: int, nbytes: int) -> bytes:
    return (_pattern_base(nbytes // 8) + np.uint64(k)).tobytes()


def _write_pattern(device: Device, ptr: int, k: int, plan: Plan) -> None:
    n = plan.pattern_nbytes
    if n is None or 2 * n >= plan.buffer_nbytes:
        device.write(ptr, _pattern(k, plan.buffer_nbytes))
    else:
        device.write(ptr, _pattern(k, n))
        device.write(ptr + plan.buffer_nbytes - n, _pattern(k + 1, n))


def _pattern_intact(device: Device, ptr: int, k: int, plan: Plan) -> bool:
    n = plan.pattern_nbytes
    if n is None or 2 * n >= plan.buffer_nbytes:
        return device.read(ptr, plan.buffer_nbytes) == _pattern(k, plan.buffer_nbytes)
    return (device.read(ptr, n) == _pattern(k, n)
            and device.read(ptr + plan.buffer_nbytes - n, n) == _pattern(k + 1, n))


def run_check(device: Device, plan: Plan, *, out_dir: Path, hog: Any | None = None, release: bool = True) -> Record:
    """Run the check on ``device`` (a real GPU with a second process, or a simulated one with a tenant).

    ``release=False`` is the control experiment: the monitor watches but gives nothing back, and the
    other process is expected to run out of memory (the record then says the check failed)."""
    props = device.properties()
    total = props.total_nbytes
    schedule = plan.schedule(total)
    if hog is None:
        if device.kind is DeviceKind.SIM:
            hog = SimTenantHog(schedule)
        else:
            hog = SubprocessHog(int(device.spec.split(":")[1]), schedule)
    rec = Record(device=device.spec, device_name=props.name, total_nbytes=total,
                 date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                 hog_backend=hog.backend, release=release, plan=asdict(plan), schedule=schedule)
    alloc = CachingAllocator(device)
    changes: list[PressureChange] = []

    live: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    try:
        n_live = max(1, int(total * plan.live_fraction) // plan.buffer_nbytes)
        for k in range(n_live):
            p = alloc.allocate(plan.buffer_nbytes)
            _write_pattern(device, p, k, plan)
            live.append((p, k))
        rec.live_nbytes = n_live * plan.buffer_nbytes

        monitor: PressureMonitor | None = None

        def refill_cache() -> None:
            # Note: a refill stops at HIGH pressure, as a program that watches the monitor would; refilling
            # into the other process's next ramp would only make the monitor give it back again
            tmp = []
            try:
                for _ in range(int(total * plan.cache_fraction) // plan.buffer_nbytes):
                    if monitor is not None and monitor.level >= MemoryPressure.HIGH:
                        break
                    tmp.append(alloc.allocate(plan.buffer_nbytes))
            except OutOfMemoryError as exc:  # the other process holds memory now: cache what fits
                rec.our_ooms.append(f"(cache refill stopped early, not a failure) {str(exc)[:200]}")
            for p in tmp:
                alloc.free(p)
            rec.cache_refills += 1

        refill_cache()
        rec.cache_nbytes = alloc.reserved_nbytes - alloc.allocated_nbytes

        def on_change(change: PressureChange) -> None:
            changes.append(change)

        monitor = PressureMonitor(device, interval_s=plan.interval_s, releasers=[alloc] if release else [],
                                  callbacks=[on_change])
        with monitor:
            if isinstance(hog, SimTenantHog):
                hog.start_on(device)
            else:
                hog.start()
            rec.hog_backend = hog.backend
            returned_seen = 0
            # the schedule, plus the other process's retries (each bounded), plus slack: never wait forever
            deadline = time.monotonic() + (schedule[-1][0] if schedule else 0.0) + 60.0
            while not hog.finished():
                if time.monotonic() > deadline:
                    rec.problems.append("the other process did not finish in time and was stopped")
                    hog.stop()
                    break
                # our own work: scratch buffers come and go; refill the cache after each hog cycle
                try:
                    p = alloc.allocate(plan.scratch_nbytes)
                    rec.scratch_allocs += 1
                    alloc.free(p)
                except OutOfMemoryError as exc:
                    rec.our_ooms.append(str(exc)[:300])
                returned = sum(1 for e in hog.events() if e.get("event") == "returned")
                if returned > returned_seen:
                    returned_seen = returned
                    refill_cache()
                hog.step(device, 0.01)
                if isinstance(hog, SimTenantHog):
                    monitor.poll_once()  # simulated time: poll at each step (the thread sees wall time)
        rec.hog_exit = hog.wait(60)
        st = monitor.stats()
        rec.releases, rec.released_nbytes = st.releases, st.released_nbytes
        rec.peak_level = st.peak_level.name
        rec.samples_by_source = st.samples_by_source
        rec.peak_used_fraction = st.peak_used_fraction
        rec.changes = [{"old": c.old.name, "new": c.new.name, "used_fraction": round(c.sample.used_fraction, 4),
                        "source": c.sample.source.value, "sequence": c.sequence} for c in changes]
        rec.hog_events = hog.events()
        rec.hog_backend = hog.backend
        rec.hog_unparsed = list(getattr(hog, "unparsed", []))
        if isinstance(hog, SubprocessHog):
            rec.hog_output = hog.output()[-4000:]
        rec.live_intact = all(_pattern_intact(device, p, k, plan) for p, k in live)
    finally:
        hog.stop()
        for p, _ in live:
            try:
                alloc.free(p)
            except GpumemError:
                pass
        alloc.close()
        rec.wall_s = round(time.perf_counter() - t0, 3)
    # -- verdict
    if device.kind is DeviceKind.CUDA and not rec.samples_by_source.get(SampleSource.NVML.value):
        rec.problems.append("the monitor never sampled through NVML")
    if MemoryPressure[rec.peak_level] < MemoryPressure.HIGH:
        rec.problems.append(f"the monitor never saw HIGH pressure (peak {rec.peak_level}, "
                            f"{rec.peak_used_fraction:.1%} used at most)")
    if not rec.released_nbytes:
        rec.problems.append("no cache was given back")
    real_ooms = [o for o in rec.our_ooms if not o.startswith("(cache refill")]
    if real_ooms:
        rec.problems.append(f"this process ran out of memory {len(real_ooms)} time(s)")
    rec.hog_took, rec.hog_ooms, hog_problems = tally_hog(rec.hog_events, plan.cycles * plan.hog_steps)
    if rec.hog_ooms:
        rec.problems.append(f"the other process ran out of memory {rec.hog_ooms} time(s)")
    rec.problems.extend(hog_problems)
    if rec.hog_unparsed:
        rec.problems.append(f"{len(rec.hog_unparsed)} line(s) from the other process could not be read")
    if rec.hog_exit not in (0, None):
        rec.problems.append(f"the other process exited with {rec.hog_exit}")
    if not rec.live_intact:
        rec.problems.append("live data was damaged")
    write_record(rec, out_dir)
    return rec


def render(rec: Record) -> str:
    """The record as Markdown."""
    lines = [
        f"# Pressure from another process, seen through "
        f"{'the simulator' if rec.device.startswith('sim:') else 'NVML'}: {rec.device} ({rec.device_name})"
        f"{'' if rec.release else ', control run without release'}",
        "",
        f"{rec.date}, host `{rec.host}`, other process: {rec.hog_backend}. Generated by "
        f"`hil/probes/nvml_pressure.py`.",
        "",
        f"This process held {format_bytes(rec.live_nbytes)} of live buffers (a pattern in each) and a cache of "
        f"{format_bytes(rec.cache_nbytes)}; the other process took up to "
        f"{rec.plan['hog_peak_fraction']:.0%} of {format_bytes(rec.total_nbytes)} in {rec.plan['hog_steps']} steps, "
        f"{rec.plan['cycles']} cycles.",
        "",
        "| what | value |",
        "|---|---|",
        f"| samples by source | {', '.join(f'{k}: {v:,}' for k, v in sorted(rec.samples_by_source.items()))} |",
        f"| peak level / used | {rec.peak_level} / {rec.peak_used_fraction:.1%} |",
        f"| level changes | {len(rec.changes)} |",
        f"| releases / bytes given back | {rec.releases:,} / {format_bytes(rec.released_nbytes)} |",
        f"| cache refills after each cycle | {rec.cache_refills} |",
        f"| scratch allocations meanwhile | {rec.scratch_allocs:,} |",
        f"| steps the other process took (its own count) | {rec.hog_took} of "
        f"{rec.plan['cycles'] * rec.plan['hog_steps']} |",
        f"| out of memory here / in the other process | {len([o for o in rec.our_ooms if not o.startswith('(')])} / "
        f"{rec.hog_ooms} |",
        f"| live data intact | {'yes' if rec.live_intact else '**no**'} |",
        f"| wall time | {rec.wall_s} s |",
        "",
        "Level changes: " + (", ".join(f"{c['old']}→{c['new']} ({c['used_fraction']:.1%}, {c['source']})"
                                       for c in rec.changes[:40]) or "none"),
        "",
        "**Result: passed.**" if rec.ok else "**Result: failed**: " + "; ".join(rec.problems),
        "",
    ]
    return "\n".join(lines)


def write_record(rec: Record, out_dir: Path) -> tuple[Path, Path]:
    """Write ``nvml-pressure-<device>-<date>.{md,json}`` under ``out_dir``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = (f"nvml-pressure-{rec.device.split('?')[0].replace(':', '')}-{rec.date[:10]}"
            f"{'' if rec.release else '-no-release'}")
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(render(rec))
    payload = asdict(rec)
    payload["ok"] = rec.ok
    js.write_text(json.dumps(payload, indent=2) + "\n")
    return md, js


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m hil.probes.nvml_pressure", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or sim:<profile> (default cuda:0)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for the Markdown and JSON record (default $OUT)")
    ap.add_argument("--cycles", type=int, default=Plan.cycles)
    ap.add_argument("--interval-s", type=float, default=Plan.interval_s, help="the monitor's poll interval")
    ap.add_argument("--pattern-nbytes", type=int, default=0,
                    help="bytes of pattern at each end of a live buffer (default: 8 MiB on a GPU, 4096 on the "
                         "simulator; half the buffer size or more checks the whole buffer)")
    ap.add_argument("--no-release", action="store_true",
                    help="control experiment: the monitor gives nothing back (the other process should then "
                         "run out of memory, and the check fails)")
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required (or set $OUT)")
    if args.cycles <= 0 or args.interval_s <= 0:
        ap.error("--cycles and --interval-s must be positive")
    try:
        device = gpumem.open_device(args.device)
    except GpumemError as exc:
        print(f"cannot open {args.device}: {exc}", file=sys.stderr)
        return 2
    # the simulator keeps written bytes in host memory: check the ends of each buffer there
    # on a GPU, the ends of each buffer (writing and checking whole buffers took over a minute on an H200)
    pattern = args.pattern_nbytes if args.pattern_nbytes else (4096 if device.kind is DeviceKind.SIM else 8 * MiB)
    plan = Plan(cycles=args.cycles, interval_s=args.interval_s, pattern_nbytes=pattern)
    try:
        rec = run_check(device, plan, out_dir=args.out, release=not args.no_release)
    except RuntimeError as exc:
        print(f"could not run: {exc}", file=sys.stderr)
        return 2
    finally:
        device.close()
    print(render(rec))
    return 0 if rec.ok else 1


if __name__ == "__main__":
    sys.exit(main())
