"""Plan a training or inference step offline: how much memory a step-plan allocator would hold (issue 18).

Training and inference loops repeat the same allocation sequence every step. An allocator that has seen
one step can plan the next offline: give every allocation of the step an offset in one arena (dynamic
storage allocation with known lifetimes), map the arena's pages once, and serve each later step with no
driver call. This study asks how close to the step's live bytes such a plan comes on every trace of
``data/traces``, and what a prototype allocator that serves the trace with the plan (falling back to
gpumem's caching allocator on a mismatch) holds over the whole trace, warm-up included.

Per trace (tuning and check parts apart, as ``gpumem.trace.corpus`` splits them) it:

1. finds the step: the period of the allocation sequence (by size and stream, ``exact``), and, for traces
   whose shapes change every step, by size class (``class``: a slot holds its class's largest size), and
   of its structure (stream and lifetime in allocations, ``shape``: a plan per slot sized for the largest
   step, serving each step, marked by the program, while its sizes fit); it reports how much of the
   trace lies in the repeating steps;
2. takes the allocations of one steady step as the plan's items (an allocation freed in the next step
   before its slot comes round again wraps around the step boundary); everything else alive in the step
   (weights, optimizer state, anything living longer than a step) is *fixed*;
3. plans the step with three planners (``first-fit``: allocation order, lowest free offset; ``greedy-size``:
   largest first, lowest free offset; ``greedy-best``: the lowest of three greedy orders, TFLite's
   greedy-by-size with the best-fitting gap among them) and reports the plan's height over the most
   planned bytes live at once, and ``(pages(height) + pages(fixed)) / step peak live - 1`` with 2 MiB pages;
4. serves the whole trace with :class:`PlanResource` (arena slots in order, gpumem's caching allocator on
   ``sim:h200-141gb`` for the rest and for the warm-up steps before the plan is known: the default policy,
   it with one-page chunks, or the memory-first :data:`MEMORY_FIRST_POLICY`) through ``gpumem.replay``
   (GPU timing ``idle`` and the default ``trace``) and reports peak reserved over peak live and driver
   calls per steady step, beside the default policy's and the memory-first policy's replays of the trace.

    python -m sim.step_plan [--traces NAME ...] [--json build/step-plan.json]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import enum
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import PlanItems, Planner, check_plan, plan, plan_height
from gpumem.allocator.policy import DEFAULT_POLICY, POLICIES
from gpumem.device import Device
from gpumem.errors import InvalidArgumentError, InvalidPointerError
from gpumem.allocator.stats import AllocatorStats
from gpumem.replay import replay, replay_trace
from gpumem.specs import open_device
from gpumem.trace import Trace, load_trace
from gpumem.trace.corpus import CorpusPart, corpus_traces
from gpumem.trace.model import OpKind
from gpumem.units import MiB
from sim.cli_checks import json_target_problem


DEVICE_SPEC = "sim:h200-141gb"
PAGE_NBYTES = 2 * MiB
"""The page the engine maps (the H200's VMM granularity)."""
ROUND_NBYTES = 512
"""Plan offsets and sizes are multiples of the engine's request rounding."""
PAGE_CHUNK_POLICY = dataclasses.replace(POLICIES[DEFAULT_POLICY], name="page-chunks", chunk_max_nbytes=PAGE_NBYTES)
"""The default policy with every physical chunk one page: what a chunk locks when a long-lived block sits in
it is one page, so the warm-up's cache goes back page by page when the plan takes over."""
MEMORY_FIRST_POLICY = dataclasses.replace(PAGE_CHUNK_POLICY, name="memory-first", stream_ordered_steal=True,
                                          page_slack=0.0, page_slack_min_nbytes=0)
"""One-page chunks, the stream-ordered steal and no page slack, not even its floor (the memory-first end of setting C's knobs):
many calls per step, but only while the fallback serves the steps, which with a plan is the warm-up."""
KGRAM = 24
"""Allocations in a window that anchors period candidates and resyncs the served plan."""


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


# -- lifetimes and signatures ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Lifetimes:
    """Per allocation (in allocation order): requested size, stream, the op index of its alloc and of its
    free (``n_ops`` when never freed)."""

    nbytes: np.ndarray
    streams: np.ndarray
    alloc_op: np.ndarray
    free_op: np.ndarray
    n_ops: int

    @classmethod
    def of(cls, trace: Trace) -> "Lifetimes":
        is_alloc = trace.kinds == OpKind.ALLOC
        alloc_op = np.flatnonzero(is_alloc).astype(np.int64)
        free_op = np.full(len(alloc_op), trace.n_ops, dtype=np.int64)
        frees = np.flatnonzero(~is_alloc)
        free_op[trace.alloc_ids[frees]] = frees
        return cls(trace.nbytes[is_alloc].astype(np.int64), trace.streams[is_alloc].astype(np.int64),
                   alloc_op, free_op, trace.n_ops)

    @property
    def n_allocs(self) -> int:
        return len(self.nbytes)

    def free_rank(self) -> np.ndarray:
        """Per allocation: how many allocations were made before its free (``n_allocs`` when never freed)."""
        return np.searchsorted(self.alloc_op, self.free_op).astype(np.int64)


class Signature(str, enum.Enum):
    """What two allocations must share to be the same slot of a step."""

    EXACT = "exact"
    """Same size and stream: the step repeats exactly."""
    SHAPE = "shape"
    """Same stream and lifetime in allocations (how many allocations later it is freed): the step's
    structure repeats while its sizes change (variable sequence length). Known only once the allocation is
    freed: serving such a plan needs step boundaries marked by the program."""
    CLASS = "class"
    """Same size class (quarter octaves: sizes rounded up to 1, 1.25, 1.5 or 1.75 times a power of two) and
    stream: steps whose sizes move a little repeat by class; a slot holds the class's largest size."""


def size_class(nbytes: np.ndarray | int) -> np.ndarray:
    """The largest size of ``nbytes``' class (:attr:`Signature.CLASS`): at least 512, else rounded up to a
    quarter of the power of two at or below it."""
    n = np.maximum(np.asarray(nbytes, dtype=np.int64), 1)
    top = np.ones_like(n)
    nz = n > 1
    top[nz] = np.left_shift(1, np.floor(np.log2(n[nz] - 1)).astype(np.int64))   # the power of two below n
    step = np.maximum(top // 4, ROUND_NBYTES)
    return np.maximum(ROUND_NBYTES, -(-n // step) * step)


def signatures(life: Lifetimes, kind: Signature) -> np.ndarray:
    """One int64 per allocation; equal values mean the same slot (:class:`Signature`)."""
    if kind is Signature.EXACT:
        keys = np.stack([life.nbytes, life.streams], axis=1)
    elif kind is Signature.CLASS:
        keys = np.stack([size_class(life.nbytes), life.streams], axis=1)
    else:
        span = life.free_rank() - np.arange(life.n_allocs)
        span[life.free_op >= life.n_ops] = -1
        keys = np.stack([span, life.streams], axis=1)
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    _, inv = np.unique(keys, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64) + 1


# -- the period ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Period:
    """``sig[i] == sig[i + period]`` for every allocation rank ``i`` in ``[run_start, run_start + run_len)``:
    the allocations of ranks ``[run_start, run_start + run_len + period)`` repeat with that period."""

    period: int
    run_start: int
    run_len: int

    @property
    def repeats(self) -> float:
        """How many periods the repeating stretch spans."""
        return (self.run_len + self.period) / self.period


def _kgram_hashes(sig: np.ndarray, k: int) -> np.ndarray:
    n = len(sig) - k + 1
    h = np.zeros(n, dtype=np.uint64)
    mult = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * mult + sig[j:j + n].astype(np.uint64)
    return h


def _longest_run(eq: np.ndarray) -> tuple[int, int]:
    """``(start, length)`` of the longest stretch of True in ``eq`` ((0, 0) when none)."""
    if not eq.any():
        return 0, 0
    padded = np.concatenate(([False], eq, [False])).astype(np.int8)
    d = np.diff(padded)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    i = int(np.argmax(ends - starts))
    return int(starts[i]), int(ends[i] - starts[i])


def find_period(sig: np.ndarray, k: int = KGRAM, max_candidates: int = 400) -> Period | None:
    """The period of the longest exactly repeating stretch of ``sig`` (None: nothing repeats twice).

    Candidates are the distances between repeats of a few ``k``-allocation windows taken in the trace's
    second half; each is scored by the longest stretch over which ``sig`` equals itself shifted by it. The
    longest stretch wins, the shortest period among equals (a multiple of the step repeats over one step
    less; a layer's period repeats only within a step).

    Raises:
        InvalidArgumentError: ``sig`` is not one-dimensional or ``k`` is under 1.
    """
    sig = np.asarray(sig)
    if sig.ndim != 1:
        raise InvalidArgumentError(f"find_period: sig must be one-dimensional, got shape {sig.shape}")
    if k < 1:
        raise InvalidArgumentError(f"find_period: k must be at least 1, got {k}")
    n = len(sig)
    if n < 2 * k:
        return None
    h = _kgram_hashes(sig, k)
    cands: set[int] = set()
    for frac in (0.5, 0.6, 0.7, 0.8, 0.9):
        a = min(int(n * frac), len(h) - 1)
        pos = np.flatnonzero(h == h[a])
        d = np.abs(pos - a)
        cands.update(int(x) for x in d[(d > 0) & (d <= n // 2)])
    best: Period | None = None
    for p in sorted(cands)[:max_candidates]:
        start, length = _longest_run(sig[p:] == sig[:-p])
        if length < p:  # not two whole periods
            continue
        if best is None or length > best.run_len:
            best = Period(p, start, length)
    return best


# -- steps and the plan's items ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Steps:
    """The steady steps: step ``m`` holds the allocations of ranks ``[starts[m], starts[m] + period)``
    (all of one repeating stretch)."""

    period: int
    starts: np.ndarray
    phase: int
    """``starts[0] - run_start``: where in the period the boundary falls (least live bytes there)."""

    @property
    def n_steps(self) -> int:
        return len(self.starts)


def split_steps(life: Lifetimes, per: Period, live_nbytes: np.ndarray) -> Steps:
    """The whole steps inside ``per``'s stretch, their boundary put where the fewest bytes are live (before
    the step's first allocation), so the fewest allocations cross it."""
    p = per.period
    end = per.run_start + per.run_len + p  # one past the last rank of the stretch
    first = np.arange(per.run_start, per.run_start + p)
    before = life.alloc_op[first] - 1
    live = np.where(before >= 0, live_nbytes[np.maximum(before, 0)], 0)
    # the second period where the stretch holds two, so the step before the boundary is a steady one too
    phase = int(np.argmin(live))
    starts = np.arange(per.run_start + phase, end - p + 1, p, dtype=np.int64)
    return Steps(p, starts, phase)


@dataclasses.dataclass(frozen=True)
class Template:
    """One steady step cut out for planning."""

    step: int
    """Index into :attr:`Steps.starts`."""
    ranks: np.ndarray
    """Allocation ranks of the planned items (a subset of the step's ``period`` allocations)."""
    slots: np.ndarray
    """Each planned item's position in the step (0 .. period-1)."""
    items: PlanItems
    step_ops: int
    """Ops from the step's first allocation to the next step's first."""
    peak_live_nbytes: int
    """The most bytes live (requested, everything) at any op of the step."""
    fixed_nbytes: int
    """The most bytes live in the step that are not planned items (weights, state, long-lived ones)."""
    planned_nbytes_max: int
    """The most bytes of planned items (rounded) live at one time."""


def cut_template(life: Lifetimes, steps: Steps, live_nbytes: np.ndarray, step: int,
                 slot_nbytes: np.ndarray | None = None) -> Template:
    """Step ``step``'s items: every allocation of the step freed before its slot comes round again in the
    next step (else fixed). ``slot_nbytes`` (per slot, default the step's own sizes) sizes the items.

    Raises:
        InvalidArgumentError: ``step`` is not a step with a next one (the last step's crossing frees would
            be unknown).
    """
    if not 0 <= step < steps.n_steps - 1:
        raise InvalidArgumentError(f"cut_template: step must be in [0, {steps.n_steps - 1}), got {step}")
    p = steps.period
    r0 = int(steps.starts[step])
    ranks = np.arange(r0, r0 + p)
    t0 = int(life.alloc_op[r0])
    t1 = int(life.alloc_op[r0 + p])
    L = t1 - t0
    a = life.alloc_op[ranks] - t0
    f = life.free_op[ranks] - t0
    inside = f <= L
    wrap = (f > L) & (f - L <= a) & (life.free_op[ranks] < life.n_ops)
    keep = inside | wrap
    slots = np.flatnonzero(keep)
    sizes = (slot_nbytes[slots] if slot_nbytes is not None else life.nbytes[ranks[slots]])
    sizes = np.maximum(ROUND_NBYTES, (sizes + ROUND_NBYTES - 1) // ROUND_NBYTES * ROUND_NBYTES)
    fk, ak, wk = f[slots], a[slots], wrap[slots]
    items = PlanItems(sizes, ak, np.where(wk, L, fk), np.where(wk, 0, 0), np.where(wk, fk - L, 0))
    # live bytes in the step (requested), and the part of it that is planned
    seg = live_nbytes[t0:t1]
    peak = int(seg.max()) if len(seg) else 0
    planned = np.zeros(L + 1, dtype=np.int64)
    req = life.nbytes[ranks[slots]]
    np.add.at(planned, ak, req)
    np.add.at(planned, np.where(wk, L, fk), -req)
    np.add.at(planned, np.zeros(int(wk.sum()), dtype=np.int64), req[wk])
    np.add.at(planned, (fk - L)[wk], -req[wk])
    planned_live = np.cumsum(planned)[:L]
    fixed = int((seg - planned_live).max()) if L else 0
    return Template(step, ranks[slots], slots, items, L, peak, fixed, items.max_live_nbytes())


# -- serving a trace with a plan -------------------------------------------------------------------------

class SyncMode(str, enum.Enum):
    DETECT = "detect"
    """The resource finds its place in the step itself: a mismatch loses it, and the last :data:`KGRAM`
    (size, stream) pairs matching a unique window of the plan find it again."""
    MARKED = "marked"
    """The program marks every step's start (a call per step); inside a step, slot ``j`` is the ``j``-th
    allocation."""


@dataclasses.dataclass
class ServeCounters:
    planned: int = 0
    planned_nbytes: int = 0
    fallback: int = 0
    fallback_nbytes: int = 0
    mismatched: int = 0
    """Allocations that did not fit their slot (size or stream), or came while the place was lost."""
    occupied: int = 0
    """Allocations whose slot's range still held a live allocation."""
    resyncs: int = 0
    arena_calls: int = 0


# Note [The arena takes over from the fallback]
# ----------------------------------------------
# A plan is known only after the program ran a step (two, when the allocator finds the period itself), so
# the first steps are served by an ordinary caching allocator, the fallback, and their peak counts in peak
# reserved as any other. Mapping the whole arena at the take-over would hold the fallback's cache and the
# arena at once (the first version of this study did: 67-77 % above peak live on GPT-2). So the arena's
# address range is reserved at the take-over and each page is mapped when a slot first touches it, after
# the fallback gave back every cached byte that holds no live data (``empty_cache``): the pages the
# warm-up's activations held go back as the arena's pages come in. What the fallback keeps is what is
# still live in it (weights, optimizer state, what the last warm-up step left alive into the first planned
# one) and the pages those share with freed blocks: with the default policy's chunks (up to 1/256 of the
# memory held) a chunk with one live block stays whole, hence the page-chunk fallbacks. These calls are
# made once (in the two transition steps: Note [Two transition steps]); once every page of the arena is
# mapped a step in the plan makes no device call: slots are reused in program order on their stream,
# which orders the reuse after the previous occupant's work without an event. A trace on several streams
# is planned the same way here, which is safe only under ``idle`` timing: a real engine would have to
# record an event where a slot passes from one stream's allocation to another's (see the record).


class PlanResource:
    """A prototype step-plan allocator: one arena whose pages are mapped once, a slot per planned allocation
    of the step, and gpumem's caching allocator (``fallback``) for everything else.

    ``slot_nbytes`` (per position in the step: the size it expects, or takes at most), ``slot_offsets``
    (-1: not planned) and ``slot_streams`` describe the plan; ``arena_nbytes`` the arena, whose address
    range :meth:`activate` reserves and whose pages are mapped as slots first touch them (Note [The arena
    takes over from the fallback]). An allocation is served from its slot when the plan is active, it is the
    allocation the plan expects next (:class:`SyncMode`), its stream is the slot's, its size fits the slot
    and no live arena allocation overlaps the slot's range; otherwise the fallback serves it. Frees go
    where the pointer came from.
    """

    def __init__(self, fallback: CachingAllocator, slot_nbytes: np.ndarray, slot_offsets: np.ndarray,
                 slot_streams: np.ndarray, arena_nbytes: int, mode: SyncMode, classed: bool = False) -> None:
        if not (len(slot_nbytes) == len(slot_offsets) == len(slot_streams)) or len(slot_nbytes) == 0:
            raise InvalidArgumentError("PlanResource: slot sizes, offsets and streams must be of one non-zero length")
        if arena_nbytes <= 0 or arena_nbytes % PAGE_NBYTES:
            raise InvalidArgumentError(f"PlanResource: arena_nbytes must be a positive multiple of 2 MiB, got {arena_nbytes}")
        ends = np.asarray(slot_offsets) + np.maximum(ROUND_NBYTES, (np.asarray(slot_nbytes) + ROUND_NBYTES - 1)
                                                     // ROUND_NBYTES * ROUND_NBYTES)
        if int(ends[np.asarray(slot_offsets) >= 0].max(initial=0)) > arena_nbytes:
            raise InvalidArgumentError("PlanResource: a slot ends past the arena")
        self.fallback = fallback
        self.device: Device = fallback.device
        self.slot_nbytes = [int(x) for x in slot_nbytes]
        self.slot_offsets = [int(x) for x in slot_offsets]
        self.slot_streams = [int(x) for x in slot_streams]
        self.period = len(self.slot_nbytes)
        self.arena_nbytes = arena_nbytes
        self.mode = SyncMode(mode)
        self.classed = classed
        """Detect mode: a slot is matched by size class (its size is the class's largest) rather than size."""
        self.base = 0
        self._active = False
        self._runs: list[tuple[int, int, Any]] = []
        self._mapped = bytearray(arena_nbytes // PAGE_NBYTES)
        self.mapped_nbytes = 0
        self.cursor: int | None = None
        self.count = ServeCounters()
        self._live_starts: list[int] = []   # arena offsets of live arena allocations, sorted
        self._live_end: dict[int, int] = {}
        self._window: list[tuple[int, int]] = []
        self._kgram: dict[tuple[tuple[int, int], ...], int] = {}
        self.window = min(KGRAM, self.period)
        """Detect mode: allocations matched to a unique window of the plan before it serves again."""
        if self.mode is SyncMode.DETECT:
            keys = list(zip(self.slot_nbytes, self.slot_streams))
            seen: dict[tuple[tuple[int, int], ...], int] = {}
            for j in range(self.period):
                w = tuple(keys[(j + t) % self.period] for t in range(self.window))
                seen[w] = -1 if w in seen else (j + self.window) % self.period
            self._kgram = {w: j for w, j in seen.items() if j >= 0}

    @property
    def active(self) -> bool:
        return self._active

    def activate(self) -> None:
        """Reserve the arena's address range (one device call) and start serving slots. Its pages are mapped
        as slots first touch them (:meth:`_map_pages`), so the first planned step maps them while the
        warm-up's memory drains from the fallback."""
        if self._active:
            raise InvalidArgumentError("PlanResource.activate: already active")
        self.base = self.device.address_reserve(self.arena_nbytes)
        self.count.arena_calls += 1
        self._active = True

    def _map_pages(self, off: int, size: int) -> None:
        """Map the unmapped pages under ``[off, off + size)`` of the arena, after giving the fallback's
        cached memory back (Note [The arena takes over from the fallback]): three device calls per run of
        pages (create, map, set access)."""
        first, last = off // PAGE_NBYTES, (off + size - 1) // PAGE_NBYTES
        todo = [pg for pg in range(first, last + 1) if not self._mapped[pg]]
        if not todo:
            return
        self.fallback.empty_cache()
        runs: list[list[int]] = []
        for pg in todo:
            if runs and runs[-1][1] == pg:
                runs[-1][1] = pg + 1
            else:
                runs.append([pg, pg + 1])
        dev = self.device
        for a, b in runs:
            nbytes = (b - a) * PAGE_NBYTES
            handle = dev.mem_create(nbytes)
            dev.mem_map(self.base + a * PAGE_NBYTES, nbytes, handle)
            dev.mem_set_access(self.base + a * PAGE_NBYTES, nbytes)
            self._runs.append((a * PAGE_NBYTES, nbytes, handle))
            self.count.arena_calls += 3
            self.mapped_nbytes += nbytes
            for pg in range(a, b):
                self._mapped[pg] = 1

    def mark_step(self) -> None:
        """The program says a step starts: the next allocation is slot 0."""
        self.cursor = 0

    @property
    def reserved_nbytes(self) -> int:
        """What the fallback holds plus the arena's mapped pages."""
        return self.fallback.reserved_nbytes + self.mapped_nbytes

    def _slot_free(self, off: int, size: int) -> bool:
        starts = self._live_starts
        i = bisect.bisect_left(starts, off + size)
        return i == 0 or self._live_end[starts[i - 1]] <= off

    def allocate(self, nbytes: int, stream: int = 0) -> int:
        """``nbytes`` (> 0) on ``stream``: from the slot the plan expects next when it fits (module
        docstring), else from the fallback."""
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgumentError(f"PlanResource.allocate: nbytes must be a positive int, got {nbytes!r}")
        j = self.cursor
        slot_ok = False
        if self._active and j is not None:
            want = self.slot_nbytes[j]
            if self.mode is SyncMode.MARKED:
                fits = nbytes <= want
            else:
                fits = nbytes == want if not self.classed else int(size_class(nbytes)) == want
            fits = fits and stream == self.slot_streams[j]
            if not fits:
                # detect: the place in the step is lost; marked: the rest of this step goes to the fallback
                self.count.mismatched += 1
                self.cursor = j = None
            else:
                off = self.slot_offsets[j]
                if off >= 0:
                    size = max(ROUND_NBYTES, round_up(want, ROUND_NBYTES))
                    if self._slot_free(off, size):
                        slot_ok = True
                    else:
                        self.count.occupied += 1
        if j is not None:
            j += 1
            self.cursor = j if j < self.period else (0 if self.mode is SyncMode.DETECT else None)
        elif self.active and self.mode is SyncMode.DETECT:
            self._window.append((int(size_class(nbytes)) if self.classed else nbytes, stream))
            if len(self._window) > self.window:
                del self._window[0]
            found = self._kgram.get(tuple(self._window)) if len(self._window) == self.window else None
            if found is not None:
                self.cursor = found
                self.count.resyncs += 1
                self._window.clear()
        if slot_ok:
            self._map_pages(off, size)
            ptr = self.base + off
            bisect.insort(self._live_starts, off)
            self._live_end[off] = off + size
            self.count.planned += 1
            self.count.planned_nbytes += nbytes
            return ptr
        self.count.fallback += 1
        self.count.fallback_nbytes += nbytes
        return self.fallback.allocate(nbytes, stream)

    def free(self, ptr: int) -> None:
        """Give back ``ptr`` (from :meth:`allocate`); an arena pointer that is not live raises
        :class:`~gpumem.errors.InvalidPointerError`, changing nothing."""
        off = ptr - self.base
        if self.active and 0 <= off < self.arena_nbytes:
            if off not in self._live_end:
                raise InvalidPointerError(f"PlanResource.free: no live arena allocation at offset {off}")
            del self._live_end[off]
            self._live_starts.pop(bisect.bisect_left(self._live_starts, off))
            return
        self.fallback.free(ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        off = ptr - self.base
        if not (self.active and 0 <= off < self.arena_nbytes):
            self.fallback.record_stream(ptr, stream)

    def close(self) -> None:
        """Unmap and release the arena, then close the fallback."""
        if self._active:
            for off, nbytes, handle in self._runs:
                self.device.mem_unmap(self.base + off, nbytes)
                self.device.mem_release(handle)
            self.device.address_free(self.base, self.arena_nbytes)
            self._runs.clear()
            self._mapped[:] = bytes(len(self._mapped))
            self.mapped_nbytes = 0
            self._active = False
        self.fallback.close()


@dataclasses.dataclass
class ServeResult:
    peak_live_nbytes: int
    peak_reserved_nbytes: int
    counters: ServeCounters
    calls_per_steady_step: float
    """Fallback driver calls (and the arena's, if made then) per step, over the steady steps after the
    plan became active."""
    event_calls_per_steady_step: float
    steady_steps: int
    peak_op: int = 0
    """The op at which peak reserved was reached."""
    fallback_at_peak_nbytes: int = 0
    """What the fallback held then (the rest is the arena)."""
    live_at_peak_nbytes: int = 0
    fallback_allocated_at_peak_nbytes: int = 0
    """The fallback's live blocks then (rounded sizes)."""
    steady_peak_live_nbytes: int = 0
    """Peak live from the first counted steady step on (after the step in which the plan took over)."""
    steady_peak_reserved_nbytes: int = 0

    @property
    def steady_overhead(self) -> float:
        """Peak reserved over peak live from the first counted steady step on, minus 1."""
        return self.steady_peak_reserved_nbytes / self.steady_peak_live_nbytes - 1 if self.steady_peak_live_nbytes else math.nan

    @property
    def overhead(self) -> float:
        return self.peak_reserved_nbytes / self.peak_live_nbytes - 1 if self.peak_live_nbytes else 0.0


class _Served:
    """What :func:`gpumem.replay.replay` drives: ``resource`` (or the fallback alone), with the schedule of
    :func:`serve` applied by allocation rank, and the figures of :class:`ServeResult` kept as it goes."""

    def __init__(self, resource: PlanResource | None, fallback: CachingAllocator, activate_rank: int | None,
                 release_ranks: set[int], mark_ranks: set[int], counted: list[int]) -> None:
        self.resource, self.fallback = resource, fallback
        self.device = fallback.device
        self.policy = dataclasses.replace(fallback.policy, name="step-plan" if resource is not None else fallback.policy.name)
        self.engine = fallback.engine
        target = resource if resource is not None else fallback
        self._allocate, self._free, self.record_stream = target.allocate, target.free, target.record_stream
        self.activate_rank, self.release_ranks, self.mark_ranks = activate_rank, release_ranks, mark_ranks
        self.marked = resource is not None and resource.mode is SyncMode.MARKED
        self.first, self.last = (counted[0], counted[-1]) if len(counted) >= 2 else (-1, -1)
        self.n_steady = len(counted) - 1 if len(counted) >= 2 else 0
        self.rank = 0
        self.sizes: dict[int, int] = {}
        self.live = self.peak_live = self.peak_reserved = 0
        self.peak_rank = self.peak_fb = self.peak_at_live = self.peak_fb_alloc = 0
        self.steady_live = self.steady_reserved = 0
        self.calls = [0, 0, 0, 0]   # driver and event calls at the first and the last counted step

    def _calls(self) -> tuple[int, int]:
        st = self.fallback.stats
        return st.device_calls + (self.resource.count.arena_calls if self.resource is not None else 0), st.event_calls

    def allocate(self, nbytes: int, stream: int = 0) -> int:
        r = self.rank
        self.rank = r + 1
        if r in self.release_ranks:
            self.fallback.empty_cache()
        if r == self.activate_rank and self.resource is not None:
            self.resource.activate()
        if r in self.mark_ranks and self.marked:
            self.resource.mark_step()  # type: ignore[union-attr]
        if r == self.first:
            self.calls[0], self.calls[1] = self._calls()
        elif r == self.last:
            self.calls[2], self.calls[3] = self._calls()
        ptr = self._allocate(nbytes, stream)
        self.sizes[ptr] = nbytes
        live = self.live = self.live + nbytes
        if live > self.peak_live:
            self.peak_live = live
        fb = self.fallback.reserved_nbytes
        reserved = fb + (self.resource.mapped_nbytes if self.resource is not None else 0)
        if reserved > self.peak_reserved:
            self.peak_reserved, self.peak_rank, self.peak_fb, self.peak_at_live = reserved, r, fb, live
            self.peak_fb_alloc = self.fallback.allocated_nbytes
        if self.first <= r < self.last:
            self.steady_live = max(self.steady_live, live)
            self.steady_reserved = max(self.steady_reserved, reserved)
        return ptr

    def free(self, ptr: int) -> None:
        self._free(ptr)
        self.live -= self.sizes.pop(ptr)

    def snapshot_stats(self) -> AllocatorStats:
        st = self.fallback.stats
        st.peak_requested_nbytes = self.peak_live
        st.peak_reserved_nbytes = max(self.peak_reserved, st.peak_reserved_nbytes if self.resource is None else 0)
        st.device_calls, st.event_calls = self._calls()
        return st

    def result(self, life: Lifetimes) -> "ServeResult":
        n = self.n_steady
        c = self.calls
        return ServeResult(self.peak_live, self.snapshot_stats().peak_reserved_nbytes,
                           self.resource.count if self.resource is not None else ServeCounters(),
                           (c[2] - c[0]) / n if n else math.nan, (c[3] - c[1]) / n if n else math.nan, n,
                           int(life.alloc_op[self.peak_rank]) if life.n_allocs else 0, self.peak_fb,
                           self.peak_at_live, self.peak_fb_alloc, self.steady_live, self.steady_reserved)


def serve(trace: Trace, resource: PlanResource | None, fallback: CachingAllocator, activate_op: int | None,
          step_ops: Sequence[int], empty_cache_on_activate: bool = False,
          mark_ops: Sequence[int] | None = None, gpu_timing: str = "idle") -> ServeResult:
    """Replay ``trace`` (:func:`gpumem.replay.replay`, ``gpu_timing`` beside it) through ``resource`` (None:
    the fallback alone), the plan activated before op ``activate_op`` (None: never), steps marked before
    each op of ``step_ops`` and ``mark_ops`` (in marked mode they reset the cursor). Every op named must be
    an allocation. Calls per steady step are counted from the second step after the take-over (Note [Two
    transition steps]) to the last of ``step_ops``.

    Raises:
        InvalidArgumentError: an op named is not an allocation of the trace.
    """
    life = Lifetimes.of(trace)
    named = [x for x in (activate_op,) if x is not None] + [int(x) for x in step_ops] + [int(x) for x in (mark_ops or ())]
    rank_of = {int(op): r for r, op in enumerate(life.alloc_op.tolist())}
    bad = [x for x in named if x not in rank_of]
    if bad:
        raise InvalidArgumentError(f"serve: op {bad[0]} is not an allocation of {trace.name}")
    after = activate_op if activate_op is not None else 0
    # Note [Two transition steps]: the step in which the plan takes over is a transition (the fallback still
    # holds what the warm-up left alive into it), and so is the next (a detected plan finds its place in it,
    # the arena maps its last pages): calls are counted from the step after those two. The fallback gives
    # its cache back at the take-over, and again where counting starts, once the warm-up's leftovers (the
    # gradients freed at zero_grad, a loss) are freed.
    counted = [int(x) for x in step_ops if x >= after]
    if activate_op is not None and resource is not None:
        counted = counted[2:] if len(counted) >= 4 else counted[1:]
    release = {activate_op, counted[0]} if empty_cache_on_activate and counted and activate_op is not None else set()
    driver = _Served(resource, fallback, rank_of[activate_op] if activate_op is not None else None,
                     {rank_of[x] for x in release}, {rank_of[int(x)] for x in list(step_ops) + list(mark_ops or ())},
                     [rank_of[x] for x in counted])
    replay(trace, driver, gpu_timing=gpu_timing, progress=False)  # type: ignore[arg-type]
    return driver.result(life)


# -- the study ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PlanFigures:
    planner: str
    height_nbytes: int
    height_over_planned: float
    """``height / max planned live - 1``: the planner's own loss."""
    paged_overhead: float
    """``(pages(height) + pages(fixed)) / step peak live - 1``, 2 MiB pages."""
    plan_s: float


@dataclasses.dataclass
class VariantRow:
    """One trace under one signature: the step found, the plans, and the trace served."""

    part: str
    trace: str
    signature: str
    period: int = 0
    steps: int = 0
    coverage_allocs: float = 0.0
    """Share of the trace's allocations that lie in a steady step."""
    coverage_nbytes: float = 0.0
    planned_items: int = 0
    step_peak_live_nbytes: int = 0
    fixed_nbytes: int = 0
    planned_max_live_nbytes: int = 0
    plans: list[PlanFigures] = dataclasses.field(default_factory=list)
    serve: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    note: str = ""


_SERVE_FLOATS = ("overhead", "steady_overhead", "calls_per_steady_step", "event_calls_per_steady_step", "planned_share")
"""The float figures of a served row (:func:`_serve_row`); its other figures are ints (:data:`_SERVE_INTS`)."""
_SERVE_INTS = ("peak_live_nbytes", "peak_reserved_nbytes", "steady_steps", "mismatched", "occupied", "resyncs",
               "arena_calls", "peak_op", "fallback_at_peak_nbytes", "live_at_peak_nbytes",
               "fallback_allocated_at_peak_nbytes")


def _serve_row(res: ServeResult, n_allocs: int) -> dict[str, Any]:
    c = res.counters
    return {"overhead": res.overhead, "steady_overhead": res.steady_overhead, "peak_live_nbytes": res.peak_live_nbytes,
            "peak_reserved_nbytes": res.peak_reserved_nbytes,
            "calls_per_steady_step": res.calls_per_steady_step,
            "event_calls_per_steady_step": res.event_calls_per_steady_step, "steady_steps": res.steady_steps,
            "planned_share": c.planned / n_allocs if n_allocs else 0.0, "mismatched": c.mismatched,
            "occupied": c.occupied, "resyncs": c.resyncs, "arena_calls": c.arena_calls,
            "peak_op": res.peak_op, "fallback_at_peak_nbytes": res.fallback_at_peak_nbytes,
            "live_at_peak_nbytes": res.live_at_peak_nbytes,
            "fallback_allocated_at_peak_nbytes": res.fallback_allocated_at_peak_nbytes}


def study_variant(trace: Trace, life: Lifetimes, live: np.ndarray, kind: Signature, part: str,
                  serve_it: bool = True, label: str | None = None,
                  timings: Sequence[str] = ("idle", "trace")) -> VariantRow:
    """Find the step of ``trace`` under ``kind``, plan it with every planner, and serve the trace (with the
    default policy and :data:`PAGE_CHUNK_POLICY` as the fallback, under each GPU timing of ``timings``)."""
    row = VariantRow(part, label or trace.name, kind.value)
    sig = signatures(life, kind)
    per = find_period(sig)
    if per is None:
        row.note = "no stretch repeats twice"
        return row
    steps = split_steps(life, per, live)
    row.period, row.steps = steps.period, steps.n_steps
    if steps.n_steps < 2:
        row.note = "fewer than two whole steps repeat"
        return row
    covered = (steps.starts[:, None] + np.arange(steps.period)[None, :]).reshape(-1)
    row.coverage_allocs = len(covered) / life.n_allocs
    row.coverage_nbytes = float(life.nbytes[covered].sum() / max(1, life.nbytes.sum()))
    slot_nbytes = life.nbytes[covered].reshape(steps.n_steps, steps.period).max(axis=0)
    if kind is Signature.CLASS:
        slot_nbytes = size_class(slot_nbytes)
    tmpl = cut_template(life, steps, live, steps.n_steps - 2, slot_nbytes if kind is not Signature.EXACT else None)
    if kind is not Signature.EXACT:
        # the envelope plan is judged against the largest step's live bytes
        each = [cut_template(life, steps, live, m) for m in range(steps.n_steps - 1)]
        step_peak, fixed = max(t.peak_live_nbytes for t in each), max(t.fixed_nbytes for t in each)
    else:
        step_peak, fixed = tmpl.peak_live_nbytes, tmpl.fixed_nbytes
    row.planned_items = len(tmpl.items)
    row.step_peak_live_nbytes, row.fixed_nbytes = step_peak, fixed
    row.planned_max_live_nbytes = tmpl.planned_nbytes_max
    best: tuple[int, np.ndarray] | None = None
    for planner in Planner:
        t0 = time.perf_counter()
        offs = plan(tmpl.items, planner)
        dt = time.perf_counter() - t0
        check_plan(tmpl.items, offs)
        h = plan_height(tmpl.items, offs)
        paged = round_up(h, PAGE_NBYTES) + round_up(fixed, PAGE_NBYTES)
        row.plans.append(PlanFigures(planner.value, h, h / tmpl.planned_nbytes_max - 1 if tmpl.planned_nbytes_max else 0.0,
                                     paged / step_peak - 1 if step_peak else 0.0, dt))
        if best is None or h < best[0]:
            best = (h, offs)
    if not serve_it or best is None or best[0] == 0:
        return row
    h, offs = best
    p = steps.period
    slot_off = np.full(p, -1, dtype=np.int64)
    slot_off[tmpl.slots] = offs
    # the request each slot expects (exact) or the most it takes (shape); the arena range is it rounded
    slot_size = slot_nbytes if kind is not Signature.EXACT else life.nbytes[int(tmpl.ranks[0]) - int(tmpl.slots[0]):][:p]
    slot_stream = life.streams[int(steps.starts[0]):int(steps.starts[0]) + p]
    step_ops = life.alloc_op[steps.starts].tolist()
    # marked mode: the program marks every step; past the steady stretch the steps are taken to keep the period
    mark_ops = life.alloc_op[np.arange(int(steps.starts[-1]), life.n_allocs, p)].tolist()
    mode = SyncMode.MARKED if kind is Signature.SHAPE else SyncMode.DETECT
    variants: dict[str, tuple[int, bool, Any, str]] = {}
    # learned online: detected, the plan is known once a step was seen repeated (two steady steps); marked,
    # once one marked step was seen. The fallback's cache goes back as the arena's pages are mapped.
    seen = 2 if mode is SyncMode.DETECT else 1
    if steps.n_steps >= seen + 2:
        at = int(life.alloc_op[steps.starts[seen]])
        when = f"after {seen} step{'s' if seen > 1 else ''}"
        for timing in timings:
            variants[f"{when}, default fallback, {timing}"] = (at, True, DEFAULT_POLICY, timing)
            variants[f"{when}, page-chunk fallback, {timing}"] = (at, True, PAGE_CHUNK_POLICY, timing)
            variants[f"{when}, memory-first fallback, {timing}"] = (at, True, MEMORY_FIRST_POLICY, timing)
    for name, (at, empty, policy, timing) in variants.items():
        with open_device(DEVICE_SPEC) as dev:
            fb = CachingAllocator(dev, policy)
            res = PlanResource(fb, slot_size, slot_off, slot_stream, round_up(h, PAGE_NBYTES), mode,
                               classed=kind is Signature.CLASS)
            try:
                out = serve(trace, res, fb, at, step_ops, empty_cache_on_activate=empty, mark_ops=mark_ops,
                            gpu_timing=timing)
            finally:
                res.close()
        row.serve[name] = _serve_row(out, life.n_allocs)
    return row


@dataclasses.dataclass
class BaselineRow:
    """Today's allocator on the trace, for comparison."""

    part: str
    trace: str
    peak_live_nbytes: int
    overhead_idle: float
    """The default policy, ``gpumem.replay`` with GPU timing ``idle``."""
    overhead_trace_timing: float
    """The default policy, ``gpumem.replay`` with the default GPU timing (``trace``)."""
    calls_per_steady_step_trace_timing: float
    """The default policy's driver calls per steady step (exact steps), GPU timing ``trace``."""
    event_calls_per_steady_step_trace_timing: float
    memory_first_overhead_trace_timing: float
    """:data:`MEMORY_FIRST_POLICY` alone (no plan), GPU timing ``trace``: what the served rows' warm-up
    fallback holds by itself."""
    memory_first_calls_per_steady_step_trace_timing: float
    memory_first_event_calls_per_steady_step_trace_timing: float
    steady_steps: int


def _calls_per_step(trace: Trace, ops: list[int], policy: Any) -> tuple[float, float]:
    """Driver and event calls per step between the first and the last of ``ops`` under ``policy``, GPU timing
    ``trace``: from replays of the trace cut at those two ops."""
    h0 = replay_trace(trace.head(ops[0]), DEVICE_SPEC, policy, progress=False)
    h1 = replay_trace(trace.head(ops[-1]), DEVICE_SPEC, policy, progress=False)
    n = len(ops) - 1
    return (h1.stats.device_calls - h0.stats.device_calls) / n, (h1.stats.event_calls - h0.stats.event_calls) / n


def baseline(trace: Trace, life: Lifetimes, live: np.ndarray, part: str, label: str | None = None) -> BaselineRow:
    """The default policy on the trace (``gpumem.replay``, GPU timing idle and trace, the default) and
    :data:`MEMORY_FIRST_POLICY` alone, with their driver and event calls per steady step (the exact steps of
    :func:`find_period`; none found: NaN) under trace timing."""
    idle = replay_trace(trace, DEVICE_SPEC, DEFAULT_POLICY, progress=False, gpu_timing="idle")
    timed = replay_trace(trace, DEVICE_SPEC, DEFAULT_POLICY, progress=False)
    mem = replay_trace(trace, DEVICE_SPEC, MEMORY_FIRST_POLICY, progress=False)
    nan = math.nan
    calls = events = mcalls = mevents = nan
    n_steady = 0
    per = find_period(signatures(life, Signature.EXACT))
    if per is not None:
        ops = life.alloc_op[split_steps(life, per, live).starts].tolist()
        n_steady = len(ops) - 1
        if n_steady >= 1:
            calls, events = _calls_per_step(trace, ops, DEFAULT_POLICY)
            mcalls, mevents = _calls_per_step(trace, ops, MEMORY_FIRST_POLICY)
    return BaselineRow(part, label or trace.name, idle.peak_live_bytes, idle.overhead, timed.overhead, calls, events,
                       mem.overhead, mcalls, mevents, max(0, n_steady))


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2%}"


def _num(x: float) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:.1f}"


def print_summary(base: list[BaselineRow], rows: list[VariantRow]) -> None:
    """One row per trace: the exact step, its best plan, today's allocator, and the trace served with the
    memory-first warm-up fallback under trace timing, detected (exact) and marked (shape)."""
    by = {(r.trace, r.signature): r for r in rows}
    for part in CorpusPart:
        print(f"\n### {part.value} part: summary (served: memory-first warm-up fallback, GPU timing trace)\n")
        print("| trace | period (allocs) / steady steps / in them (allocs) | greedy-best plan: paged | default policy, "
              "idle / trace timing | default: calls per steady step | memory-first alone / its calls per steady step | "
              "served, detected: whole trace / steady / calls per steady step | served, marked: whole trace / steady / "
              "calls per steady step |")
        print("|---|---|---|---|---|---|---|---|")
        for b in base:
            if b.part != part.value:
                continue
            ex, sh = by.get((b.trace, "exact")), by.get((b.trace, "shape"))
            plan_cell = "n/a"
            if ex is not None and ex.plans:
                plan_cell = _pct(min(p.paged_overhead for p in ex.plans))
            cells = []
            for r, key in ((ex, "after 2 steps, memory-first fallback, trace"), (sh, "after 1 step, memory-first fallback, trace")):
                sv = r.serve.get(key) if r is not None else None
                cells.append("not served" if sv is None else
                             f"{_pct(sv['overhead'])} / {_pct(sv['steady_overhead'])} / "
                             f"{_num(sv['calls_per_steady_step'] + sv['event_calls_per_steady_step'])}")
            step = f"{ex.period} / {ex.steps} / {ex.coverage_allocs:.0%}" if ex is not None and ex.period else "none"
            print(f"| {b.trace} | {step} | {plan_cell} | {_pct(b.overhead_idle)} / {_pct(b.overhead_trace_timing)} | "
                  f"{_num(b.calls_per_steady_step_trace_timing + b.event_calls_per_steady_step_trace_timing)} | "
                  f"{_pct(b.memory_first_overhead_trace_timing)} / "
                  f"{_num(b.memory_first_calls_per_steady_step_trace_timing + b.memory_first_event_calls_per_steady_step_trace_timing)} | "
                  f"{cells[0]} | {cells[1]} |")


def print_tables(base: list[BaselineRow], rows: list[VariantRow]) -> None:
    """The three tables of the record, each part apart: today's allocator, the plans, the trace served."""
    for part in CorpusPart:
        print(f"\n### {part.value} part: today's allocator\n")
        print("| trace | default policy, idle | default policy, trace timing | default: driver + event calls per "
              "steady step, trace timing | memory-first policy alone, trace timing | memory-first: calls per steady "
              "step | steady steps |")
        print("|---|---|---|---|---|---|---|")
        for b in base:
            if b.part == part.value:
                print(f"| {b.trace} | {_pct(b.overhead_idle)} | {_pct(b.overhead_trace_timing)} | "
                      f"{_num(b.calls_per_steady_step_trace_timing)} + {_num(b.event_calls_per_steady_step_trace_timing)} | "
                      f"{_pct(b.memory_first_overhead_trace_timing)} | "
                      f"{_num(b.memory_first_calls_per_steady_step_trace_timing)} + "
                      f"{_num(b.memory_first_event_calls_per_steady_step_trace_timing)} | {b.steady_steps} |")
        print(f"\n### {part.value} part: the step and its plans (height over the most planned bytes live / "
              f"(pages(height) + pages(fixed)) over the step's peak live)\n")
        print("| trace | step | period (allocs) | steady steps | in a steady step (allocs / bytes) | planned items | "
              "step peak live | fixed | " + " | ".join(p.value for p in Planner) + " |")
        print("|---|---|---|---|---|---|---|---|" + "---|" * len(Planner))
        for r in rows:
            if r.part != part.value:
                continue
            pl = {p.planner: p for p in r.plans}
            cells = [f"{_pct(pl[p.value].height_over_planned)} / {_pct(pl[p.value].paged_overhead)}" if p.value in pl
                     else (r.note or "n/a") for p in Planner]
            print(f"| {r.trace} | {r.signature} | {r.period} | {r.steps} | {r.coverage_allocs:.1%} / {r.coverage_nbytes:.1%} | "
                  f"{r.planned_items} | {r.step_peak_live_nbytes / MiB:,.0f} MiB | {r.fixed_nbytes / MiB:,.0f} MiB | "
                  + " | ".join(cells) + " |")
        print(f"\n### {part.value} part: the trace served with its lowest plan (PlanResource)\n")
        print("| trace | step | plan known | peak reserved over peak live, whole trace | same, steady steps after the "
              "take-over | allocations served from the plan | mismatched / occupied / resyncs | driver + event calls "
              "per steady step | arena's calls (once) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.part != part.value:
                continue
            for name, sv in r.serve.items():
                print(f"| {r.trace} | {r.signature} | {name} | {_pct(sv['overhead'])} | {_pct(sv['steady_overhead'])} | "
                      f"{sv['planned_share']:.1%} | {sv['mismatched']} / {sv['occupied']} / {sv['resyncs']} | "
                      f"{_num(sv['calls_per_steady_step'])} + {_num(sv['event_calls_per_steady_step'])} | {sv['arena_calls']} |")


def _checked(value: Any, kind: str, where: str) -> Any:
    """``value`` if it is of ``kind`` (``"str"``; ``"int"``: within 64 bits; ``"float"``: a float, or an int within
    64 bits; bools refused), else ValueError naming ``where``."""
    whole = isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63
    ok = {"str": isinstance(value, str), "int": whole, "float": whole or isinstance(value, float)}[kind]
    if not ok:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "an int of over 40 digits"
        raise ValueError(f"{where}: {kind} expected, got {type(value).__name__} {shown:.40}")
    return value


def _fields(cls: type, rec: Any, where: str, nested: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``cls`` dataclass from the JSON object ``rec``, each checked against its annotation (those
    in ``nested`` converted by the function given there); ValueError naming ``where`` otherwise."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a JSON object expected, got {type(rec).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in rec]
    unknown = [str(k) for k in rec if k not in fields]
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)[:80]}"]
                                                                     if unknown else [])))
    return {k: nested[k](v, f"{where}.{k}") if k in nested else _checked(v, fields[k].type, f"{where}.{k}")
            for k, v in rec.items()}


def _serve_from_json(serve: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(serve, dict):
        raise ValueError(f"{where}: a JSON object expected, got {type(serve).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for name, sv in serve.items():
        at = f"{where}[{name!r:.40}]"
        if not isinstance(sv, dict):
            raise ValueError(f"{at}: a JSON object expected, got {type(sv).__name__}")
        missing = [k for k in (*_SERVE_FLOATS, *_SERVE_INTS) if k not in sv]
        if missing:
            raise ValueError(f"{at}: missing {', '.join(missing)}")
        out[name] = {k: _checked(sv[k], "float" if k in _SERVE_FLOATS else "int", f"{at}.{k}")
                     for k in (*_SERVE_FLOATS, *_SERVE_INTS)}
    return out


def _plans_from_json(plans: Any, where: str) -> list[PlanFigures]:
    if not isinstance(plans, list):
        raise ValueError(f"{where}: a JSON list expected, got {type(plans).__name__}")
    return [PlanFigures(**_fields(PlanFigures, pf, f"{where}[{i}]", {})) for i, pf in enumerate(plans)]


def load_record(path: Path) -> tuple[list[BaselineRow], list[VariantRow]]:
    """The rows of a record written by ``--json``, every field's type checked. Raises ValueError (a malformed
    record, nesting too deep for the JSON decoder included) or OSError."""
    try:
        rec = json.loads(path.read_text())
    except RecursionError:
        raise ValueError("nested too deep for a record of this study") from None
    if not isinstance(rec, dict):
        raise ValueError(f"a JSON object expected, got {type(rec).__name__}")
    for key in ("baseline", "variants"):
        if not isinstance(rec.get(key), list):
            raise ValueError(f"{key}: a JSON list expected, got {type(rec.get(key)).__name__}")
    base = [BaselineRow(**_fields(BaselineRow, b, f"baseline[{i}]", {})) for i, b in enumerate(rec["baseline"])]
    rows = [VariantRow(**_fields(VariantRow, v, f"variants[{i}]", {"plans": _plans_from_json,
                                                                   "serve": _serve_from_json}))
            for i, v in enumerate(rec["variants"])]
    return base, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sim.step_plan", description=(__doc__ or "").split("\n    python -m")[0],
        epilog="Columns: 'height over planned live' is the plan's arena over the most planned bytes live at "
               "once (the planner's own loss); 'paged' is (arena + fixed, each in whole 2 MiB pages) over the "
               "step's peak live bytes, minus 1; the served rows are peak reserved over peak live over the "
               "whole trace, warm-up included. Takes a few minutes on one core (the llama_generate trace most).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="*", metavar="NAME",
                   help="corpus traces to study (file names in data/traces, or a prefix of one); default: all")
    p.add_argument("--signatures", nargs="*", default=[s.value for s in Signature], choices=[s.value for s in Signature],
                   help="how steps are matched: 'exact' (size and stream), 'class' (size class and stream), "
                        "'shape' (stream and lifetime, sizes may change; served with marked steps)")
    p.add_argument("--no-serve", action="store_true", help="plan only: skip serving the trace with the plan")
    p.add_argument("--json", type=Path, help="write every row here as JSON")
    p.add_argument("--from-json", type=Path, metavar="JSON",
                   help="print the tables of a record written by --json, without replaying anything")
    args = p.parse_args(argv)
    if args.json is not None and (why := json_target_problem(args.json)):
        p.error(f"--json: {why}")
    if args.from_json is not None:
        try:
            base, rows = load_record(args.from_json)
        except (OSError, ValueError) as exc:
            p.error(f"--from-json: cannot read {args.from_json} as a record of this study: {exc}")
        print_summary(base, rows)
        print_tables(base, rows)
        return 0
    paths = [(part, path) for part in CorpusPart for path in corpus_traces(part)]
    if args.traces:
        chosen = [(part, path) for part, path in paths if any(path.name.startswith(t) for t in args.traces)]
        unknown = [t for t in args.traces if not any(path.name.startswith(t) for _, path in paths)]
        if unknown:
            p.error(f"--traces: no corpus trace starts with {', '.join(unknown)}")
        paths = chosen
    base: list[BaselineRow] = []
    rows: list[VariantRow] = []
    for part, path in paths:
        t0 = time.perf_counter()
        trace = load_trace(path)
        life = Lifetimes.of(trace)
        live = trace.live_nbytes()
        label = path.name.removesuffix(".gz")
        base.append(baseline(trace, life, live, part.value, label))
        for s in args.signatures:
            rows.append(study_variant(trace, life, live, Signature(s), part.value, serve_it=not args.no_serve,
                                      label=label))
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print_summary(base, rows)
    print_tables(base, rows)
    if args.json:
        args.json.write_text(json.dumps({"device": DEVICE_SPEC, "baseline": [dataclasses.asdict(b) for b in base],
                                         "variants": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
