"""Replay an allocation trace through a caching allocator on any device.

>>> from gpumem.replay import replay_trace
>>> result = replay_trace("data/traces/resnet_train.snapshot.pickle.gz", "sim:h200-141gb", policy="gpumem")
>>> print(f"{result.overhead:.2%}")

``replay_trace`` takes a :class:`~gpumem.trace.Trace` or the path of a trace file
(read with :func:`~gpumem.trace.load_trace`, any format).

The replay allocates and frees exactly what the trace did, in order, and reports
the peak of the program's live bytes (what it asked for), the peak of what the
allocator reserved from the device, and

* *overhead* = peak reserved / peak live - 1: how much memory the allocator held,
  at its worst, beyond what the program had allocated (rounding, splitting, cache);
* *external fragmentation* (at the end) = 1 - largest free cached block / all free
  cached bytes: how scattered the memory the allocator keeps but does not use is;

with the allocator's stats and the time per operation. An allocation the device
cannot serve stops the replay (unless ``stop_on_oom=False``, which skips it and its
free); the first out-of-memory error is kept in :attr:`ReplayResult.oom_error`
(its text in :attr:`ReplayResult.oom_message`), with the index of the operation
that failed in :attr:`ReplayResult.oom_op`.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Union

from .allocator import CachingAllocator, make_allocator
from .allocator.bucket import BucketAllocator, BucketPolicy
from .allocator.policy import DEFAULT_POLICY, AllocatorPolicy, VmmMode
from .allocator.stats import AllocatorStats
from .device import Device
from .errors import InvalidArgumentError, OutOfMemoryError
from .progress import ProgressBar
from .sim.gpu_work import DEFAULT_GPU_TIMING, GpuTiming, GpuWorkModel, ProgramGpu, gpu_clock_problem
from .sim.gpu_work import gpu_timing as _gpu_timing
from .specs import open_device
from .trace import PlanEventKind, Trace, load_trace

log = logging.getLogger(__name__)

_CHUNK_OPS = 16_384


@dataclass
class ReplayResult:
    """What one replay measured. ``as_json()`` gives the ``gpumem replay --json`` object."""

    trace: str
    device: str
    policy: str
    n_ops: int
    n_allocs: int
    completed_ops: int
    """Operations replayed: all of them, or, when an out-of-memory error stopped the replay, those before
    the one that failed (:attr:`oom_op`, which is not counted). With ``stop_on_oom=False`` the skipped
    allocations count as replayed."""
    peak_live_bytes: int
    peak_reserved_bytes: int
    ooms: int
    wall_s: float
    stats: AllocatorStats
    sim_time_s: float | None = None
    oom_message: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    oom_error: OutOfMemoryError | None = None
    """The first out-of-memory error of the replay (None when every allocation succeeded)."""
    oom_op: int | None = None
    """0-based index, in the trace, of the operation that raised :attr:`oom_error`."""
    trace_peak_live_bytes: int = 0
    """The peak of the trace's live bytes over the whole trace (also the part not replayed after an OOM)."""

    @property
    def overhead(self) -> float:
        """``peak_reserved / peak_live - 1``."""
        return self.peak_reserved_bytes / self.peak_live_bytes - 1.0 if self.peak_live_bytes else 0.0

    @property
    def ns_per_op(self) -> float:
        """Wall-clock nanoseconds per replayed operation (allocate or free): the wall time over
        :attr:`completed_ops`."""
        return self.wall_s * 1e9 / self.completed_ops if self.completed_ops else 0.0

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "trace": self.trace,
            "device": self.device,
            "policy": self.policy,
            "n_ops": self.n_ops,
            "n_allocs": self.n_allocs,
            "completed_ops": self.completed_ops,
            "peak_live_bytes": self.peak_live_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "overhead": self.overhead,
            "ooms": self.ooms,
            "wall_s": self.wall_s,
            "ns_per_op": self.ns_per_op,
            "sim_time_s": self.sim_time_s,
            "device_calls": self.stats.device_calls,
            "cache_hits": self.stats.cache_hits,
            "cache_misses": self.stats.cache_misses,
            "external_fragmentation_at_end": self.stats.external_fragmentation,
        }
        out["trace_peak_live_bytes"] = self.trace_peak_live_bytes
        if self.oom_message:
            out["oom"] = self.oom_message
            out["oom_op"] = self.oom_op
            out["oom_injected"] = bool(getattr(self.oom_error, "injected", False))
        out.update(self.extra)
        return out


