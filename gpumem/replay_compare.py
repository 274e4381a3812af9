"""Where a replay of a live gpumem.torch trace parts from the live run, op by op.

A replay of a trace says how much memory the engine would hold; where that differs from what the live run
held, the figures alone cannot say where the two parted. gpumem.torch records, with each traced allocation,
the live engine's reserved bytes once it was made (:attr:`~gpumem.trace.Trace.live_reserved_nbytes`, ``.gmt``
version 6; Note [The live engine's reserve] in ``gpumem/_native/torch_api.cpp``). :func:`compare_live` replays
such a trace and compares the replay's reserve with the live one after every allocation that has it: the first
op where they differ is where the simulated engine first grew or stole otherwise than the live one (with the
op, its size, its stream and how far behind the GPU ran there when the trace has its clock), which is where a
study of the simulator's fidelity starts (``gpumem replay TRACE --compare-live``).

The comparison also says whether the replay put each block where the live engine did (Note [Comparing
placements]): where the reserves part but every block sits at the live address, the replay's engine parted from
the live one in how it backed the blocks with memory (grew, stole or waited), not in where it put them.

Note [Comparing reserves]
-------------------------
The reserve is compared after allocations only: a free is recorded before the engine frees the block, so live it
carries none (and a free changes no reserve: chunks are stolen or released at allocations). Both reserves count
from the engine's first byte: a trace started after the engine already held memory differs from its first
allocation on (the comparison says so when that is where they part). A replay under another policy than the live
engine's (gpumem.torch runs ``gpumem`` unless configured otherwise; the trace does not name it) compares two
engines, not the simulator with the card: the comparison names the policy it replayed when it is not the
default. A trace recorded without the GPU clock replays under ``trace`` timing, whose guess of the GPU's lag is a
cause of differences of its own. The replay's reserve is read after each allocation through the allocator's
``reserved_nbytes``, outside the timed GPU model (no simulated time passes), so the comparison does not change
the replay. What the trace does not hold makes differences the comparison cannot tell from the engine's: memory
the live engine gave back or took outside the traced allocations (``gpumem.torch.empty_cache()``, another library
on the same engine), and, in a program allocating from several threads, a reserve read after another thread's
allocation (the reserve is read once the op is made, outside the recorder's lock).

Note [Comparing placements]
---------------------------
A trace keeps each allocation's live address, but the live and the replayed engine reserve their address ranges
wherever their devices put them, so addresses are compared relative to a range. The replay's pointer tells which
of its device's reservations holds it (looked up when the allocation is made, by the reservation's serial: a range
may be given back and another reserved at its address); the first allocation in a reservation fixes that
reservation's shift, live address less replayed; a later one in the same reservation is placed as live when its
shift is the same. Allocations outside any reservation (segment policies, ``malloc``'d memory), on a device that
cannot say which reservation holds a pointer, or with no live address (0) are not compared: no placement count is
given when none is. A placement difference at a reservation's first allocation shows only as the shift of every
later one there, so the count is of allocations at the live place relative to the first, which is what a study of
where the engines part needs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .allocator.policy import DEFAULT_POLICY
from .errors import InvalidArgumentError
from .trace import OpKind, Trace
from .units import format_bytes

__all__ = ["ClockFloor", "LiveComparison", "LiveDivergence", "ReserveCapture", "clock_floor", "compare_live",
           "compare_reserves", "comparison_json"]


@dataclass(frozen=True)
class ClockFloor:
    """How far behind the CPU a trace's GPU clock is at its least (the 1st percentile of the GPU's lag) in the first
    and in the last second of the ops it stamped: where the GPU idled, an idle GPU's lag."""

    first_second_us: float
    last_second_us: float
    seconds: int
    """How many seconds the stamped ops span (1: the first second is the last)."""

    def describe(self) -> str:
        where = (f"{self.first_second_us:.4g} µs (one second of stamps)" if self.seconds == 1 else
                 f"{self.first_second_us:.4g} µs in the first second, {self.last_second_us:.4g} µs in the last")
        return (where + " (an idle GPU's lag where it idled: a few µs, below 0 where stamps sit at their record; tens "
                "of µs or growing is a clock that drifted, which the replay reads as queued work: docs/gpu-timing.md)")


