"""The replays behind a report: one sampled replay per device and policy, the allocator's layout at the
peak, and the smallest memory limit a trace runs under.

:func:`run_policy` replays a trace exactly as :func:`gpumem.replay.replay` does (same calls, in the same
order, on the default engine), and between chunks of operations samples live and reserved bytes,
external fragmentation and other tenants' memory: its :class:`~gpumem.replay.ReplayResult` has the same
peaks and out-of-memory errors as a plain ``replay_trace``. :func:`occupancy_at` replays the trace up to one
operation on the Python engine (which makes the same decisions as the native one,
``tests/allocator/test_native_differential.py``) and reads its segments, blocks and mapped pages.
:func:`smallest_limit` bisects the ``limit=`` a trace runs under.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..allocator import CachingAllocator, make_allocator
from ..allocator.backing import VirtualBacking
from ..device import Device
from ..errors import GpumemError, OutOfMemoryError, UnsupportedOperationError
from ..events import MemoryEventKind
from ..replay import ReplayResult, calls_made, program_gpu, run_ops, stream_use_plan
from ..sim.gpu_work import GpuTiming, ProgramGpu
from ..specs import open_device
from ..trace import Trace

log = logging.getLogger(__name__)

_PRESSURE_KINDS = (MemoryEventKind.TENANT_TOOK, MemoryEventKind.TENANT_RETURNED, MemoryEventKind.TENANT_DENIED)
_MAX_EVENTS = 5_000
"""Pressure events kept per run (a ``random`` scenario makes hundreds a second)."""

ProgressCallback = Callable[[int], None]
"""Called with the number of operations replayed since the last call."""


@dataclass
class Timeline:
    """Samples taken between chunks of operations: sample ``k`` covers the operations from ``op[k - 1]`` to
    ``op[k] - 1``. Live and reserved bytes are the most over those operations (so that no spike is lost
    between samples; Note [Peaks between samples]), the other fields the state after the last of them."""

    op: list[int] = field(default_factory=list)
    live_nbytes: list[int] = field(default_factory=list)
    """The most bytes the program had allocated (requested sizes) during the interval."""
    reserved_nbytes: list[int] = field(default_factory=list)
    """The most bytes the allocator held during the interval."""
    external_fragmentation: list[float] = field(default_factory=list)
    largest_free_nbytes: list[int] = field(default_factory=list)
    tenant_nbytes: list[int] = field(default_factory=list)
    """Device memory other tenants held (0 without a pressure scenario)."""


@dataclass(frozen=True)
class PressureEvent:
    """A tenant took, gave back or was denied memory while operation ``op`` ran (within a sample)."""

    op: int
    kind: str
    nbytes: int
    sim_time_s: float


@dataclass(frozen=True)
class OomPoint:
    """An allocation the allocator could not serve."""

    op: int
    nbytes: int
    live_nbytes: int
    reserved_nbytes: int


@dataclass
class PolicyRun:
    """One sampled replay of a trace on one device under one policy."""

    device: str
    policy: str
    result: ReplayResult | None
    """None when the policy cannot run on the device (:attr:`unsupported` says why)."""
    timeline: Timeline = field(default_factory=Timeline)
    ooms: list[OomPoint] = field(default_factory=list)
    pressure: list[PressureEvent] = field(default_factory=list)
    unsupported: str | None = None


def run_policy(trace: Trace, device_spec: str, policy: str, *, samples: int = 1500, stop_on_oom: bool = True,
               on_progress: ProgressCallback | None = None, gpu_timing: "str | GpuTiming | None" = None) -> PolicyRun:
    """Replay ``trace`` on a fresh ``device_spec`` under ``policy``, sampling about ``samples`` times, with the
    program's GPU work run as ``gpu_timing`` says (:func:`gpumem.replay.replay`).

    A policy the device cannot run (virtual memory on a device without it) gives a run with
    :attr:`PolicyRun.unsupported` set; every other error propagates.
    """
    kinds, ids, sizes, streams = trace.as_lists()
    n = len(kinds)
    ptrs = [0] * (max(ids) + 1 if ids else 0)
    chunk = max(1, -(-n // max(1, samples)))
    dev = open_device(device_spec)
    try:
        try:
            allocator = CachingAllocator(dev, policy)
        except UnsupportedOperationError as exc:
            return PolicyRun(device=dev.spec, policy=policy, result=None, unsupported=str(exc))
        run = PolicyRun(device=dev.spec, policy=allocator.policy.name, result=None)
        current = [0]
        sub = None
        events = getattr(dev, "events", None)
        if events is not None and hasattr(events, "subscribe"):
            def on_event(ev: object) -> None:
                kind = getattr(ev, "kind", None)
                if kind in _PRESSURE_KINDS and len(run.pressure) < _MAX_EVENTS:
                    run.pressure.append(PressureEvent(current[0], kind.value, int(getattr(ev, "nbytes", 0)),
                                                      float(getattr(ev, "time_s", 0.0) or 0.0)))
            sub = events.subscribe(on_event)
        tenant = (lambda: dev.tenant_nbytes) if hasattr(type(dev), "tenant_nbytes") else None  # a property
        try:
            gpu = program_gpu(trace, dev, gpu_timing)
            run.result = _replay_sampled(trace, allocator, dev, kinds, ids, sizes, streams, ptrs, chunk, run,
                                         current, tenant, stop_on_oom, on_progress, gpu)
        finally:
            if sub is not None:
                events.unsubscribe(sub)
            allocator.close()
        return run
    finally:
        dev.close()


class _Sampler:
    """Note [Peaks between samples]: querying the allocator after every operation would double a replay's
    time, so the state is read after each chunk. The live bytes of the interval come from the trace (its
    running sum, exact while no allocation was skipped); the reserved bytes are the most of the reserved
    bytes at both ends and, when the allocator's peak rose during the interval, that new peak, which is
    exact unless memory was given back and taken again within one interval."""

    def __init__(self, run: PolicyRun, allocator: CachingAllocator, trace_live: "np.ndarray",
                 tenant: Callable[[], int] | None) -> None:
        self.run, self.allocator, self.trace_live, self.tenant = run, allocator, trace_live, tenant
        self.last_op = 0
        self.last_reserved = 0
        self.last_peak = 0
        self.exact_live = True

    def sample(self, op: int) -> None:
        st = self.allocator.snapshot_stats()
        tl = self.run.timeline
        live = st.requested_nbytes
        if self.exact_live and op > self.last_op:
            live = max(live, int(self.trace_live[self.last_op:op].max()))
        reserved = max(st.reserved_nbytes, self.last_reserved)
        if st.peak_reserved_nbytes > self.last_peak:
            reserved = max(reserved, st.peak_reserved_nbytes)
        tl.op.append(op)
        tl.live_nbytes.append(live)
        tl.reserved_nbytes.append(reserved if op else st.reserved_nbytes)
        tl.external_fragmentation.append(st.external_fragmentation)
        tl.largest_free_nbytes.append(st.largest_free_nbytes)
        tl.tenant_nbytes.append(int(self.tenant()) if self.tenant is not None else 0)
        self.last_op, self.last_reserved, self.last_peak = op, st.reserved_nbytes, st.peak_reserved_nbytes


def _replay_sampled(trace: Trace, allocator: CachingAllocator, dev: Device, kinds: list[int], ids: list[int],
                    sizes: list[int], streams: list[int], ptrs: list[int], chunk: int, run: PolicyRun,
                    current: list[int], tenant: Callable[[], int] | None, stop_on_oom: bool,
                    on_progress: ProgressCallback | None, gpu: ProgramGpu | None = None) -> ReplayResult:
    """The loop of :func:`gpumem.replay.replay`, with a sample after every ``chunk`` operations."""
    n = len(kinds)
    allocate = allocator.allocate
    free = allocator.free
    sim_start = getattr(dev, "now_s", None)
    ooms = 0
    oom_error: OutOfMemoryError | None = None
    oom_op: int | None = None
    done = 0
    wall_s = 0.0
    at = [0]  # the operation that failed, set by run_ops (for an out-of-memory error)
    uses = stream_use_plan(trace, allocator)
    sampler = _Sampler(run, allocator, trace.live_nbytes(), tenant)
    sampler.sample(0)
    while done < n:
        stop = min(done + chunk, n)
        current[0] = done
        start = done
        t0 = time.perf_counter()
        try:
            run_ops(allocate, free, (kinds, ids, sizes, streams), ptrs, done, stop, gpu, at, uses)
            done = stop
            wall_s += time.perf_counter() - t0
        except OutOfMemoryError as exc:
            wall_s += time.perf_counter() - t0
            i = at[0]
            ooms += 1
            if oom_error is None:
                oom_error, oom_op = exc, i
            st = allocator.snapshot_stats()
            run.ooms.append(OomPoint(i, sizes[i], st.requested_nbytes, st.reserved_nbytes))
            sampler.exact_live = False if not stop_on_oom else sampler.exact_live
            if stop_on_oom:
                done = i
                sampler.sample(done)
                if on_progress is not None:
                    on_progress(n - start)
                break
            done = i + 1
        sampler.sample(done)
        if on_progress is not None:
            on_progress(done - start)
    # the calls the replay made, as gpumem.replay.replay counts them
    extra: dict[str, Any] = {"engine": getattr(allocator, "engine", "python"), **calls_made(trace, allocator, done)}
    extra.update(gpu.finish() if gpu is not None else {"gpu_timing": GpuTiming.IDLE.value})
    stats = allocator.snapshot_stats()
    sim_end = getattr(dev, "now_s", None)
    return ReplayResult(
        trace=trace.name, device=dev.spec, policy=allocator.policy.name, n_ops=n, n_allocs=trace.n_allocs,
        completed_ops=done, peak_live_bytes=stats.peak_requested_nbytes,
        peak_reserved_bytes=stats.peak_reserved_nbytes, ooms=ooms, wall_s=wall_s, stats=stats,
        sim_time_s=(sim_end - sim_start) if sim_start is not None and sim_end is not None else None,
        oom_message=None if oom_error is None else str(oom_error), oom_error=oom_error, oom_op=oom_op,
        trace_peak_live_bytes=trace.peak_live_nbytes, extra=extra,
    )


# -- the layout at the peak ------------------------------------------------------------------------------


@dataclass
class SegmentLayout:
    """One segment (``malloc``'d) or virtual range of the allocator, as offsets from its base."""

    base: int
    extent_nbytes: int
    """Bytes shown: the segment, or the virtual range up to its last mapped or tiled page."""
    small: bool
    virtual: bool
    live: list[tuple[int, int]]
    """``(start, end)`` of live blocks."""
    mapped: list[tuple[int, int]]
    """``(start, end)`` runs backed by device memory (the whole segment without virtual memory)."""

    @property
    def live_nbytes(self) -> int:
        return sum(e - s for s, e in self.live)

    @property
    def mapped_nbytes(self) -> int:
        return sum(e - s for s, e in self.mapped)

    def holes(self) -> list[int]:
        """Sizes of the free holes: maximal runs of held (mapped) memory that no live block uses."""
        out: list[int] = []
        li = 0
        live = self.live
        for ms, me in self.mapped:
            pos = ms
            while li < len(live) and live[li][1] <= ms:
                li += 1
            j = li
            while j < len(live) and live[j][0] < me:
                s, e = live[j]
                if s > pos:
                    out.append(s - pos)
                pos = max(pos, e)
                j += 1
            if me > pos:
                out.append(me - pos)
        return out


@dataclass
class Occupancy:
    """The allocator's segments at one operation."""

    op: int
    """The state is the one after operations ``0 .. op - 1``."""
    segments: list[SegmentLayout]
    reserved_nbytes: int
    stopped_by_oom: bool = False


def occupancy_at(trace: Trace, device_spec: str, policy: str, stop_op: int,
                 gpu_timing: "str | GpuTiming | None" = None) -> Occupancy | None:
    """Replay operations ``0 .. stop_op - 1`` on the Python engine, with the program's GPU work run as
    ``gpu_timing`` says (as :func:`run_policy`), and read the layout (None when the policy cannot run on the
    device). An out-of-memory error before ``stop_op`` stops there."""
    kinds, ids, sizes, streams = trace.as_lists()
    ptrs = [0] * (max(ids) + 1 if ids else 0)
    dev = open_device(device_spec)
    try:
        try:
            allocator = CachingAllocator(dev, policy, engine="python")
        except UnsupportedOperationError:
            return None
        try:
            done = stop_op
            oom = False
            gpu = program_gpu(trace, dev, gpu_timing)
            at = [0]
            try:
                run_ops(allocator.allocate, allocator.free, (kinds, ids, sizes, streams), ptrs, 0, stop_op, gpu, at,
                        stream_use_plan(trace, allocator))
            except OutOfMemoryError:
                done, oom = at[0], True
            return Occupancy(done, _layout(allocator), allocator.reserved_nbytes, oom)
        finally:
            allocator.close()
    finally:
        dev.close()


def _layout(allocator: CachingAllocator) -> list[SegmentLayout]:
    backing = allocator.backing
    virtual = isinstance(backing, VirtualBacking)
    out: list[SegmentLayout] = []
    for seg in sorted(backing.segments_list(), key=lambda s: s.base):
        blocks = []
        b = seg.last
        while b is not None:
            blocks.append(b)
            b = b.prev
        blocks.reverse()
        live = [(b.addr - seg.base, b.addr + b.size - seg.base) for b in blocks
                if b.allocated or b.fences is not None]
        if virtual:
            page = seg.page_nbytes  # type: ignore[attr-defined]
            chunks = seg.chunks  # type: ignore[attr-defined]
            mapped: list[tuple[int, int]] = []
            last_page = -1
            for p, handle in enumerate(chunks):
                if handle is None:
                    continue
                last_page = p
                if mapped and mapped[-1][1] == p * page:
                    mapped[-1] = (mapped[-1][0], (p + 1) * page)
                else:
                    mapped.append((p * page, (p + 1) * page))
            top = seg.top  # type: ignore[attr-defined]
            extent = max((last_page + 1) * page, -(-top // page) * page)
        else:
            extent = seg.nbytes
            mapped = [(0, seg.nbytes)]
        out.append(SegmentLayout(seg.base, extent, bool(seg.small), virtual, _merge(live), mapped))
    out += _arena_layouts(allocator)
    return out


def _arena_layouts(allocator: CachingAllocator) -> list[SegmentLayout]:
    """The step plan's arenas (Note [Step plans] in :mod:`gpumem.allocator.plan`) as virtual ranges: a replay
    that makes a trace's plan events (Note [Plan events in a replay] in :mod:`gpumem.replay`) serves a planned
    step's allocations there, outside the backing's segments, so a layout without them showed the peak of a
    planned run as empty memory (its reserved bytes all in the arena)."""
    plan = getattr(allocator._engine, "_plan", None)
    out: list[SegmentLayout] = []
    for arena in sorted(plan.arenas if plan is not None else (), key=lambda a: a.base):
        g = arena.g
        mapped = _merge([(p * g, (p + 1) * g) for p, handle in enumerate(arena.pages) if handle is not None])
        live = sorted((ptr - arena.base, ptr - arena.base + size) for ptr, (_, size, _) in arena.live.items())
        extent = max(mapped[-1][1] if mapped else 0, arena.extent_nbytes)
        out.append(SegmentLayout(arena.base, extent, False, True, _merge(live), mapped))
    return out


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in runs:
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


# -- the smallest limit ----------------------------------------------------------------------------------


def runs_under(trace: Trace, device_spec: str, policy: str, limit: int | None, *, profile: Any = None,
               gpu_timing: "str | GpuTiming | None" = None) -> bool:
    """Whether ``trace`` replays on ``device_spec`` under ``policy`` and ``limit`` without running out of memory
    (``profile``: a :class:`~gpumem.sim.DeviceProfile` replacing the spec's, for a simulated device;
    ``gpu_timing``: how the program's GPU work runs beside the replay)."""
    from ..replay import replay

    dev = open_device(device_spec, profile=profile) if profile is not None else open_device(device_spec)
    try:
        allocator = make_allocator(dev, policy, limit=limit)
        try:
            return replay(trace, allocator, stop_on_oom=True, progress=False, gpu_timing=gpu_timing).ooms == 0
        finally:
            allocator.close()
    finally:
        dev.close()


def smallest_limit(trace: Trace, device_spec: str, policy: str, fits_at: int, *, rel_tol: float = 0.01,
                   on_step: Callable[[], None] | None = None, profile: Any = None,
                   gpu_timing: "str | GpuTiming | None" = None) -> int | None:
    """The smallest ``limit=`` (bytes) under which ``trace`` runs, by bisection between the trace's peak live
    bytes and ``fits_at`` (a limit it is known to run under: the peak reserved of an unlimited run), to within
    ``rel_tol`` of the peak live bytes; None when the policy cannot run on the device.

    Bisection assumes that a trace that runs under a limit also runs under any larger one, which holds for
    every policy here in practice (a smaller limit only makes the allocator give memory back sooner)."""
    lo = max(1, trace.peak_live_nbytes)
    hi = max(lo, fits_at)
    tol = max(1, int(rel_tol * lo))
    try:
        if runs_under(trace, device_spec, policy, lo, profile=profile, gpu_timing=gpu_timing):
            return lo
        if on_step is not None:
            on_step()
        while hi - lo > tol:
            mid = (lo + hi) // 2
            ok = runs_under(trace, device_spec, policy, mid, profile=profile, gpu_timing=gpu_timing)
            if on_step is not None:
                on_step()
            if ok:
                hi = mid
            else:
                lo = mid
    except UnsupportedOperationError:
        return None
    except GpumemError as exc:  # pragma: no cover - a device error under a limit is reported as not fitting
        log.warning("bisection of %s under %s on %s stopped: %s", trace.name, policy, device_spec, exc)
        return None
    return hi


def peak_live_op(trace: Trace) -> int:
    """The number of operations after which the trace's live bytes first reach their peak (0 for none)."""
    live = trace.live_nbytes()
    if len(live) == 0:
        return 0
    return int(np.argmax(live)) + 1


@dataclass(frozen=True)
class FitCell:
    """One cell of the fit matrix."""

    device: str
    policy: str
    status: str
    """``runs``, ``out of memory`` or ``unsupported``."""
    smallest_limit_nbytes: int | None
    """The smallest ``limit=`` the trace runs under (without pressure), to within 1 % of its peak live bytes."""
    decided_by: str = "replay"
    """``replay``: a replay on the device; ``limit``: the smallest limit of the device's kind compared with the
    memory the device can give (the further profiles of :attr:`ReportOptions.fit_devices`)."""