def program_gpu(trace: Trace, device: Device, gpu_timing: "str | GpuTiming | None",
                gpu_model: GpuWorkModel | None = None) -> ProgramGpu | None:
    """The program's GPU work for a replay of ``trace`` on ``device`` (None for ``idle``: no work).

    ``gpu_timing`` None is the default on a simulated device (:func:`default_gpu_timing`: ``gpu-clock`` for a
    trace recorded with its GPU clock, else ``trace``), and ``idle`` on a real one (which runs no recorded
    program); ``trace``, ``model`` or ``gpu-clock`` named on a real device raises InvalidArgumentError (Note [The
    GPU runs behind the CPU] in :mod:`gpumem.sim.gpu_work`)."""
    from .sim import SimDevice

    if gpu_timing is None and not isinstance(device, SimDevice):
        return None
    timing = _gpu_timing(gpu_timing) if gpu_timing is not None else default_gpu_timing(trace)
    if timing is GpuTiming.IDLE:
        if gpu_model is not None:
            raise InvalidArgumentError("gpu_model is for gpu_timing 'trace' or 'model', not 'idle'")
        return None
    return ProgramGpu(trace, device, timing, gpu_model)


def default_gpu_timing(trace: Trace) -> GpuTiming:
    """The GPU timing a replay of ``trace`` on a simulated device takes when none is named: ``gpu-clock`` where
    the trace has its GPU clock and can be replayed on it (Note [A replay on the recorded GPU clock]), else the
    default (``trace``; a :class:`GpuClockUnusedWarning` says why a clock the trace has is left unused)."""
    if trace.gpu_times_us is None:
        return DEFAULT_GPU_TIMING
    why = gpu_clock_problem(trace)
    if why:
        # warnings, not logging: shown once per message, where a report replays the trace dozens of times
        warnings.warn(f"{why}; replaying under {DEFAULT_GPU_TIMING.value!r} timing", GpuClockUnusedWarning,
                      stacklevel=3)
        return DEFAULT_GPU_TIMING
    return GpuTiming.GPU_CLOCK


class GpuClockUnusedWarning(UserWarning):
    """A trace carries its GPU clock but cannot be replayed on it (:func:`default_gpu_timing`)."""


class StreamUsePlan:
    """The calls a program made between its allocations, as a replay loop makes them: its stream uses
    (:attr:`Trace.stream_uses`: before op ``at_op``, ``record_stream(ptr, stream)`` of the block allocation
    ``alloc_id`` got, none for a zero-byte one) and, where they apply, its step-plan events
    (:attr:`Trace.plan_events`: ``mark_step()``, ``start_plan_warmup()``, ``stop_plan_warmup()``).

    Note [Stream uses in a replay]: a program that uses a block on another stream than the one it was
    allocated on tells the allocator so (``record_stream``); its free then records a fence on each such
    stream and the block is reusable only once the work queued there until the free has run (Note
    [Streams] in :mod:`gpumem.allocator.caching`: both engines). A replay makes the same call where the
    trace has it, so the engine keeps the block back just as live; under ``idle`` timing every fence is
    complete when recorded, so a use changes where a freed block waits (pending until the next miss), not
    the figures of a trace without uses, which replays exactly as before (no call is made). A use after
    the last op is not made: no later op can see it.

    Note [Plan events in a replay]: gpumem.torch marks a step plan's steps (by default at every optimizer
    step) and begins its memory-first warm-up, and its trace records where (Note [Automatic step marks] in
    :mod:`gpumem.torch`); a replay that left them out would predict an unplanned run (5 % above peak
    allocated where the live run held 0.56 %). So a replay makes them where the trace has them, under the
    policies gpumem.torch can run (``vmm`` AUTO: gpumem's own); the models of other allocators (``pytorch``,
    ``expandable``, ``cupy``, ``bestfit``: ``vmm`` NEVER or ALWAYS) have no step plans and replay the ops
    alone, as their allocator would have served the program; so does a device without virtual memory management
    (a plan's arena is an address range of its own), as gpumem.torch cannot run there. An event after the last
    op is not made."""

    __slots__ = ("positions", "by_op", "record_stream", "plans_by_op", "plan_calls", "uses_first")

    def __init__(self, trace: Trace, record_stream: Any, allocator: Any = None) -> None:
        by_op: dict[int, list[tuple[int, int]]] = {}
        for u in trace.stream_uses:
            if u.at_op < trace.n_ops:
                by_op.setdefault(u.at_op, []).append((u.alloc_id, u.stream))
        plans_by_op: dict[int, list[PlanEventKind]] = {}
        self.plan_calls: dict[PlanEventKind, Any] = {}
        if allocator is not None:
            for e in trace.plan_events:
                if e.at_op < trace.n_ops:
                    plans_by_op.setdefault(e.at_op, []).append(e.kind)
            self.plan_calls = {PlanEventKind.MARK: allocator.mark_step,
                               PlanEventKind.WARMUP_START: allocator.start_plan_warmup,
                               PlanEventKind.WARMUP_STOP: allocator.stop_plan_warmup}
        self.by_op = by_op
        self.plans_by_op = plans_by_op
        self.positions = sorted(set(by_op) | set(plans_by_op))
        self.record_stream = record_stream
        # Note [Plan events and stream uses at one place]: a trace keeps its uses and its plan events apart, each
        # at an op; where both lie before one op their order is lost, and it decides (a mark after a use sees
        # the step used on another stream and does not plan it; one before it may). Their times keep it (one
        # clock, gpumem.torch's recorder): where every use there came before every plan event, the uses are
        # made first; else (times unknown or equal, or interleaved) the plan events, as before.
        self.uses_first: set[int] = set()
        if plans_by_op and by_op:
            use_last: dict[int, float] = {}
            for u in trace.stream_uses:
                if u.at_op in plans_by_op and u.at_op < trace.n_ops:
                    use_last[u.at_op] = max(use_last.get(u.at_op, -math.inf), u.time_us)
            plan_first: dict[int, float] = {}
            for e in trace.plan_events:
                if e.at_op in use_last:
                    plan_first[e.at_op] = min(plan_first.get(e.at_op, math.inf), e.time_us)
            self.uses_first = {i for i, t in use_last.items() if t < plan_first[i]}

    def apply(self, i: int, ptrs: list[int]) -> None:
        """Make the calls recorded before op ``i``."""
        if i not in self.uses_first:
            for kind in self.plans_by_op.get(i, ()):
                self.plan_calls[kind]()
        record = self.record_stream
        for aid, stream in self.by_op.get(i, ()):
            p = ptrs[aid]
            if p:
                record(p, stream)
        if i in self.uses_first:
            for kind in self.plans_by_op[i]:
                self.plan_calls[kind]()

    def segments(self, start: int, stop: int) -> list[int]:
        """The positions in ``[start, stop)`` where calls are made."""
        pos = self.positions
        return pos[bisect.bisect_left(pos, start):bisect.bisect_left(pos, stop)]