@dataclass(frozen=True)
class LiveDivergence:
    """One allocation where the replay's reserve and the live one differ."""

    op: int
    """The op's index in the trace."""
    nbytes: int
    """Its size."""
    stream: int
    time_us: float
    """When the program made it, on the trace's clock."""
    live_reserved_nbytes: int
    """What the live engine held once it was made."""
    replayed_reserved_nbytes: int
    """What the replay's engine held once it was made."""
    gpu_lag_us: float | None
    """How far behind the CPU the GPU ran there (the trace's GPU clock less its clock), None without a clock."""

    @property
    def gap_nbytes(self) -> int:
        """Replayed less live (above 0: the replay held more)."""
        return self.replayed_reserved_nbytes - self.live_reserved_nbytes

    def describe(self) -> str:
        lag = "" if self.gpu_lag_us is None else f", the GPU {self.gpu_lag_us / 1e3:.3f} ms behind"
        return (f"op {self.op:,} (allocation of {format_bytes(self.nbytes)} on stream {self.stream} at "
                f"{self.time_us / 1e6:.6f} s{lag}): live held {format_bytes(self.live_reserved_nbytes)}, the replay "
                f"{format_bytes(self.replayed_reserved_nbytes)} ({self.gap_nbytes / 2**20:+,.1f} MiB)")


@dataclass(frozen=True)
class LiveComparison:
    """A replay's reserve against the live engine's (Note [Comparing reserves])."""

    trace: str
    allocations_compared: int
    """Allocations whose live reserve the trace has and the replay made."""
    allocations_recorded: int
    """Allocations whose live reserve the trace has (more than those compared where the replay stopped early)."""
    allocations_differing: int
    first: LiveDivergence | None
    """The first allocation where the two differ; None when they agree at every one."""
    largest: LiveDivergence | None
    """The allocation where they differ most (in either direction)."""
    live_peak_reserved_nbytes: int
    """The most the live engine held at the allocations compared."""
    replayed_peak_reserved_nbytes: int
    """The most the replay's engine held at the same allocations."""
    result: Any = field(default=None, compare=False, repr=False)
    """The replay's :class:`~gpumem.replay.ReplayResult`."""
    first_alloc_op: int = field(default=-1, compare=False, repr=False)
    """The trace's first allocation (a difference there may be memory held before the trace began)."""
    stopped_at_op: int | None = None
    """The op at which the replay stopped by out of memory (None: it replayed the whole trace)."""
    policy: str = ""
    """The policy the replay ran (named in :meth:`lines` when it is not the default, gpumem.torch's)."""
    clock_floor: ClockFloor | None = None
    """The trace's GPU clock at its least behind in its first and its last second (:func:`clock_floor`); None
    without a clock."""
    placements_compared: int = 0
    """Allocations whose place the replay and the live run are compared at (those the replay put in an address
    reservation: Note [Comparing placements]); 0 when none was (segment policies), and then nothing is said of
    placements."""
    placed_as_live: int = 0
    """Of those, the allocations the replay put where the live engine did (relative to the first allocation in the
    same reservation)."""
    first_placed_otherwise_op: int | None = None
    """The op (index in the trace) of the first allocation put elsewhere than live; None when none was, or none
    was compared."""

    @property
    def placements_agree(self) -> bool | None:
        """Whether every allocation compared sits where the live engine put it (Note [Comparing placements]); None
        when no placement was compared. :attr:`agrees` is about the reserves only."""
        if not self.placements_compared:
            return None
        return self.first_placed_otherwise_op is None

    @property
    def agrees(self) -> bool:
        """Whether the replay held what live held after every allocation of the trace (none compared, or a replay
        stopped before the end, is not agreement)."""
        return self.first is None and self.allocations_compared > 0 and self.stopped_at_op is None

    def lines(self) -> list[str]:
        """The comparison as text, one finding per line."""
        if not self.allocations_compared:
            head = "no allocation compared with the live engine's reserve"
        else:
            whole = self.allocations_compared == self.allocations_recorded
            n = f"{self.allocations_compared:,}" + ("" if whole else f" of {self.allocations_recorded:,}")
            verdict = ("the replay held what live held after every one" + ("" if whole else " compared")
                       if self.first is None else
                       f"{self.allocations_differing:,} {'differs' if self.allocations_differing == 1 else 'differ'}")
            head = f"{n} allocations compared with the live engine's reserve: {verdict}"
        out = [head]
        if self.policy and self.policy != DEFAULT_POLICY:
            out.append(f"the replay ran the {self.policy!r} policy: gpumem.torch runs {DEFAULT_POLICY!r} "
                       "unless configured otherwise, so differences may be the policy's, not the simulator's")
        if self.stopped_at_op is not None:
            out.append(f"the replay stopped by out of memory at op {self.stopped_at_op + 1:,} (index "
                       f"{self.stopped_at_op:,} in the trace, as the ops below): the allocations from there on are not "
                       "compared")
        out.append(f"peak reserved at them: live {format_bytes(self.live_peak_reserved_nbytes)}, replay "
                   f"{format_bytes(self.replayed_peak_reserved_nbytes)} "
                   f"({(self.replayed_peak_reserved_nbytes - self.live_peak_reserved_nbytes) / 2**20:+,.1f} MiB)")
        if self.first is not None:
            out.append("first difference: " + self.first.describe())
            if self.first.op == self.first_alloc_op:
                out.append("  (at the trace's first allocation: the live engine may have held memory before the "
                           "trace began, or ran another policy)")
        if self.largest is not None:
            out.append("largest difference: " + ("the first" if self.largest == self.first else
                                                 self.largest.describe()))
        out.append(self._placement_line())
        if self.clock_floor is not None:
            out.append("the trace's GPU clock at its least behind: " + self.clock_floor.describe())
        return out

    def _placement_line(self) -> str:
        n = self.placements_compared
        if not n:
            return ("placement: not compared (no allocation the replay made sat in an address reservation the device "
                    "could name and had a live address: so under a segment policy, whose blocks live in cudaMalloc'd "
                    "segments, or a replay stopped before its first allocation)")
        where = "relative to the first allocation in the same address range"
        if self.first_placed_otherwise_op is None:
            line = (f"placement: the allocation compared sits where the live engine put it ({where})" if n == 1 else
                    f"placement: each of the {n:,} allocations compared sits where the live engine put it ({where})")
            if self.first is not None:
                line += (", so the differences above are in how the engine backed the blocks with memory (grew, "
                         "stole or waited), not where it put them")
            return line
        verb = "sits" if self.placed_as_live == 1 else "sit"
        return (f"placement: {self.placed_as_live:,} of {n:,} allocations {verb} where the live engine put them "
                f"({where}); the first elsewhere is op {self.first_placed_otherwise_op:,}")


