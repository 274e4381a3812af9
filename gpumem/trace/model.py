"""The trace model: a sequence of allocate/free operations keyed by dense allocation ids.

A :class:`Trace` is what every reader produces and every writer consumes. It is a
*struct of arrays*: op ``i`` is ``(kinds[i], alloc_ids[i], nbytes[i], streams[i],
times_us[i], addrs[i])``. Arrays keep a 900k-op trace in a few tens of MiB and
let statistics (peak live bytes, size histograms) run vectorised; a replayer that
must touch every op in pure Python should call :meth:`Trace.as_lists` once and
loop over plain lists, which is several times faster than indexing numpy arrays
element by element.

Allocation ids replace addresses. Source traces name an allocation by its
address, and addresses are reused as soon as memory is freed; a replayer feeding
a *different* allocator cannot use them. So allocation ``k`` is simply the k-th
``ALLOC`` op in the trace, and a ``FREE`` op names the id it releases. The original
address is kept in ``addrs`` (for export and debugging only).

Invariants (checked by :meth:`Trace.validate`, which the constructor calls):

* ``ALLOC`` ops carry ids ``0, 1, 2, ...`` in order;
* every ``FREE`` op names an id allocated *earlier* and freed only once;
* a ``FREE`` op repeats its allocation's ``nbytes`` and ``addr``;
* sizes are non-negative.

Allocations never freed are *live at the end* (``n_live_at_end``); frees whose
allocation happened before the trace window began were dropped by the reader and
counted in ``n_unmatched_frees``.

Stream uses (``Tensor.record_stream``) are not ops: :attr:`Trace.stream_uses` lists them apart,
each at the position in the op sequence where the program made it (:class:`StreamUse`), so that
every reader of ops sees the same ops with or without them. A use names an allocation live at that
point (allocated before it, not yet freed); one on the allocation's own stream is kept as the program
made it and changes nothing in a replay (the allocator ignores it, as PyTorch's does).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..units import format_bytes
from .limits import shorten

_INT64_MAX = 2**63 - 1
_STREAM_RANGE = "stream must be in [0, 2**63) (a cudaStream_t, as a .gmt file stores it)"

__all__ = ["OpKind", "TraceOp", "TraceSummary", "Trace", "SOURCES", "StreamUse", "StreamWait", "PlanEvent",
           "PlanEventKind"]

#: The values :attr:`Trace.source` takes for traces this package produced.
SOURCES = ("pytorch-snapshot", "rmm-log", "gpumem", "recorded")


class OpKind(enum.IntEnum):
    """What an op does: ``ALLOC`` creates allocation ``alloc_id``, ``FREE`` releases it."""

    ALLOC = 0
    FREE = 1


_KINDS = (OpKind.ALLOC, OpKind.FREE)


@dataclass(frozen=True, slots=True)
class TraceOp:
    """One operation, for iteration and tests (replayers should use :meth:`Trace.as_lists`).

    ``nbytes`` is the requested size; for a ``FREE`` it is the size of the
    allocation being freed. ``time_us`` is 0.0 and ``addr`` is 0 when unknown.
    """

    kind: OpKind
    alloc_id: int
    nbytes: int
    stream: int
    time_us: float
    addr: int


@dataclass(frozen=True, slots=True)
class StreamUse:
    """``record_stream``: allocation ``alloc_id`` is also used on ``stream`` from here on.

    ``at_op`` is where in the op sequence the program made the call: after ops ``0 .. at_op - 1``,
    before op ``at_op``. A replay calls the allocator's ``record_stream`` there, so that the block's
    free waits for the work queued on ``stream`` until then (Note [Streams] in
    :mod:`gpumem.allocator.caching`). ``time_us`` is the call's time (0.0 when unknown).
    """

    at_op: int
    alloc_id: int
    stream: int
    time_us: float = 0.0


@dataclass(frozen=True, slots=True)
class StreamWait:
    """``wait_stream``: work queued on ``stream`` from here on waits for the work queued on ``waited`` so far.

    ``at_op`` is where in the op sequence the program made the call, as for :class:`StreamUse` (after ops
    ``0 .. at_op - 1``, before op ``at_op``). A replay that runs the program's GPU work queues, there, a
    marker on ``stream`` that completes when the work queued on ``waited`` until then has (Note
    [Cross-stream waits] in :mod:`gpumem.sim.gpu_work`); a replay without GPU work (``idle``) ignores it.
    A wait of a stream on itself orders nothing and is kept as the program made it. ``time_us`` is the
    call's time (0.0 when unknown).
    """

    at_op: int
    stream: int
    waited: int
    time_us: float = 0.0


class PlanEventKind(enum.IntEnum):
    """What a program told gpumem's step plans (Note [Step plans] in :mod:`gpumem.allocator.plan`): a step mark
    (``gpumem.torch.step()``, or an optimizer step with automatic marks), or the memory-first warm-up begun or
    stopped (automatic marks turned on or off, the first optimizer on a GPU made)."""

    MARK = 0
    WARMUP_START = 1
    WARMUP_STOP = 2


@dataclass(frozen=True, slots=True)
class PlanEvent:
    """A step-plan event of the program (:class:`PlanEventKind`), at ``at_op`` as for :class:`StreamWait` (after
    ops ``0 .. at_op - 1``, before op ``at_op``). A replay under a policy gpumem.torch can run makes the same
    call to its allocator there (``mark_step``, ``start_plan_warmup``, ``stop_plan_warmup``: Note [Plan events in
    a replay] in :mod:`gpumem.replay`), so that it predicts a run with step plans. ``time_us`` is the call's
    time (0.0 when unknown)."""

    at_op: int
    kind: PlanEventKind
    time_us: float = 0.0


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Headline figures of a trace; ``str()`` gives a one-paragraph human-readable form."""

    name: str
    source: str
    n_ops: int
    n_allocs: int
    n_frees: int
    n_live_at_end: int
    n_unmatched_frees: int
    n_failed_allocs: int
    peak_live_nbytes: int
    total_alloc_nbytes: int
    max_alloc_nbytes: int
    median_alloc_nbytes: float
    n_streams: int
    duration_s: float

    def __str__(self) -> str:
        return (
            f"{self.name} ({self.source}): {self.n_ops:,} ops, {self.n_allocs:,} allocations "
            f"({self.n_live_at_end:,} live at the end), peak live {format_bytes(self.peak_live_nbytes)}, "
            f"largest {format_bytes(self.max_alloc_nbytes)}, median {format_bytes(self.median_alloc_nbytes)}, "
            f"{self.n_streams} stream(s), {self.duration_s:.3f} s"
            + (f", {self.n_unmatched_frees:,} unmatched frees skipped" if self.n_unmatched_frees else "")
            + (f", {self.n_failed_allocs:,} failed allocations" if self.n_failed_allocs else "")
        )