def plan_events_apply(allocator: Any) -> bool:
    """Whether a replay on ``allocator`` makes a trace's step-plan events (Note [Plan events in a replay]): a
    caching allocator under a policy gpumem.torch can run, on a device with virtual memory management."""
    policy = getattr(allocator, "policy", None)
    return (isinstance(allocator, CachingAllocator) and isinstance(policy, AllocatorPolicy)
            and policy.vmm is VmmMode.AUTO and bool(getattr(allocator.device, "vmm_supported", False)))


def calls_made(trace: Trace, allocator: Any, done: int) -> dict[str, int]:
    """The calls a replay of ``trace`` on ``allocator`` made between its ops, having done ops ``0 .. done - 1``:
    ``n_stream_uses`` (``record_stream``) and ``n_plan_events``, those before an op it reached (none after the
    last op: :class:`StreamUsePlan` makes none there; plan events only where they apply)."""
    n = trace.n_ops
    return {"n_stream_uses": sum(1 for u in trace.stream_uses if u.at_op <= done and u.at_op < n),
            "n_plan_events": (sum(1 for e in trace.plan_events if e.at_op <= done and e.at_op < n)
                              if plan_events_apply(allocator) else 0)}


def stream_use_plan(trace: Trace, allocator: Any) -> StreamUsePlan | None:
    """The plan of ``trace``'s stream uses and step-plan events on ``allocator`` (None: the trace has none to
    make there).

    Raises:
        InvalidArgumentError: the trace has stream uses and the allocator has no ``record_stream``
            (the size-bucket pool).
    """
    plans = plan_events_apply(allocator) and any(e.at_op < trace.n_ops for e in trace.plan_events)
    has_uses = any(u.at_op < trace.n_ops for u in trace.stream_uses)
    if not has_uses and not plans:
        return None
    record = getattr(allocator, "record_stream", None)
    if record is None and has_uses:
        n = len(trace.stream_uses)
        raise InvalidArgumentError(f"{trace.name} has {n} stream use{'' if n == 1 else 's'} (record_stream); "
                                   f"the {type(allocator).__name__} cannot take them: replay it under a policy "
                                   "of the caching allocator (gpumem, pytorch, expandable, cupy, bestfit)")
    return StreamUsePlan(trace, record, allocator if plans else None)