class ReserveCapture:
    """Wraps ``allocator.allocate`` to read its reserve after each allocation a replay of ``trace`` makes (the
    allocations of more than 0 bytes, in the trace's order: what :func:`gpumem.replay.replay` calls); call
    :meth:`restore` when done."""

    def __init__(self, trace: Trace, allocator: Any) -> None:
        self.ops = np.flatnonzero((trace.kinds == OpKind.ALLOC) & (trace.nbytes > 0))
        self.reserves: list[int] = []
        self.pointers: list[int] = []
        """Each allocation's pointer in the replay, -1 where it failed or its place is not compared (no reservation
        holds it, the device cannot say, or it lies outside ``(0, 2**63)``)."""
        self.reservations: list[int] = []
        """The serial of the device reservation holding each pointer when it was made (:meth:`Device.reservation_at
        <gpumem.device.Device.reservation_at>`), -1 where none did or the device cannot say (Note [Comparing
        placements])."""
        self._allocator = allocator
        self._had_own = "allocate" in vars(allocator)
        self._own = vars(allocator).get("allocate")
        inner = allocator.allocate
        reserves, pointers, reservations = self.reserves, self.pointers, self.reservations
        reservation_at = getattr(getattr(allocator, "device", None), "reservation_at", None)

        def serial_of(ptr: int) -> int:
            if reservation_at is None or not 0 < ptr < 1 << 63:
                return -1
            try:
                hit = reservation_at(ptr)
                return -1 if hit is None else int(hit[2])
            except Exception:   # noqa: BLE001 - a device that cannot say: the allocation stands, its place is not compared
                return -1

        def allocate(nbytes: int, stream: int = 0) -> int:
            try:
                p = inner(nbytes, stream)
            except BaseException:
                reserves.append(-1)   # this op's slot: a replay that goes on pairs the next reserve with its op
                pointers.append(-1)
                reservations.append(-1)
                raise
            reserves.append(int(allocator.reserved_nbytes))
            serial = serial_of(int(p))
            pointers.append(int(p) if serial >= 0 else -1)
            reservations.append(serial)
            return p

        allocator.allocate = allocate

    def restore(self) -> None:
        """Put the allocator's ``allocate`` back."""
        if self._had_own:
            self._allocator.allocate = self._own
        else:
            del self._allocator.allocate