_DTYPES: dict[str, Any] = {
    "kinds": np.int8,
    "alloc_ids": np.int64,
    "nbytes": np.int64,
    "streams": np.int64,
    "times_us": np.float64,
    "addrs": np.int64,
}


@dataclass(eq=False)
class Trace:
    """An allocation trace as parallel numpy arrays, one element per op.

    Build one with a reader (:func:`gpumem.trace.load_trace`), with
    :meth:`from_ops`, or with a :class:`gpumem.trace.TraceRecorder`. The arrays
    are converted to their canonical dtypes and the invariants in the module
    docstring are checked on construction (``InvalidArgumentError`` if broken).

    ``n_live_at_end`` is derived from the arrays; passing a value other than 0
    that disagrees with them is an error. Treat a Trace as immutable: methods
    return new traces rather than editing arrays in place.
    """

    name: str
    source: str
    kinds: np.ndarray
    alloc_ids: np.ndarray
    nbytes: np.ndarray
    streams: np.ndarray
    times_us: np.ndarray
    addrs: np.ndarray
    n_unmatched_frees: int = 0
    n_live_at_end: int = 0
    n_failed_allocs: int = 0
    stream_uses: tuple[StreamUse, ...] = ()
    """The program's ``record_stream`` calls, in order (module docstring); empty for most sources."""
    stream_waits: tuple[StreamWait, ...] = ()
    """The program's cross-stream waits, in order (module docstring); empty for most sources."""
    plan_events: tuple[PlanEvent, ...] = ()
    """The program's step marks and warm-up switches (gpumem.torch traces), in order; empty for other sources."""
    gpu_times_us: np.ndarray | None = None
    """The GPU clock (gpumem.torch traces recorded with ``start_trace(gpu_clock=True)``; None for others): per op,
    when the GPU had run the work queued on the op's stream before it, on the trace's clock, in microseconds (NaN
    where unknown). A replay runs the program's GPU work on it (Note [A replay on the recorded GPU clock] in
    :mod:`gpumem.sim.gpu_work`)."""
    live_reserved_nbytes: np.ndarray | None = None
    """The live engine's reserved bytes after each allocation (gpumem.torch traces; None for others): int64 per
    op, -1 where not recorded (frees, and ops of older recorders). :func:`gpumem.replay_compare.compare_live`
    compares a replay's with it op by op (Note [The live engine's reserve] in ``gpumem/_native/torch_api.cpp``)."""

    __hash__ = None  # type: ignore[assignment]  # mutable container of arrays

    def __post_init__(self) -> None:
        for field_name, dtype in _DTYPES.items():
            arr = np.asarray(getattr(self, field_name))
            if arr.dtype != dtype:
                arr = arr.astype(dtype)
            if arr.ndim != 1:
                raise InvalidArgumentError(f"Trace.{field_name} must be one-dimensional, got shape {arr.shape}")
            setattr(self, field_name, arr)
        n = len(self.kinds)
        for field_name in _DTYPES:
            if len(getattr(self, field_name)) != n:
                raise InvalidArgumentError(
                    f"Trace.{field_name} has {len(getattr(self, field_name))} elements, kinds has {n}"
                )
        uses = tuple(self.stream_uses)
        if not all(isinstance(u, StreamUse) for u in uses):
            raise InvalidArgumentError("Trace.stream_uses must hold StreamUse objects")
        self.stream_uses = uses
        waits = tuple(self.stream_waits)
        if not all(isinstance(w, StreamWait) for w in waits):
            raise InvalidArgumentError("Trace.stream_waits must hold StreamWait objects")
        self.stream_waits = waits
        plans = tuple(self.plan_events)
        if not all(isinstance(e, PlanEvent) for e in plans):
            raise InvalidArgumentError("Trace.plan_events must hold PlanEvent objects")
        self.plan_events = plans
        if self.gpu_times_us is not None:
            given = np.asarray(self.gpu_times_us) if not isinstance(self.gpu_times_us, (bool, str, bytes)) else None
            if given is None or given.dtype != np.float64 or given.shape != (n,):
                raise InvalidArgumentError(
                    f"Trace.gpu_times_us must be one float64 per op ({n}; microseconds on the trace's clock need "
                    "float64's 53 bits), got "
                    + (f"{given.dtype} of shape {given.shape}" if given is not None
                       else f"a {type(self.gpu_times_us).__name__}"))
            clock = given
            if np.isinf(clock).any():
                raise InvalidArgumentError(f"Trace.gpu_times_us: op {int(np.flatnonzero(np.isinf(clock))[0])} has an "
                                           "infinite time (NaN is for unknown)")
            self.gpu_times_us = clock
        if self.live_reserved_nbytes is not None:
            got = (np.asarray(self.live_reserved_nbytes)
                   if not isinstance(self.live_reserved_nbytes, (bool, str, bytes)) else None)
            if got is None or got.dtype != np.int64 or got.shape != (n,):
                raise InvalidArgumentError(
                    f"Trace.live_reserved_nbytes must be one int64 per op ({n}; -1 where not recorded), got "
                    + (f"{got.dtype} of shape {got.shape}" if got is not None
                       else f"a {type(self.live_reserved_nbytes).__name__}"))
            if n and int(got.min()) < -1:
                raise InvalidArgumentError(f"Trace.live_reserved_nbytes: op {int(np.argmin(got))} has "
                                           f"{int(got.min())} bytes (-1 is for not recorded)")
            # none recorded is no reserves: one form, so that a trace written and read back is equal to itself
            self.live_reserved_nbytes = got if (got >= 0).any() else None
        self.validate()
        self.stream_uses, self.stream_waits = _float_times(self.stream_uses), _float_times(self.stream_waits)
        self.plan_events = _float_times(self.plan_events)
        live = self.n_allocs - int(np.count_nonzero(self.kinds == OpKind.FREE))
        if self.n_live_at_end not in (0, live):
            raise InvalidArgumentError(f"n_live_at_end={self.n_live_at_end} but the ops leave {live} allocations live")
        self.n_live_at_end = live

    # -- invariants -----------------------------------------------------------------

    def validate(self) -> None:
        """Check the invariants of the module docstring; raise ``InvalidArgumentError`` naming the first bad op
        (or stream use, or stream wait)."""
        self._validate_ops()
        if self.stream_uses:
            self._validate_uses()
        if self.stream_waits:
            self._validate_waits()
        if self.plan_events:
            self._validate_plan_events()

    def _validate_plan_events(self) -> None:
        last = 0
        for k, e in enumerate(self.plan_events):
            where = f"plan event {k} ({_show(e.kind)} before op {_show(e.at_op)})"
            _check_placed_event(where, e, ("at_op",), last, self.n_ops, "plan events")
            if not isinstance(e.kind, PlanEventKind):
                raise InvalidArgumentError(f"{where}: kind must be a PlanEventKind")
            _check_time_us(where, e.time_us)
            last = e.at_op

    def _validate_waits(self) -> None:
        n_ops = self.n_ops
        last = 0
        for k, w in enumerate(self.stream_waits):
            where = (f"stream wait {k} (stream {_show(w.stream)} waits for stream {_show(w.waited)} before op "
                     f"{_show(w.at_op)})")
            _check_placed_event(where, w, ("at_op", "stream", "waited"), last, n_ops, "waits")
            if not (0 <= w.stream <= _INT64_MAX and 0 <= w.waited <= _INT64_MAX):
                raise InvalidArgumentError(f"{where}: {_STREAM_RANGE}")
            _check_time_us(where, w.time_us)
            last = w.at_op

    def _validate_uses(self) -> None:
        n_ops = self.n_ops
        is_alloc = self.kinds == OpKind.ALLOC
        alloc_pos = np.flatnonzero(is_alloc)
        free_pos = np.full(len(alloc_pos), n_ops, dtype=np.int64)   # never freed: live to the end
        frees = np.flatnonzero(~is_alloc)
        free_pos[self.alloc_ids[frees]] = frees
        last = 0
        for k, u in enumerate(self.stream_uses):
            where = (f"stream use {k} (record_stream of id {_show(u.alloc_id)} on stream {_show(u.stream)} before op "
                     f"{_show(u.at_op)})")
            _check_placed_event(where, u, ("at_op", "alloc_id", "stream"), last, n_ops, "uses")
            if not 0 <= u.alloc_id < len(alloc_pos) or alloc_pos[u.alloc_id] >= u.at_op:
                raise InvalidArgumentError(f"{where}: the allocation is not made before it")
            if free_pos[u.alloc_id] < u.at_op:
                raise InvalidArgumentError(f"{where}: the allocation is freed (op {free_pos[u.alloc_id]}) before it")
            if not 0 <= u.stream <= _INT64_MAX:
                raise InvalidArgumentError(f"{where}: {_STREAM_RANGE}")
            _check_time_us(where, u.time_us)
            last = u.at_op

    def _validate_ops(self) -> None:
        kinds = self.kinds
        if len(kinds) == 0:
            return
        bad = np.flatnonzero((kinds != OpKind.ALLOC) & (kinds != OpKind.FREE))
        if len(bad):
            raise InvalidArgumentError(f"op {bad[0]}: kind {kinds[bad[0]]} is neither ALLOC (0) nor FREE (1)")
        bad = np.flatnonzero(self.nbytes < 0)
        if len(bad):
            raise InvalidArgumentError(f"op {bad[0]}: negative size {self.nbytes[bad[0]]}")
        is_alloc = kinds == OpKind.ALLOC
        alloc_pos = np.flatnonzero(is_alloc)
        n_allocs = len(alloc_pos)
        # Live bytes, totals and peaks are computed in int64: refuse sizes whose sum would wrap.
        if n_allocs and int(self.nbytes[alloc_pos].max()) * n_allocs > _INT64_MAX \
                and sum(int(n) for n in self.nbytes[alloc_pos]) > _INT64_MAX:
            raise InvalidArgumentError(f"the trace's {n_allocs} allocations add up to more than 2**63 - 1 bytes")
        bad = np.flatnonzero(self.alloc_ids[alloc_pos] != np.arange(n_allocs))
        if len(bad):
            i = alloc_pos[bad[0]]
            raise InvalidArgumentError(
                f"op {i}: ALLOC has id {self.alloc_ids[i]}, expected {bad[0]} (ids are dense, in alloc order)"
            )
        free_pos = np.flatnonzero(~is_alloc)
        if len(free_pos) == 0:
            return
        ids = self.alloc_ids[free_pos]
        bad = np.flatnonzero((ids < 0) | (ids >= n_allocs))
        if len(bad):
            raise InvalidArgumentError(f"op {free_pos[bad[0]]}: FREE of id {ids[bad[0]]}, which is never allocated")
        bad = np.flatnonzero(alloc_pos[ids] > free_pos)
        if len(bad):
            raise InvalidArgumentError(f"op {free_pos[bad[0]]}: FREE of id {ids[bad[0]]} before its ALLOC")
        seen = np.bincount(ids, minlength=n_allocs)
        if seen.max() > 1:
            twice = int(np.flatnonzero(seen > 1)[0])
            second = free_pos[np.flatnonzero(ids == twice)[1]]
            raise InvalidArgumentError(f"op {second}: id {twice} freed a second time")
        bad = np.flatnonzero(self.nbytes[free_pos] != self.nbytes[alloc_pos[ids]])
        if len(bad):
            i = free_pos[bad[0]]
            raise InvalidArgumentError(
                f"op {i}: FREE of id {ids[bad[0]]} says {self.nbytes[i]} bytes, the ALLOC said "
                f"{self.nbytes[alloc_pos[ids[bad[0]]]]}"
            )
        bad = np.flatnonzero(self.addrs[free_pos] != self.addrs[alloc_pos[ids]])
        if len(bad):
            i = free_pos[bad[0]]
            raise InvalidArgumentError(f"op {i}: FREE of id {ids[bad[0]]} has a different addr than its ALLOC")

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_ops(
        cls,
        name: str,
        source: str,
        ops: Iterable[TraceOp | Sequence[Any]],
        *,
        n_unmatched_frees: int = 0,
        n_failed_allocs: int = 0,
    ) -> Trace:
        """Build a trace from ``TraceOp`` objects or ``(kind, alloc_id, nbytes, stream, time_us, addr)`` tuples."""
        rows = [
            (op.kind, op.alloc_id, op.nbytes, op.stream, op.time_us, op.addr) if isinstance(op, TraceOp) else op
            for op in ops
        ]
        for i, row in enumerate(rows):
            if len(row) != 6:
                raise InvalidArgumentError(f"op {i}: expected 6 fields (kind, alloc_id, nbytes, stream, time_us, addr)")
        cols: list[Sequence[Any]] = list(zip(*rows)) if rows else [()] * 6
        return cls(
            name,
            source,
            np.array(cols[0], dtype=np.int8),
            np.array(cols[1], dtype=np.int64),
            np.array(cols[2], dtype=np.int64),
            np.array(cols[3], dtype=np.int64),
            np.array(cols[4], dtype=np.float64),
            np.array(cols[5], dtype=np.int64),
            n_unmatched_frees=n_unmatched_frees,
            n_failed_allocs=n_failed_allocs,
        )

    @classmethod
    def empty(cls, name: str = "empty", source: str = "gpumem") -> Trace:
        """A trace with no ops."""
        return cls.from_ops(name, source, [])

    # -- sizes and iteration --------------------------------------------------------

    @property
    def n_ops(self) -> int:
        """Number of ops (allocs plus frees)."""
        return len(self.kinds)

    @property
    def n_allocs(self) -> int:
        """Number of ALLOC ops, which is also one past the largest alloc id."""
        return int(np.count_nonzero(self.kinds == OpKind.ALLOC))

    @property
    def n_frees(self) -> int:
        """Number of FREE ops."""
        return self.n_ops - self.n_allocs

    def __len__(self) -> int:
        return self.n_ops

    def __iter__(self) -> Iterator[TraceOp]:
        cols = (self.kinds.tolist(), self.alloc_ids.tolist(), self.nbytes.tolist(),
                self.streams.tolist(), self.times_us.tolist(), self.addrs.tolist())
        for k, i, n, s, t, a in zip(*cols):
            yield TraceOp(_KINDS[k], i, n, s, t, a)

    def __getitem__(self, index: int) -> TraceOp:
        """Op ``index`` as a :class:`TraceOp` (negative indices count from the end)."""
        return TraceOp(
            _KINDS[int(self.kinds[index])],
            int(self.alloc_ids[index]),
            int(self.nbytes[index]),
            int(self.streams[index]),
            float(self.times_us[index]),
            int(self.addrs[index]),
        )

    def as_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """``(kinds, alloc_ids, nbytes, streams)`` as plain lists, for fast pure-Python replay loops.

        ``for kind, aid, n, s in zip(*trace.as_lists()):`` runs several times faster
        than indexing the arrays. ``kinds`` holds ints (0 = ALLOC, 1 = FREE).
        """
        return self.kinds.tolist(), self.alloc_ids.tolist(), self.nbytes.tolist(), self.streams.tolist()

    # -- comparison -----------------------------------------------------------------

    def ops_equal(self, other: Trace, *, times: bool = True, addrs: bool = True) -> bool:
        """True when both traces hold the same ops (optionally ignoring times and/or addresses)."""
        if self.n_ops != other.n_ops:
            return False
        names = ["kinds", "alloc_ids", "nbytes", "streams"] + (["addrs"] if addrs else [])
        if not all(np.array_equal(getattr(self, f), getattr(other, f)) for f in names):
            return False
        return not times or np.array_equal(self.times_us, other.times_us, equal_nan=True)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self.name == other.name
            and self.source == other.source
            and self.n_unmatched_frees == other.n_unmatched_frees
            and self.n_live_at_end == other.n_live_at_end
            and self.n_failed_allocs == other.n_failed_allocs
            and self.ops_equal(other)
            and self.stream_uses == other.stream_uses
            and self.stream_waits == other.stream_waits
            and self.plan_events == other.plan_events
            and (self.gpu_times_us is None) == (other.gpu_times_us is None)
            and (self.gpu_times_us is None
                 or np.array_equal(self.gpu_times_us, other.gpu_times_us, equal_nan=True))   # type: ignore[arg-type]
            and (self.live_reserved_nbytes is None) == (other.live_reserved_nbytes is None)
            and (self.live_reserved_nbytes is None
                 or np.array_equal(self.live_reserved_nbytes, other.live_reserved_nbytes))   # type: ignore[arg-type]
        )

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, source={self.source!r}, n_ops={self.n_ops}, n_allocs={self.n_allocs}, "
            f"n_live_at_end={self.n_live_at_end}, n_unmatched_frees={self.n_unmatched_frees})"
        )

    # -- statistics -----------------------------------------------------------------

    def live_nbytes(self) -> np.ndarray:
        """Sum of live requested sizes after each op (int64 array of length ``n_ops``)."""
        signed = np.where(self.kinds == OpKind.ALLOC, self.nbytes, -self.nbytes)
        return np.cumsum(signed, dtype=np.int64)

    @property
    def peak_live_nbytes(self) -> int:
        """The largest sum of live requested sizes at any point of the trace (0 for an empty trace)."""
        if self.n_ops == 0:
            return 0
        return max(0, int(self.live_nbytes().max()))

    def summary(self) -> TraceSummary:
        """Headline figures: counts, peak live bytes, size extremes, streams and duration."""
        alloc_sizes = self.nbytes[self.kinds == OpKind.ALLOC]
        times = self.times_us[np.isfinite(self.times_us)]
        return TraceSummary(
            name=self.name,
            source=self.source,
            n_ops=self.n_ops,
            n_allocs=len(alloc_sizes),
            n_frees=self.n_ops - len(alloc_sizes),
            n_live_at_end=self.n_live_at_end,
            n_unmatched_frees=self.n_unmatched_frees,
            n_failed_allocs=self.n_failed_allocs,
            peak_live_nbytes=self.peak_live_nbytes,
            total_alloc_nbytes=int(alloc_sizes.sum()),
            max_alloc_nbytes=int(alloc_sizes.max()) if len(alloc_sizes) else 0,
            median_alloc_nbytes=float(np.median(alloc_sizes)) if len(alloc_sizes) else 0.0,
            n_streams=len(np.unique(self.streams)),
            duration_s=float(times.max() - times.min()) / 1e6 if len(times) else 0.0,
        )

    # -- windows --------------------------------------------------------------------

    def slice(self, start: int = 0, stop: int | None = None) -> Trace:
        """The ops in ``[start, stop)`` as a new trace, with ids renumbered from 0.

        Frees of allocations made before ``start`` are dropped and counted in the
        new trace's ``n_unmatched_frees`` (a reader would have done the same with a
        trace recorded from ``start`` on). Counters describing the whole source
        (``n_unmatched_frees``, ``n_failed_allocs`` of ``self``) are not carried over.
        Stream uses inside the window of allocations made in it are kept, and stream waits and plan events made
        from just before op ``start`` to just before op ``stop`` (a wait at either edge orders work of the window).
        """
        n = self.n_ops
        start, stop, _ = slice(start, stop).indices(n)
        stop = max(start, stop)
        kinds = self.kinds[start:stop]
        ids = self.alloc_ids[start:stop]
        is_alloc = kinds == OpKind.ALLOC
        new_id = np.full(self.n_allocs, -1, dtype=np.int64)
        new_id[ids[is_alloc]] = np.arange(int(is_alloc.sum()), dtype=np.int64)
        mapped = new_id[ids] if len(ids) else ids
        keep = mapped >= 0
        kept_before = np.concatenate(([0], np.cumsum(keep)))   # ops kept before each position of the window
        uses = tuple(StreamUse(int(kept_before[u.at_op - start]), int(new_id[u.alloc_id]), u.stream, u.time_us)
                     for u in self.stream_uses if start < u.at_op <= stop and new_id[u.alloc_id] >= 0)
        waits = tuple(StreamWait(int(kept_before[w.at_op - start]), w.stream, w.waited, w.time_us)
                      for w in self.stream_waits if start <= w.at_op <= stop)
        plans = tuple(PlanEvent(int(kept_before[e.at_op - start]), e.kind, e.time_us)
                      for e in self.plan_events if start <= e.at_op <= stop)
        return Trace(
            self.name,
            self.source,
            kinds[keep],
            mapped[keep],
            self.nbytes[start:stop][keep],
            self.streams[start:stop][keep],
            self.times_us[start:stop][keep],
            self.addrs[start:stop][keep],
            n_unmatched_frees=int(np.count_nonzero(~keep)),
            stream_uses=uses,
            stream_waits=waits,
            plan_events=plans,
            gpu_times_us=None if self.gpu_times_us is None else self.gpu_times_us[start:stop][keep],
            live_reserved_nbytes=(None if self.live_reserved_nbytes is None
                                  else self.live_reserved_nbytes[start:stop][keep]),
        )

    def head(self, n_ops: int) -> Trace:
        """The first ``n_ops`` ops (ids are unchanged, since allocs precede their frees)."""
        return self.slice(0, n_ops)

    def renamed(self, name: str) -> Trace:
        """The same ops under another name."""
        return Trace(
            name, self.source, self.kinds, self.alloc_ids, self.nbytes, self.streams, self.times_us, self.addrs,
            n_unmatched_frees=self.n_unmatched_frees, n_failed_allocs=self.n_failed_allocs,
            stream_uses=self.stream_uses, stream_waits=self.stream_waits, plan_events=self.plan_events,
            gpu_times_us=self.gpu_times_us, live_reserved_nbytes=self.live_reserved_nbytes,
        )