def run_ops(allocate: Any, free: Any, ops: tuple[list[int], list[int], list[int], list[int]], ptrs: list[int],
            start: int, stop: int, gpu: ProgramGpu | None = None, at: list[int] | None = None,
            uses: StreamUsePlan | None = None) -> None:
    """Operations ``start .. stop-1`` of a replay: the one loop of :func:`replay` and of the report's runs
    (:mod:`gpumem.report.runs`, which samples between chunks); with ``gpu``, beside the program's GPU work
    (:func:`run_ops_with_gpu`, ``at[0]``: the operation being done); with ``uses``, the trace's stream
    uses made where it has them (Note [Stream uses in a replay])."""
    if uses is not None:
        a = start
        for i in uses.segments(start, stop):
            run_ops(allocate, free, ops, ptrs, a, i, gpu, at)
            if at is not None:
                at[0] = i
            uses.apply(i, ptrs)
            a = i
        run_ops(allocate, free, ops, ptrs, a, stop, gpu, at)
        return
    if gpu is not None:
        run_ops_with_gpu(gpu, allocate, free, ops, ptrs, start, stop, at if at is not None else [0])
        return
    kinds, ids, sizes, streams = ops
    i = start
    try:
        for i in range(start, stop):
            if kinds[i] == 0:
                # a zero-byte allocation (valid in a Trace) takes no memory, as in PyTorch and CUDA; the
                # allocator rejects nbytes=0, so it gets no pointer and its free is skipped
                ptrs[ids[i]] = allocate(sizes[i], streams[i]) if sizes[i] else 0
            else:
                p = ptrs[ids[i]]
                if p:
                    free(p)
                    ptrs[ids[i]] = 0
    except BaseException:
        if at is not None:
            at[0] = i   # the operation that failed, for the caller's out-of-memory report
        raise


def run_ops_with_gpu(gpu: ProgramGpu, allocate: Any, free: Any, ops: tuple[list[int], list[int], list[int], list[int]],
                     ptrs: list[int], start: int, stop: int, at: list[int]) -> None:
    """Operations ``start .. stop-1`` of a replay with the program's GPU work beside them (``at[0]``: the
    operation being done, for the caller's out-of-memory report). The loop of :func:`replay` otherwise."""
    kinds, ids, sizes, streams = ops
    before, after = gpu.before, gpu.after
    for i in range(start, stop):
        at[0] = i
        before(i)
        if kinds[i] == 0:
            ptr = ptrs[ids[i]] = allocate(sizes[i], streams[i]) if sizes[i] else 0
        else:
            ptr = 0
            p = ptrs[ids[i]]
            if p:
                free(p)
                ptrs[ids[i]] = 0
        after(i, ptr)