def clock_floor(trace: Trace) -> ClockFloor | None:
    """How far behind the CPU ``trace``'s GPU clock is at its least in its first and in its last second of stamped
    ops (Note [A stamp lies between its event's record and its completion seen] in ``gpumem/_native/torch_api.cpp``):
    an offset or drifting clock shows there, which a replay reads as queued work. None when the trace has no clock
    (or no op with both times finite)."""
    if trace.gpu_times_us is None:
        return None
    known = np.isfinite(trace.gpu_times_us) & np.isfinite(trace.times_us)
    if not known.any():
        return None
    times_us = trace.times_us[known]
    lag_us = trace.gpu_times_us[known] - times_us
    second = np.floor((times_us - times_us.min()) / 1e6)
    first, last = second == second.min(), second == second.max()
    return ClockFloor(float(np.percentile(lag_us[first], 1)), float(np.percentile(lag_us[last], 1)),
                      int(second.max() - second.min()) + 1)


def compare_reserves(trace: Trace, capture: ReserveCapture, result: Any = None, policy: str = "") -> LiveComparison:
    """The comparison of ``trace``'s live reserves with those ``capture`` read in a replay of it (under
    ``policy``, its name)."""
    live_all = trace.live_reserved_nbytes
    if live_all is None:
        raise InvalidArgumentError(f"{trace.name}: the trace has no live reserves (gpumem.torch records them with "
                                   "each allocation since .gmt version 6): nothing to compare the replay with")
    recorded = int(np.count_nonzero(live_all[capture.ops] >= 0))
    ops = capture.ops[:len(capture.reserves)]
    replayed = np.asarray(capture.reserves, dtype=np.int64)
    live = live_all[ops]
    known = (live >= 0) & (replayed >= 0)   # an allocation that failed in the replay has no reserve there
    ops, live, replayed = ops[known], live[known], replayed[known]
    diff = replayed - live
    bad = np.flatnonzero(diff != 0)

    def at(k: int) -> LiveDivergence:
        i = int(ops[k])
        lag = None
        if trace.gpu_times_us is not None and not math.isnan(float(trace.gpu_times_us[i])):
            lag = float(trace.gpu_times_us[i] - trace.times_us[i])
        return LiveDivergence(i, int(trace.nbytes[i]), int(trace.streams[i]), float(trace.times_us[i]),
                              int(live[k]), int(replayed[k]), lag)

    first = at(int(bad[0])) if len(bad) else None
    largest = at(int(bad[np.argmax(np.abs(diff[bad]))])) if len(bad) else None
    compared, placed, otherwise = _placements(trace, capture)
    # stopped: a replay that ran out of memory and did not go on (one with stop_on_oom=False finishes the trace)
    oom_op = getattr(result, "oom_op", None)
    if oom_op is not None and getattr(result, "completed_ops", 0) >= getattr(result, "n_ops", 0):
        oom_op = None
    return LiveComparison(trace.name, int(len(ops)), recorded, int(len(bad)), first, largest,
                          int(live.max()) if len(live) else 0, int(replayed.max()) if len(replayed) else 0,
                          result, int(capture.ops[0]) if len(capture.ops) else -1,
                          None if oom_op is None else int(oom_op), policy, clock_floor(trace), compared, placed,
                          otherwise)