def _check_placed_event(where: str, event: object, int_fields: tuple[str, ...], last: int, n_ops: int,
                        plural: str) -> None:
    """A stream use's or wait's integer fields, and its position: sorted, within the trace's ops."""
    for name in int_fields:
        v = getattr(event, name)
        if type(v) is not int and not isinstance(v, np.integer):
            raise InvalidArgumentError(f"{where}: {name} must be an int, not {type(v).__name__}")
    at_op = getattr(event, "at_op")
    if not last <= at_op <= n_ops:
        raise InvalidArgumentError(f"{where}: at_op out of order or outside [{last}, {n_ops}] "
                                   f"({plural} are sorted by position)")


def _check_time_us(where: str, t: object) -> None:
    """A finite time in microseconds that a float holds (bool refused; an int too large for a float is refused
    here, where ``math.isfinite`` raised OverflowError)."""
    if type(t) is bool or not isinstance(t, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{where}: time_us must be a finite number, not {_show(t)}")
    try:
        finite = math.isfinite(float(t))
    except OverflowError:
        finite = False
    if not finite:
        raise InvalidArgumentError(f"{where}: time_us must be a finite number that a float holds, not {_show(t)}")


def _float_times(events: tuple[Any, ...]) -> tuple[Any, ...]:
    """``events`` (stream uses or waits, checked) with each ``time_us`` a float, as a .gmt file stores it: an
    int time of 10**30 would otherwise come back from a write and a read as another number."""
    if all(type(e.time_us) is float for e in events):
        return events
    return tuple(e if type(e.time_us) is float else dataclasses.replace(e, time_us=float(e.time_us)) for e in events)


def _show(v: object) -> str:
    """``v`` for an error message, however large (``str`` of an int of over 4,300 digits raises)."""
    return shorten(int(v)) if isinstance(v, np.integer) else shorten(v)