def replay(trace: Trace, allocator: "CachingAllocator | BucketAllocator", *, stop_on_oom: bool = True,
           progress: bool | None = None, gpu_timing: "str | GpuTiming | None" = None,
           gpu_model: GpuWorkModel | None = None, gpu: ProgramGpu | None = None) -> ReplayResult:
    """Replay ``trace`` through ``allocator`` (which keeps its state afterwards: live blocks
    of allocations the trace never freed stay allocated).

    ``gpu_timing`` (``trace``, ``model``, ``idle`` or ``gpu-clock``, the last for a trace recorded with its GPU
    clock, :attr:`Trace.gpu_times_us`; None: the default, :func:`program_gpu`) chooses how the program's GPU work
    runs beside the replay, ``gpu_model`` its constants (Note [The GPU runs behind the CPU] in
    :mod:`gpumem.sim.gpu_work`); or ``gpu``, one made already (:func:`program_gpu`)."""
    if gpu is None:
        gpu = program_gpu(trace, allocator.device, gpu_timing, gpu_model)
    elif gpu_timing is not None or gpu_model is not None:
        raise InvalidArgumentError("replay: give gpu, or gpu_timing and gpu_model, not both")
    kinds, ids, sizes, streams = trace.as_lists()
    n = len(kinds)
    ptrs = [0] * (max(ids) + 1 if ids else 0)
    uses = stream_use_plan(trace, allocator)
    allocate = allocator.allocate
    free = allocator.free
    device = allocator.device
    sim_start = getattr(device, "now_s", None)
    # the simulator's sanitizer in count mode records hazards instead of raising: the replay says how many it saw
    hazards = getattr(device, "hazards", None) if getattr(device, "sanitizer", None) == "count" else None
    hazards_before = len(hazards) if isinstance(hazards, list) else None
    bar = ProgressBar(n, f"replay {trace.name}", enabled=progress)
    ooms = 0
    oom_error: OutOfMemoryError | None = None
    oom_op: int | None = None
    done = 0
    at = [0]  # the operation that failed, set by run_ops (for an out-of-memory error)
    t0 = time.perf_counter()
    try:
        while done < n:
            stop = min(done + _CHUNK_OPS, n)
            try:
                run_ops(allocate, free, (kinds, ids, sizes, streams), ptrs, done, stop, gpu, at, uses)
                done = stop
            except OutOfMemoryError as exc:
                i = at[0]
                ooms += 1
                if oom_error is None:
                    oom_error, oom_op = exc, i
                if stop_on_oom:
                    done = i  # ops 0 .. i-1 were done; op i failed and is not counted as completed
                    # the caller reports the error (ReplayResult.oom_error): logged here only for debugging
                    log.debug("replay of %s stopped at op %d (0-based) of %d: %s", trace.name, i, n, exc)
                    break
                done = i + 1  # the failed allocation is skipped (and its free): the replay goes on after it
            bar.update(done)
    finally:
        wall_s = time.perf_counter() - t0
        bar.close(done)
    extra: dict[str, Any] = {"engine": getattr(allocator, "engine", "python"), **calls_made(trace, allocator, done)}
    extra.update(gpu.finish() if gpu is not None else {"gpu_timing": GpuTiming.IDLE.value})
    if hazards_before is not None:
        extra["sanitizer_hazards"] = dict(Counter(h.call for h in hazards[hazards_before:]))   # type: ignore[index]
    stats = allocator.snapshot_stats()
    sim_end = getattr(device, "now_s", None)
    return ReplayResult(
        trace=trace.name,
        device=device.spec,
        policy=allocator.policy.name,
        n_ops=n,
        n_allocs=trace.n_allocs,
        completed_ops=done,
        peak_live_bytes=stats.peak_requested_nbytes,
        peak_reserved_bytes=stats.peak_reserved_nbytes,
        ooms=ooms,
        wall_s=wall_s,
        stats=stats,
        sim_time_s=(sim_end - sim_start) if sim_start is not None and sim_end is not None else None,
        oom_message=None if oom_error is None else str(oom_error),
        oom_error=oom_error,
        oom_op=oom_op,
        trace_peak_live_bytes=trace.peak_live_nbytes,
        extra=extra,
    )


def replay_trace(trace: Union[Trace, str, "os.PathLike[str]"], device: str | Device = "sim:h200-141gb",
                 policy: "str | AllocatorPolicy | BucketPolicy" = DEFAULT_POLICY, *, stop_on_oom: bool = True,
                 progress: bool | None = None, gpu_timing: "str | GpuTiming | None" = None,
                 gpu_model: GpuWorkModel | None = None, **allocator_options: Any) -> ReplayResult:
    """Replay ``trace`` on ``device`` and return what it measured.

    ``trace`` is a :class:`~gpumem.trace.Trace` or the path of a trace file in any format
    :func:`~gpumem.trace.load_trace` reads (load it yourself to force a format or pick a
    device of a multi-GPU snapshot). ``device`` is a spec (opened and closed here) or an
    open :class:`Device` (left open). ``policy`` is a caching-allocator policy
    (``gpumem``, ``bestfit``, ``pytorch``, ``cupy``, ...) or ``"bucket"``, the size-bucket pool
    (:mod:`gpumem.allocator.bucket`). ``allocator_options`` go to the allocator
    (``limit=`` among them; ``max_pooled_per_bucket=`` for the bucket pool). ``gpu_timing`` (``trace``,
    ``model``, ``idle``, ``gpu-clock``) and ``gpu_model``: how the program's GPU work runs beside the replay
    (:func:`replay`; Note [The GPU runs behind the CPU] in :mod:`gpumem.sim.gpu_work`).
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = load_trace(trace)
    elif not isinstance(trace, Trace):
        raise InvalidArgumentError(f"replay_trace: trace must be a Trace or a path, got {type(trace).__name__}")
    own_device = not isinstance(device, Device)
    dev = open_device(device) if own_device else device  # type: ignore[arg-type]
    try:
        allocator = make_allocator(dev, policy, **allocator_options)
        try:
            return replay(trace, allocator, stop_on_oom=stop_on_oom, progress=progress, gpu_timing=gpu_timing,
                          gpu_model=gpu_model)
        finally:
            allocator.close()
    finally:
        if own_device:
            dev.close()