def _placements(trace: Trace, capture: ReserveCapture) -> tuple[int, int, int | None]:
    """(allocations compared, placed as live, the op of the first placed otherwise) of Note [Comparing
    placements]."""
    n = len(capture.pointers)   # appended with capture.reservations, one each per allocation
    if not n:
        return 0, 0, None
    ops = capture.ops[:n]
    serials = np.asarray(capture.reservations[:n], dtype=np.int64)
    live = trace.addrs[ops].astype(np.int64)
    known = (serials >= 0) & (live > 0)   # a live address of 0 is unknown (a trace built without them)
    if not known.any():
        return 0, 0, None
    ops, serials, live = ops[known], serials[known], live[known]
    shift = live - np.asarray(capture.pointers[:n], dtype=np.int64)[known]   # both in (0, 2**63): no wrap
    # each reservation's first allocation fixes its shift
    _, first, which = np.unique(serials, return_index=True, return_inverse=True)
    same = shift == shift[first][which]
    off = np.flatnonzero(~same)
    return int(len(ops)), int(same.sum()), int(ops[off[0]]) if len(off) else None


def comparison_json(c: LiveComparison) -> dict[str, Any]:
    """``c`` as plain JSON values (``gpumem replay --compare-live --json``)."""
    def one(d: LiveDivergence | None) -> dict[str, Any] | None:
        if d is None:
            return None
        lag_us = None if d.gpu_lag_us is None else round(d.gpu_lag_us, 3)   # the clocks' ns, not float noise
        return {"op": d.op, "nbytes": d.nbytes, "stream": d.stream, "time_us": round(d.time_us, 3),
                "live_reserved_bytes": d.live_reserved_nbytes, "replayed_reserved_bytes": d.replayed_reserved_nbytes,
                "gap_bytes": d.gap_nbytes, "gpu_lag_us": lag_us}

    return {"allocations_compared": c.allocations_compared, "allocations_recorded": c.allocations_recorded,
            "allocations_differing": c.allocations_differing, "policy": c.policy,
            "agrees": c.agrees, "stopped_at_op": c.stopped_at_op,
            # none compared (segment policies): null, not 0 of 0 read as "all placed as live"
            "placements_compared": c.placements_compared,
            "placed_as_live": c.placed_as_live if c.placements_compared else None,
            "first_placed_otherwise_op": c.first_placed_otherwise_op,
            "placements_agree": c.placements_agree,
            "gpu_clock_floor": None if c.clock_floor is None else {
                "first_second_us": round(c.clock_floor.first_second_us, 3),
                "last_second_us": round(c.clock_floor.last_second_us, 3), "seconds": c.clock_floor.seconds},
            "live_peak_reserved_bytes": c.live_peak_reserved_nbytes,
            "replayed_peak_reserved_bytes": c.replayed_peak_reserved_nbytes,
            "first": one(c.first), "largest": one(c.largest)}


def compare_live(trace: Any, device: Any = "sim:h200-141gb", policy: Any = None, *, gpu_timing: Any = None,
                 **allocator_options: Any) -> LiveComparison:
    """Replay ``trace`` (a gpumem.torch trace with its live reserves, or the path of one) on ``device`` under
    ``policy`` (the default policy: gpumem.torch's own) and compare the replay's reserve with the live engine's
    after each allocation (Note [Comparing reserves]). ``gpu_timing`` as for :func:`gpumem.replay.replay_trace`;
    ``allocator_options`` go to the allocator (``limit=``, ``engine=``, ...); the replay stops at the first out of
    memory, as ``gpumem replay`` does.

    Raises:
        InvalidArgumentError: the trace has no live reserves, or an argument is invalid.
    """
    from .allocator import make_allocator
    from .device import Device
    from .replay import replay
    from .specs import open_device

    if isinstance(trace, (str, os.PathLike)):
        from .trace import load_trace

        trace = load_trace(trace)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"compare_live: trace must be a Trace or a path, got {type(trace).__name__}")
    if trace.live_reserved_nbytes is None:
        raise InvalidArgumentError(f"{trace.name}: the trace has no live reserves (gpumem.torch records them with "
                                   "each allocation since .gmt version 6): nothing to compare the replay with")
    own = not isinstance(device, Device)
    dev = open_device(device) if own else device
    policy = DEFAULT_POLICY if policy is None else policy
    try:
        allocator = make_allocator(dev, policy, **allocator_options)
        try:
            capture = ReserveCapture(trace, allocator)
            try:
                result = replay(trace, allocator, stop_on_oom=True, progress=False, gpu_timing=gpu_timing)
            finally:
                capture.restore()
        finally:
            allocator.close()
    finally:
        if own:
            dev.close()
    name = policy if isinstance(policy, str) else getattr(policy, "name", "")
    return compare_reserves(trace, capture, result, name)
