"""The streamed replay of ``generate()`` made faster without changing a byte of its figures.

Note [One stream, every policy]
    :func:`~gpumem.estimate.fit.replay_inference` used to make the ops of ``generate()`` once per policy
    (``stream_inference`` with one sink). The ops do not depend on the policy, so the fast path makes them once
    and hands each op to every policy's allocator in turn (:class:`SinkGroup`). A policy that runs out of memory
    stops taking ops, as ``replay(stop_on_oom=True)`` does; the stream stops when all have. Each allocator sees
    exactly the op sequence it saw alone: same figures, one emitter instead of three.

Note [Small pool skipped at a fixed point]
    In a ``malloc``'d-segment policy with a separate small pool (``pytorch``, ``bestfit``: the Python engine's
    ``SegmentBacking``), requests of at most ``small_max_nbytes`` and larger ones never share a segment or a
    free list: the small pool changes only by small ops, and the large pool only by large ones. The two meet in
    three places: the limit (the sum of both reserves), the out-of-memory retry (which gives back the cached
    segments of both) and the peak of reserved bytes (counted at each allocation). A decode step makes the
    same small requests as the step before it but for the ones whose rounded size grows (input ids, mask, a
    KV cache under 1 MiB): at batch 1 the int64 ids and mask round to a new 512 B multiple every 64 steps.

    :class:`SkippingSink` replays every op of the first decode steps. At the end of each it notes the small
    pool's state (every small segment's blocks: address, size, allocated; its live count and flags) and the
    step's small ops (kind, rounded size, and for a free which step and position allocated it) with the
    address each small allocation got. The small pool repeats with a period ``P`` (1 to :data:`MAX_PERIOD`;
    the 7B model's: 3). Once the last ``P`` steps left the state as they found it, no free among them reaches
    further back than the step before, and the step before them made the small ops of the last one and got
    its addresses, the next ``P`` steps start in that state and, as long as their small ops are those of the
    period again, the deterministic allocator makes the same decisions for them: their frees name the
    addresses the period before got (the first step's, those of the period's last step, equal to the step
    before it), so the allocator sees the very same calls from the very same state, grows nothing in the
    small pool and ends in the same state (induction on the periods). So their small ops are not sent: a
    skipped allocation is booked at its template address, a skipped free forgotten. Large ops are all sent,
    in order. The limit sees the same sum (the small pool's reserve is constant over a fixed point), and the
    peak reserved is the same (the small pool's reserve never changes while skipped, the large pool's only at
    large allocations, all made).

    The skip ends (the small ops skipped since the period began are sent, in order, each checked to land at
    its template address, else :class:`~gpumem.errors.InternalError`; the small pool is independent of the
    large ops sent in between) at a small op that differs from the period's (a size rounded to the next 512 B),
    and before a large allocation that finds no cached block and whose new segment would pass the limit: the
    out-of-memory retry that follows releases small segments, so it must see the small pool as the full replay
    has it mid-step. Any other out-of-memory error or retry while small ops were left out (a device that
    refuses a segment within the limit) voids the fast result: :func:`~gpumem.estimate.fit.replay_inference`
    then replays that policy by the full path (one within the prefix: Note [Stopped where the prefix trace
    stops too]). ``replay_inference(..., full_replay=True)``
    keeps the reference, and ``tests/estimate/test_fast_replay.py`` checks both to the byte on random shapes,
    lengths, limits and policies. ``expandable`` is skipped too (Note [Expandable's small pool skipped]); ``gpumem``
    (its chunks stolen across pools by the live-page peak) is not. On the native engine the skip is made step by
    step (Note [The small pool skipped on the native engine]).

Note [Expandable's small pool skipped]
    Where the native engine is built, ``expandable`` runs on it (Note [Pages of a pool's own size] in
    ``gpumem/_native/engine.cpp``), its small pool skipped as below (Note [The small pool skipped on the native
    engine]: the engine is the Python one's port, with the same state). What follows is said of the Python
    engine, over a virtual range per pool (Note [Expandable segments] in
    :mod:`gpumem.allocator.policy`): growth by whole pages of the pool's own size, no steal, no slack. Its two
    pools share what the segment policies share (the limit, the out-of-memory retry that releases both, the
    reserved bytes counted at each allocation) and three more things: the list of chunks held but mapped
    nowhere, the count of pages holding live data and its peak. The count and its peak decide only steals
    and chunk sizes (``steal_empty_pages`` or ``growth=CHUNKS``), which this policy never takes, and no
    figure of the estimate reads them; mid-step they differ while small ops are left out, at step ends they
    are the full replay's again once the skipped ops are sent. The unmapped chunks change only by a release
    (an out-of-memory retry: the skip ends before one, or the fast result is void) or a map; a small-pool map
    within a period would change its mapped pages, which only a release unmaps, so a period that leaves the
    range as it found it maps nothing and takes no chunk. So the segment case's argument holds with the
    small pool's state read off its range (:meth:`SkippingSink._small_range_state`: blocks, top, the pages'
    references, chunks, empty order, fences) and the growth test made for pages: a large request of ``n``
    rounded bytes touches at most ``n / page + 1`` pages; while those, all mapped anew, stay within the
    limit, it cannot run out of memory by the limit; past it the skip ends first. The tests check it as the
    segment case's, policy ``expandable`` included.

Note [Stopped where the prefix trace stops too]
    The full path replays the first ``PREFIX_STEP`` tokens as a trace (Note [Prefix first] in :mod:`.fit`) and
    reports that replay when it runs out of memory; so a stream with an out-of-memory error or retry up to
    step ``PREFIX_STEP`` was voided and redone that way (``gpumem fit``'s probes that do not fit mostly stop in
    the prefill: each was replayed twice). The trace's ops are the stream's, op for op, up to the end of step
    ``PREFIX_STEP - 1`` (its ending differs: it frees the cache; ``tests/estimate/test_fast_replay.py`` checks the
    shared part). A stream that stopped on an error at a step before ``PREFIX_STEP`` made the same calls on the
    same allocator as the trace's replay up to that error, which stops the replay there too (``stop_on_oom``):
    the same peak reserved and the same message, so the result is kept. A retry there without an error, or an
    error at step ``PREFIX_STEP``, still sends the policy to the full path (the trace's ending may run out of
    memory where the stream does not). Those are not replayed in full either: the full path replays the
    prefix trace and, when that fits, streams every op from the start, which is what the stream did; so only
    the prefix trace is replayed (:func:`~gpumem.estimate.fit.replay_inference`), its result taken when it
    does not fit, the stream's otherwise.

Note [Decode step template]
    Without a sliding window, every size a decode step asks for is a shape constant or one times the cache
    length, which grows by one token per step (Note [Decode] in :mod:`.workload`), and its order of ops does
    not depend on the step: step ``t``'s ops are step 2's with each size ``base + (t - 2) * slope`` and each op
    id shifted by ``t - 2`` steps' allocations. :class:`StepJumper` records the emitter's steps 1 to 4, builds
    that template from steps 2 to 4 (:func:`build_template`: one structure, sizes exactly affine, no free of
    anything older than the step before; else nothing is jumped) and makes steps 5 onwards from arrays, handing
    each sink a whole step (``run_step``): a :class:`PlainSink` sends its ops in a tight loop, a
    :class:`SkippingSink` in a skipped step compares the step's small requests with the period's at once and
    sends only the large ops (a period's steps made by the emitter, steps 2 to 4, get their small requests from
    the template too, as they are its steps: the first period, up to step 64 at batch 1, was skipped op by op).
    The emitter then resumes for the end of ``generate()`` with its state moved to
    the last step (``tests/estimate/test_fast_replay.py`` compares every op with the emitter's). What is left
    is the large pool: a step's large ops are all replayed (the KV cache grows every step), so the time still
    grows with the new tokens, about ten times slower than it would with nothing replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..allocator.backing import SegmentBacking, VirtualBacking, pool_page_nbytes
from ..allocator.native import NativeEngine
from ..allocator.policy import GrowthRule, SegmentRule
from ..allocator.python_engine import PythonEngine
from ..errors import InternalError, OutOfMemoryError
from ..native import native_module
from .workload import DECODE_HEAD_STEPS

__all__ = ["SinkGroup", "PlainSink", "TwinLag", "native_run_ops", "SkippingSink", "NativeSkippingSink", "can_skip_small_pool",
           "make_sink", "AllStopped", "StepTemplate", "StepJumper", "build_template"]


PREFIX_STEP = DECODE_HEAD_STEPS + 1
"""The last step (0: the prefill) whose ops ``replay_inference``'s full path replays as a trace first (Note [Prefix
first] in :mod:`.fit`): an out-of-memory error or retry up to there sends a policy to the full path."""

MAX_PERIOD = 4
"""The longest run of decode steps after which the small pool may repeat (Note [Small pool skipped at a fixed
point]: the 7B model's repeats every 3 steps)."""


class AllStopped(Exception):
    """Every sink of a :class:`SinkGroup` has stopped (out of memory): the rest of the workload is not made."""


def _engine_of(allocator: Any) -> Any:
    return getattr(allocator, "_engine", None)


def can_skip_small_pool(allocator: Any) -> bool:
    """Whether Note [Small pool skipped at a fixed point] applies: a separate small pool, no history, no
    garbage-collection threshold, over ``malloc``'d segments or over virtual ranges whose pages are never stolen
    (``expandable``: Note [Expandable's small pool skipped]); on the Python engine, or on the native one with its
    own ``allocate`` and ``free`` and no step plan (Note [The small pool skipped on the native engine])."""
    eng = _engine_of(allocator)
    if isinstance(eng, NativeEngine):
        pol = getattr(allocator, "policy", None)
        if (pol is None or not pol.separate_small_pool or getattr(allocator, "gc_threshold", 0) is not None
                or native_run_ops(allocator) is None or not hasattr(eng._ext, "small_pool_state")):
            return False
        info = eng.step_plan_info()
        if info[0] or info[3]:  # a step plan recording or installed, or its arena still mapped
            return False
        if not eng.uses_vmm:
            return True
        return not pol.steal_empty_pages and pol.growth is GrowthRule.PAGES and not pol.stream_ordered_steal
    if not (isinstance(eng, PythonEngine) and eng.policy.separate_small_pool and eng.gc_threshold is None
            and eng._recorder is None):
        return False
    if isinstance(eng.backing, SegmentBacking):
        return True
    pol = eng.policy
    return (isinstance(eng.backing, VirtualBacking) and not pol.steal_empty_pages
            and pol.growth is GrowthRule.PAGES and not pol.stream_ordered_steal)


def make_sink(allocator: Any, skip: bool = True, gpu: Any = None) -> "PlainSink":
    """The sink for ``allocator`` on the fast path: one that skips the small pool where it can be skipped
    (:func:`can_skip_small_pool`; ``skip`` False: never), on the Python engine (:class:`SkippingSink`) or the
    native one (:class:`NativeSkippingSink`), else a :class:`PlainSink`. With ``gpu`` (the program's GPU work beside
    the ops: :class:`~gpumem.sim.gpu_work.ModelGpu` or :class:`TwinLag`) a :class:`PlainSink` that sends every op:
    a skipped op's time would be missing from the GPU's clock."""
    if gpu is not None:
        return PlainSink(allocator, gpu)
    if not skip or not can_skip_small_pool(allocator):
        return PlainSink(allocator)
    if isinstance(_engine_of(allocator), NativeEngine):
        return NativeSkippingSink(allocator)
    return SkippingSink(allocator)


def native_run_ops(allocator: Any) -> Any:
    """The native engine's ``run_ops`` when ``allocator``'s ``allocate`` and ``free`` are the engine's own (no
    override between them), else None (Note [A step's ops in one call] in ``gpumem/_native/op_table.h``)."""
    eng = _engine_of(allocator)
    if (isinstance(eng, NativeEngine) and getattr(allocator, "allocate", None) is eng.allocate
            and getattr(allocator, "free", None) is eng.free):
        return eng.run_ops
    return None


class TwinLag:
    """The native engine's twin running the program's GPU work (Note [A twin that runs the program's GPU work] in
    ``gpumem/_native/pybackend.cpp``), with :class:`~gpumem.sim.gpu_work.ModelGpu`'s ``before`` and ``after``; its
    ``run_ops`` makes both itself."""

    __slots__ = ("before", "after")

    def __init__(self, engine: NativeEngine) -> None:
        self.before = engine.lag_before
        self.after = engine.lag_after


class PlainSink:
    """Sends every op to ``allocator``; stops at its first out-of-memory error (Note [One stream, every policy]).
    Over the native engine, a step made from the template goes to the engine in one call (:meth:`run_step`).
    ``gpu``: the program's GPU work, told of each op (``before()``) and allocation (``after(stream, ptr, nbytes)``)."""

    def __init__(self, allocator: Any, gpu: Any = None) -> None:
        self.allocator = allocator
        self._allocate = allocator.allocate
        self._free = allocator.free
        self.gpu = gpu
        # run_ops tells the GPU of its ops only when it is the engine's own twin
        self._run_ops_native = native_run_ops(allocator) if gpu is None or isinstance(gpu, TwinLag) else None
        self.ptrs: Any = native_module().PtrTable() if self._run_ops_native is not None else {}
        """Op id -> the pointer its allocation got (0: a zero-byte one): a dict, or over the native engine the
        engine's ``PtrTable`` (a dict of ints held in C++, which ``run_ops`` reads and writes)."""
        self.error: OutOfMemoryError | None = None
        self.skipped_ops = 0
        self.step = 0
        self.early_trouble = False
        """An out-of-memory error or retry within the prefix (Note [Prefix first] in :mod:`.fit`)."""
        self.error_step = -1
        """The step (0: the prefill) whose op ran out of memory and stopped this sink."""
        self.small_skip_bound_nbytes = 0
        """An upper bound of the bytes of the small blocks a step whose small ops were left out holds at any moment
        and the allocator does not count, 0 where no step was left out (Note [The peak of blocks on the fast
        path])."""

    def alloc(self, op_id: int, nbytes: int) -> None:
        if self.error is None:
            gpu = self.gpu
            try:
                if gpu is not None:
                    gpu.before()
                # a zero-byte allocation takes no memory (as in replay()): no pointer, its free is skipped
                p = self.ptrs[op_id] = self._allocate(nbytes, 0) if nbytes else 0
                if gpu is not None and p:
                    gpu.after(0, p, nbytes)
            except OutOfMemoryError as exc:
                self._stop(exc)

    def _stop(self, exc: OutOfMemoryError) -> None:
        """The out-of-memory error ``exc`` stops this sink (in decode step ``self.step``)."""
        self.error = exc
        self.error_step = self.step
        if self.step <= PREFIX_STEP:
            self.early_trouble = True

    def free(self, op_id: int) -> None:
        p = self.ptrs.pop(op_id, 0)
        if self.error is None:
            if self.gpu is not None:
                self.gpu.before()
            if p:
                self._free(p)

    def end_step(self, step: int) -> None:
        """Called after the prefill (0) and each decode step."""
        self._check_prefix(step)
        self.step = step + 1

    def _check_prefix(self, step: int) -> None:
        if step <= PREFIX_STEP and not self.early_trouble:
            st = self.allocator.snapshot_stats()
            self.early_trouble = bool(st.num_alloc_retries or st.num_ooms)

    def run_step(self, t: int, tpl: "StepTemplate") -> None:
        """Every op of decode step ``t`` made from ``tpl`` (Note [Decode step template]); over the native engine in
        one call, which makes the loop's calls and stops at the same error (Note [A step's ops in one call] in
        ``gpumem/_native/op_table.h``)."""
        if self._run_ops_native is not None:
            try:
                self._run_ops_native(tpl.kinds, tpl.op_ids(t), tpl.sizes(t), self.ptrs)
            except OutOfMemoryError as exc:
                self._stop(exc)
            return
        self._run_ops(tpl.kinds.tolist(), tpl.op_ids(t).tolist(), tpl.sizes(t).tolist())

    def _run_ops(self, kinds: list[int], ids: list[int], sizes: list[int]) -> None:
        if self.gpu is not None:
            for k, i, n in zip(kinds, ids, sizes):
                if k == 0:
                    self.alloc(i, n)
                    if self.error is not None:
                        return
                else:
                    self.free(i)
            return
        ptrs, allocate, free = self.ptrs, self._allocate, self._free
        for k, i, n in zip(kinds, ids, sizes):
            if k == 0:
                if not n:
                    ptrs[i] = 0
                    continue
                try:
                    ptrs[i] = allocate(n, 0)
                except OutOfMemoryError as exc:
                    self._stop(exc)
                    return
            else:
                p = ptrs.pop(i, 0)
                if p:
                    free(p)

    def peak_block_allocated_nbytes(self) -> int:
        """The peak of allocated blocks (Note [Allocated as PyTorch counts it] in :mod:`.fit`): exact where every
        op was sent, else at most the small pool's bound above it (Note [The peak of blocks on the fast path])."""
        return self.allocator.snapshot_stats().peak_allocated_nbytes + self.small_skip_bound_nbytes

    @property
    def voided(self) -> bool:
        """Whether the fast result must be replaced by the full replay (never, here)."""
        return False

    @property
    def needs_prefix_trace(self) -> bool:
        """Whether the full path's replay of the prefix as a trace must be asked first: an out-of-memory error
        or retry in the prefix, unless an error stopped this sink where the trace stops too (Note [Stopped
        where the prefix trace stops too])."""
        if self.step <= PREFIX_STEP and not self.early_trouble:  # the stream stopped within the prefix
            self._check_prefix(self.step)
        if self.error is not None and self.error_step < PREFIX_STEP:
            return False
        return self.early_trouble


@dataclass
class _Step:
    """The small ops of one step: ``sig`` (kind, rounded size, for a free (steps back, position)) and the
    addresses its small allocations got."""

    sig: list[tuple[int, int, int, int]] = field(default_factory=list)
    addrs: list[int] = field(default_factory=list)
    small: Any = None
    """Made from a :class:`StepTemplate`: which of its ops are small allocations, and their rounded sizes."""
    rounded: Any = None
    made_from: Any = None
    """The :class:`StepTemplate` that ``small`` and ``rounded`` were computed from."""
    step: int = -1
    """The decode step it is (set at its end)."""


class SkippingSink(PlainSink):
    """A :class:`PlainSink` that leaves out a decode step's small ops at a fixed point of the small pool
    (Note [Small pool skipped at a fixed point])."""

    def __init__(self, allocator: Any) -> None:
        super().__init__(allocator)
        eng = _engine_of(allocator)
        self._engine = eng
        # the steps made from the template send Python ints > 0 (``tolist()``), and nothing here marks a step, so
        # the engine's public methods would only check them and find the step-plan layer off: their loops call
        # what those methods call (Note [A full step in one loop])
        direct = not eng._plan.active
        self._engine_allocate = eng._allocate_engine if direct else self._allocate
        self._engine_free = eng._free_engine if direct else self._free
        self._round = eng.policy.round
        self._small_max = eng.policy.small_max_nbytes
        self.step = 0
        self._cur = _Step()
        self._small_pos: dict[int, tuple[int, int]] = {}  # live small op id -> (step, position)
        self._history: list[tuple[_Step, Any]] = []  # the last two full steps and the state after each
        self._state_before: Any = None  # the small pool's state before the current step
        self._template: _Step | None = None
        self._templates: list[_Step] = []  # one period of steps
        self._phase = 0
        self._pending: list[tuple[int, int, int, int]] = []  # skipped in this step: (kind, op id, nbytes, addr)
        self._k = 0  # position in the template
        self._skipping = False
        self._skipped_any = False
        self._rnd = eng.policy.round_nbytes
        self._plan: Any = None
        self._plan_small_op: list[bool] | None = None
        self._pending_steps: list[int] = []  # steps skipped whole in this period (Note [Decode step template])
        self._skip_start = 0
        self._tpl: StepTemplate | None = None
        self._trouble_at_skip = 0
        self._void = False
        self.skipped_steps = 0
        """Decode steps whose small ops were left out at once (from the template's arrays)."""

    # -- the small pool's state ---------------------------------------------------------------------------
    def _small_state(self) -> tuple:
        backing = self._engine.backing
        if isinstance(backing, VirtualBacking):
            return self._small_range_state(backing)
        segs = []
        for seg in sorted(self._engine.backing.segments_list(), key=lambda s: s.base):
            if not seg.small:
                continue
            blocks = []
            b = seg.last
            while b is not None:
                blocks.append((b.addr, b.size, b.allocated, b.stream, b.fences is not None))
                b = b.prev
            segs.append((seg.base, seg.nbytes, seg.order, seg.live, seg.dirty, seg.fence, tuple(blocks)))
        return tuple(segs)

    @staticmethod
    def _small_range_state(backing: VirtualBacking) -> tuple:
        """The small pool's virtual range as it matters to its next ops (Note [Expandable's small pool
        skipped]): its blocks, top, pages (live references, chunks mapped, empty in their order, unfenced
        streams, fences, ...); the chunks held but mapped nowhere, shared by both pools."""
        seg = backing.vsegments.get(True)
        unmapped = tuple(h.handle for h in backing.unmapped)
        if seg is None:
            return (None, unmapped)
        blocks = []
        b = seg.last
        while b is not None:
            blocks.append((b.addr, b.size, b.allocated, b.stream, b.fences is not None))
            b = b.prev
        n = -(-seg.top // seg.page_nbytes)
        chunks = tuple(None if h is None else h.handle for h in seg.chunks[:n])
        return (seg.top, tuple(blocks), seg.refs[:n].tobytes(), chunks, tuple(seg.empty), tuple(seg.dirty.items()),
                repr(sorted(seg.page_fences.items())), tuple(sorted(seg.noaccess)), tuple(sorted(seg.deferred)),
                repr(seg.users), repr(seg.top_fences), unmapped)

    # -- ops -------------------------------------------------------------------------------------------------
    def _is_small(self, nbytes: int) -> bool:
        return nbytes > 0 and self._round(nbytes) <= self._small_max

    def alloc(self, op_id: int, nbytes: int) -> None:
        if self.error is not None:
            return
        if not self._is_small(nbytes):
            if self._skipping and nbytes and self._would_grow(nbytes):
                self._materialize()
            super().alloc(op_id, nbytes)
            return
        pos = len(self._cur.addrs)
        sig = (0, self._round(nbytes), 0, 0)
        if self._skipping:
            t = self._template
            if self._k < len(t.sig) and t.sig[self._k] == sig:
                addr = t.addrs[pos]
                self._k += 1
                self.ptrs[op_id] = addr
                self._pending.append((0, op_id, nbytes, addr))
                self._cur.sig.append(sig)
                self._cur.addrs.append(addr)
                self._small_pos[op_id] = (self.step, pos)
                self.skipped_ops += 1
                return
            self._materialize()
        super().alloc(op_id, nbytes)
        if self.error is None:
            self._cur.sig.append(sig)
            self._cur.addrs.append(self.ptrs[op_id])
            self._small_pos[op_id] = (self.step, pos)

    def free(self, op_id: int) -> None:
        if self.error is not None:
            return
        where = self._small_pos.pop(op_id, None)
        if where is None:  # a large block (or a zero-byte one)
            super().free(op_id)
            return
        sig = (1, 0, self.step - where[0], where[1])
        if self._skipping:
            t = self._template
            if self._k < len(t.sig) and t.sig[self._k] == sig:
                self._k += 1
                self._pending.append((1, op_id, 0, self.ptrs.pop(op_id)))
                self._cur.sig.append(sig)
                self.skipped_ops += 1
                return
            self._materialize()
        self._cur.sig.append(sig)
        super().free(op_id)

    def run_step(self, t: int, tpl: "StepTemplate") -> None:
        if self.error is not None:
            return
        if self._tpl is not tpl:
            self._tpl = tpl
            if self._skipping:
                self._make_plan(tpl)
        if self._skipping and self._k == 0 and self._fast_ok(tpl, t):
            self._skip_step(t, tpl)
            return
        sizes = tpl.sizes(t)
        rounded, small = self._masks(tpl, t)
        kinds, ids, ns = tpl.kinds.tolist(), tpl.op_ids(t).tolist(), sizes.tolist()
        q = 0
        while self._skipping and q < len(kinds):  # a step that leaves the period: one op at a time while skipping
            if self.error is not None:
                return
            if kinds[q] == 0:
                self.alloc(ids[q], ns[q])
            else:
                self.free(ids[q])
            q += 1
        if self._skipping or self.error is not None:
            return
        self._run_full_step(kinds[q:], ids[q:], ns[q:], rounded[q:].tolist(), small[q:].tolist())
        if self.error is None:
            self._cur.small = small
            self._cur.rounded = rounded
            self._cur.made_from = tpl

    # Note [A full step in one loop]
    #     A step the small pool is not skipped in (the steps that look for a fixed point, about one in ten at
    #     batch 1, and every step at the batches ``gpumem fit`` probes, whose small requests never repeat) sent
    #     each op through :meth:`alloc` and :meth:`free`, which round the size again, ask whether the step is
    #     skipped and go through :class:`PlainSink`'s methods: a third of the op's time. A step made from the
    #     template has its rounded sizes and small-allocation mask as arrays already (:meth:`_masks`), so
    #     :meth:`_run_full_step` sends its ops in one loop and notes the small ones (signature, address, where
    #     each live one was made) exactly as :meth:`alloc` and :meth:`free` do: no skipping can start or end
    #     within the step (:meth:`end_step` decides that), so those two reduce to their not-skipping branches.
    #     This loop and :meth:`_skip_step`'s call the engine's own allocation and free (``_allocate_engine``,
    #     ``_free_engine``): the public methods would find Python ints above 0 (``tolist()``) and the step-plan
    #     layer off (nothing marks a step here), and call those. ``tests/estimate/test_fast_replay.py`` checks
    #     the figures against the full replay.
    def _run_full_step(self, kinds: list[int], ids: list[int], sizes: list[int], rounded: list[int],
                       small: list[bool]) -> None:
        """A whole step made from the template, with nothing skipped: every op sent, the small ones noted as
        :meth:`alloc` and :meth:`free` note them (Note [A full step in one loop])."""
        ptrs, allocate, free = self.ptrs, self._engine_allocate, self._engine_free
        cur, where, step = self._cur, self._small_pos, self.step
        sig, addrs = cur.sig, cur.addrs
        for k, i, n, r, s in zip(kinds, ids, sizes, rounded, small):
            if k == 0:
                if not n:
                    ptrs[i] = 0
                    continue
                try:
                    p = ptrs[i] = allocate(n, 0)
                except OutOfMemoryError as exc:
                    self._stop(exc)
                    return
                if s:
                    where[i] = (step, len(addrs))
                    sig.append((0, r, 0, 0))
                    addrs.append(p)
            else:
                w = where.pop(i, None)
                if w is not None:
                    sig.append((1, 0, step - w[0], w[1]))
                p = ptrs.pop(i, 0)
                if p:
                    free(p)

    def _masks(self, tpl: "StepTemplate", t: int) -> tuple[np.ndarray, np.ndarray]:
        """The rounded size of each op of step ``t`` and which are small allocations."""
        sizes = tpl.sizes(t)
        rounded = -(-sizes // self._rnd) * self._rnd
        return rounded, (tpl.kinds == 0) & (sizes > 0) & (rounded <= self._small_max)

    def _fast_ok(self, tpl: "StepTemplate", t: int) -> bool:
        """Whether step ``t``'s small requests are the template step's (Note [Decode step template]): the same
        small-allocation mask and the same rounded sizes under it. Only the ops whose size grows are compared
        (:attr:`StepTemplate.growing`): the others ask for the same bytes at every step of the template, so
        their rounded sizes and masks are the template step's whenever those were computed from ``tpl``."""
        ts = self._template
        if ts.small is None or ts.made_from is not tpl or self._plan is None or self._plan[0] is not tpl:
            return False
        g = tpl.growing
        sizes = tpl.base[g] + (t - tpl.s0) * tpl.slope[g]
        rounded = -(-sizes // self._rnd) * self._rnd
        small = (tpl.kinds[g] == 0) & (sizes > 0) & (rounded <= self._small_max)
        return bool(np.array_equal(small, ts.small[g]) and np.array_equal(rounded[small], ts.rounded[g][small]))

    def _make_plan(self, tpl: "StepTemplate") -> None:
        """What a skipped step does, when every step of the period has one small mask."""
        self._plan = None
        for x in self._templates:
            if x.small is None and x.step >= tpl.s0:
                # a step the emitter made (Note [Decode step template]): its ops are the template's at that step
                x.rounded, x.small = self._masks(tpl, x.step)
                x.made_from = tpl
        masks = [x.small for x in self._templates]
        if any(m is None for m in masks) or any(not np.array_equal(m, masks[0]) for m in masks[1:]):
            return
        m = masks[0]
        alloc_pos = np.flatnonzero(tpl.kinds == 0)
        small_j = m[alloc_pos]  # by alloc index
        smallpos = np.cumsum(small_j) - 1
        is_free = tpl.kinds == 1
        small_op = m | (is_free & small_j[tpl.index])
        large = np.flatnonzero(~small_op).tolist()
        freed_here = set(tpl.index[is_free & (tpl.back == 0)].tolist())
        cross = [(j, int(smallpos[j])) for j in np.flatnonzero(small_j).tolist() if j not in freed_here]
        old = [(int(b), int(j)) for b, j in zip(tpl.back[is_free & small_j[tpl.index] & (tpl.back > 0)].tolist(),
                                                  tpl.index[is_free & small_j[tpl.index] & (tpl.back > 0)].tolist())]
        order = [(int(k), int(j), int(b), int(smallpos[j]))
                 for k, j, b in zip(tpl.kinds[small_op].tolist(), tpl.index[small_op].tolist(),
                                    tpl.back[small_op].tolist())]
        lg = np.array(large, np.int64)
        # the large ops' ids and sizes at step t: large_id0 + t * n_allocs, large_base + (t - s0) * large_slope
        large_id0 = tpl.first_id - (tpl.back[lg] + tpl.s0) * tpl.n_allocs + tpl.index[lg]
        self._plan = (tpl, large, cross, old, order, int(small_op.sum()),
                      (tpl.kinds[lg].tolist(), large_id0, tpl.base[lg], tpl.slope[lg]))
        self._plan_small_op = small_op.tolist()

    def _skip_step(self, t: int, tpl: "StepTemplate") -> None:
        """Step ``t`` with its small ops left out (its large ones all sent, in order)."""
        _, large, cross, old, _, n_small, (kinds, large_id0, large_base, large_slope) = self._plan
        ids = (large_id0 + t * tpl.n_allocs).tolist()  # tpl.op_ids(t)[large], tpl.sizes(t)[large]
        sizes = (large_base + (t - tpl.s0) * large_slope).tolist()
        ptrs, allocate, free = self.ptrs, self._engine_allocate, self._engine_free
        would_grow = self._would_grow if self._engine.limit_nbytes is not None else None  # None: never grows
        for q, (k, i, n) in enumerate(zip(kinds, ids, sizes)):
            if k == 0:
                if not n:
                    ptrs[i] = 0
                elif would_grow is not None and would_grow(n):  # growth ahead: the rest of the step one op at a time
                    self._leave_skip_mid_step(t, tpl, large[q], tpl.op_ids(t).tolist(), tpl.sizes(t).tolist())
                    return
                else:
                    ptrs[i] = allocate(n, 0)
            else:
                p = ptrs.pop(i, 0)
                if p:
                    free(p)
        ptrs, where = self.ptrs, self._small_pos
        for back, j in old:
            op = tpl.alloc_id(t - back, j)
            ptrs.pop(op, None)
            where.pop(op, None)
        addrs = self._template.addrs
        for j, pos in cross:
            op = tpl.alloc_id(t, j)
            ptrs[op] = addrs[pos]
            where[op] = (t, pos)
        self._pending_steps.append(t)
        self._k = len(self._template.sig)
        self.skipped_ops += n_small
        self.skipped_steps += 1

    def _leave_skip_mid_step(self, t: int, tpl: "StepTemplate", at: int, ids: list[int], sizes: list[int]) -> None:
        """Stop skipping in step ``t`` before its op ``at`` (a large allocation that grows): the steps skipped in
        this period are sent, then this step's small ops before ``at`` (its large ones were sent), then every op
        from ``at`` on, one by one."""
        self._materialize()
        kinds = tpl.kinds.tolist()
        small_op = self._plan_small_op if self._plan_small_op is not None else None
        for q in range(len(kinds)):
            if self.error is not None:
                return
            if q < at and not small_op[q]:
                continue
            if kinds[q] == 0:
                self.alloc(ids[q], sizes[q])
            else:
                self.free(ids[q])

    def _addr_of(self, u: int, pos: int) -> int:
        """The template address of the small allocation ``pos`` of step ``u`` (a skipped step or one of the
        template's)."""
        return self._templates[(u - self._skip_start) % len(self._templates)].addrs[pos]

    def _would_grow(self, nbytes: int) -> bool:
        """Whether a large request of ``nbytes`` finds no cached block and its new segment would pass the limit:
        the allocator would run out of memory and release cached segments of both pools, so the small pool must
        first be as the full replay has it (Note [Small pool skipped at a fixed point])."""
        eng = self._engine
        if eng.limit_nbytes is None:
            return False  # no limit: growth runs out of memory only where the device refuses (the result is void)
        size = self._round(nbytes)
        backing = eng.backing
        if isinstance(backing, VirtualBacking):
            # Note [Expandable's small pool skipped]: a large block touches at most size / page + 1 pages,
            # each mapped anew at worst; past the limit (or the range's top), the rest one op at a time
            page = backing.page_nbytes[False]
            return backing.reserved_nbytes + (-(-size // page) + 1) * page > eng.limit_nbytes
        fl = eng._free_lists.get((False, 0))
        if fl is not None and fl.best_fit(size) is not None:
            return False
        return backing.reserved_nbytes + eng.policy.segment_nbytes(False, size, backing.granularity) > eng.limit_nbytes

    def _trouble(self) -> int:
        st = self._engine._stats
        return st.num_alloc_retries + st.num_ooms

    def _materialize(self) -> None:
        """Send the small ops skipped in this period, in order, each where the template put it; stop skipping."""
        if self._pending_steps:
            tpl, _, _, _, order, _, _ = self._plan
            alloc_pos = np.flatnonzero(tpl.kinds == 0)
            allocate, free = self._engine_allocate, self._engine_free  # Python ints > 0 (Note [A full step in one loop])
            for t in self._pending_steps:
                sizes = tpl.sizes(t)[alloc_pos].tolist()  # by allocation index
                # the template addresses of step t's allocations and of the step before's (a free reaches back
                # one step at most: build_template); _addr_of(t - back, pos) is addrs[back][pos]
                addrs = (self._templates[(t - self._skip_start) % len(self._templates)].addrs,
                         self._templates[(t - 1 - self._skip_start) % len(self._templates)].addrs)
                for kind, j, back, pos in order:
                    if kind == 0:
                        addr = addrs[0][pos]
                        got = allocate(sizes[j], 0)
                        if got != addr:
                            raise InternalError(f"fast replay: a small allocation replayed late landed at {got:#x}, "
                                                f"not at its template's {addr:#x} (Note [Small pool skipped at a "
                                                "fixed point])")
                    else:
                        free(addrs[back][pos])
        self._pending_steps.clear()
        if self._trouble() != self._trouble_at_skip:
            self._void = True  # a retry or an out-of-memory error while skipping (not foreseen)
        for kind, op_id, nbytes, addr in self._pending:
            if kind == 0:
                got = self._allocate(nbytes, 0)
                if got != addr:
                    raise InternalError(f"fast replay: a small allocation of {nbytes} B replayed late landed at "
                                        f"{got:#x}, not at its template's {addr:#x} (Note [Small pool skipped at a "
                                        "fixed point])")
            else:
                self._free(addr)
        self._pending.clear()
        self._skipping = False
        self._template = None
        self._history.clear()

    def end_step(self, step: int) -> None:
        if self.error is not None:
            return
        self._check_prefix(step)
        cur = self._cur
        cur.step = step
        if self._skipping:
            if self._k != len(self._template.sig):  # the step made fewer small ops than the template
                self._materialize()
            else:
                self._k = 0
                self._phase = (self._phase + 1) % len(self._templates)
                self._template = self._templates[self._phase]
                if self._phase == 0:  # a whole period skipped: the small pool's state is the template's again
                    self._pending.clear()
                    self._pending_steps.clear()
        if not self._skipping:
            state = self._small_state()
            if step >= 1:
                self._history.append((cur, self._state_before, state))
                del self._history[:-MAX_PERIOD - 1]
                self._try_template()
            self._state_before = state
        self.step = step + 1
        self._cur = _Step()

    def _try_template(self) -> None:
        """Start skipping when the last ``P`` full steps leave the small pool as they found it and the step
        before them made the small ops of the last and got its addresses (``P`` = 1 .. :data:`MAX_PERIOD`; no
        free reaches further back than the step before): Note [Small pool skipped at a fixed point]."""
        h = self._history
        if self._engine._stats.num_alloc_retries:
            return
        for period in range(1, MAX_PERIOD + 1):
            if len(h) < period + 1:
                break
            b = h[-period:]
            before = h[-period - 1][0]  # the step before the period: its allocations are what b's first frees free
            if b[0][1] == b[-1][2] and before.sig == b[-1][0].sig and before.addrs == b[-1][0].addrs \
                    and all(sig[2] <= 1 for x in b for sig in x[0].sig):
                self._templates = [x[0] for x in b]
                extra = _kept_remainder_nbytes(self._engine.policy.min_split_small_nbytes, self._rnd)
                self.small_skip_bound_nbytes = max(
                    self.small_skip_bound_nbytes,
                    *(_sig_small_bound_nbytes(x.sig, self._templates[i - 1].sig, extra)
                      for i, x in enumerate(self._templates)))
                self._phase = 0
                self._skip_start = self.step + 1
                self._plan = None
                if self._tpl is not None:
                    self._make_plan(self._tpl)
                self._template = self._templates[0]
                self._skipping = True
                self._skipped_any = True
                self._trouble_at_skip = self._trouble()
                self._k = 0
                return

    def finish(self) -> None:
        """The stream is over (its last ops are the end of generate(), never skipped as a step)."""
        if self._skipping and self.error is None:
            self._materialize()

    @property
    def voided(self) -> bool:
        """Also void: an out-of-memory error or retry while small ops were left out (the retry gives back cached
        segments of the small pool, whose state mid-step is not the fixed point's)."""
        if self._skipping and self._trouble() != self._trouble_at_skip:
            self._void = True
        return self._void



# Note [The small pool skipped on the native engine]
#     On the native engine (Note [The fast path on the native engine] in :mod:`.fit`) the skip of Note [Small pool
#     skipped at a fixed point] is made over whole steps made from the template (Note [Decode step template]):
#     :class:`NativeSkippingSink` sends a step it does not skip in one ``run_ops`` call, reads the address each
#     allocation got from its ``PtrTable``'s log (Note [The pointers a run got] in ``gpumem/_native/op_table.h``)
#     and the small pool's state at the step's end from the engine as bytes (Note [The small pool's state as
#     bytes] in ``gpumem/_native/engine.cpp``), compared exactly. It starts skipping under the Note's conditions:
#     the last ``P`` full steps (1 to :data:`MAX_PERIOD`) left that state as they found it; they and the step
#     before them have one small-allocation mask (so the same small frees too: a template's free reaches one step
#     back at most); the step before made the last one's small requests and got its addresses. A step ``t`` then
#     stands for the period's step ``s`` of its phase while its small requests are ``s``'s: sizes only grow, so
#     that holds up to the last step at which every growing small op still fits its rounded size in ``s``
#     (:meth:`NativeSkippingSink._last_step_alike`, computed when the skip starts); a step whose next one asks for other
#     small sizes, or among fewer than three that ask for the same, cannot end a period worth skipping and is sent
#     as a plain sink sends it, nothing noted (at the batches ``gpumem fit`` probes, nearly every step). A skipped
#     step sends its large
#     ops in one call and books its small blocks that outlive it at the period's addresses; leaving the skip sends
#     the small ops skipped in the current period in one call and checks every address against the period's
#     (:class:`~gpumem.errors.InternalError` otherwise). The argument holds on this engine because it is a port of
#     the Python one that makes the same decisions from the same state (``tests/allocator/test_native_differential.py``,
#     segment policies and ``expandable``'s pages of a pool's own size included): its pools share what the Python
#     engine's share and nothing more, and the bytes compared hold everything the small pool's next ops read
#     (``tests/allocator/test_native_small_pool_state.py`` holds two states it calls equal equal for the Python
#     reading too). The large ops of a skipped step go in one call that stops before each allocation its fast path
#     cannot serve (Note [Stopping before a slow allocation] in ``gpumem/_native/module.cpp``): there, as the Python
#     sink asks before a large allocation that finds no cached block, the sink asks whether it could grow past the
#     limit (reserved bytes plus a new segment of ``segment_nbytes``, or its block's pages all mapped anew); if so
#     the skip ends there (:meth:`NativeSkippingSink._leave_skip_mid_step`), else that one op is sent and the call
#     goes on. Any other retry or error while skipping voids the fast result, as there. Ops the emitter makes (the
#     first steps, the end of ``generate()``, a shape with a sliding window) are sent one by one, a skip ended first.
@dataclass
class _FullStep:
    """A step made from a template and sent whole (Note [The small pool skipped on the native engine])."""

    step: int
    tpl: "StepTemplate"
    small: np.ndarray
    """By op: whether it is an allocation of the small pool."""
    rounded: np.ndarray
    """By op: the rounded bytes it asks for (0 for frees)."""
    addrs: np.ndarray
    """The addresses the step's small allocations got, in order (uint64)."""


@dataclass(frozen=True)
class _NativePlan:
    """What a skipped step sends and books, from one template and small-allocation mask."""

    tpl: "StepTemplate"
    large_pos: np.ndarray    # the large ops (and zero-byte allocations): their places in the step, kinds, ids at
    large_kinds: np.ndarray  # step 0, bytes as base + slope
    large_id0: np.ndarray
    large_base: np.ndarray
    large_slope: np.ndarray
    cross_j: list          # small allocations not freed in their step: alloc index, small position
    cross_pos: list
    old_j: list            # small allocations of the step before freed in this one: alloc index
    order: np.ndarray      # the small ops' positions, in order
    n_small: int


class NativeSkippingSink(PlainSink):
    """A :class:`PlainSink` over the native engine that leaves out whole decode steps' small ops at a fixed point of
    the small pool (Note [The small pool skipped on the native engine])."""

    def __init__(self, allocator: Any) -> None:
        super().__init__(allocator)
        if self._run_ops_native is None:
            raise InternalError("NativeSkippingSink needs the native engine's run_ops (can_skip_small_pool)")
        eng = _engine_of(allocator)
        self._ext = eng._ext
        pol = allocator.policy
        self._rnd = pol.round_nbytes
        self._small_max = pol.small_max_nbytes
        self._limit = allocator.limit_nbytes
        self._segments = not eng.uses_vmm
        self._rule = pol.segment_rule
        self._granularity = allocator.device.granularity_nbytes
        self._page = None if self._segments else pool_page_nbytes(allocator.device, pol)[False]
        self._hist: list[tuple[_FullStep, bytes | None, bytes]] = []  # consecutive full steps, state before, after
        self._state_before: bytes | None = None
        self._cur: _FullStep | None = None
        self._skipping = False
        self._period: list[_FullStep] = []
        self._phase = 0
        self._skip_start = 0
        self._skipped_in_skip = False
        self._pending_steps: list[int] = []  # steps skipped in this period
        self._plan: _NativePlan | None = None
        self._plan_mask: np.ndarray | None = None
        self._last_alike: list[int] = []  # by phase: the last step _skip_ok may skip (_last_step_alike)
        self._cross_addrs: list[list[int]] = []  # by phase: the addresses its small blocks that outlive it got
        self._blk: tuple[Any, int, list[bool]] | None = None  # (template, first step, changes): _worth_noting
        self._retried = False  # an out-of-memory retry was seen: no skip starts any more
        self._alloc_pos: tuple[Any, np.ndarray] | None = None
        self._trouble_at_skip = 0
        self._void = False
        self.skipped_steps = 0
        """Decode steps whose small ops were left out."""
        self.skips_started = 0
        """Fixed points found (skips started)."""
        self.limit_stops = 0
        """Skips ended before a large allocation that could have grown past the limit."""

    def _trouble(self) -> int:
        st = self._ext.stats()
        return st["num_alloc_retries"] + st["num_ooms"]

    # -- ops the emitter makes: sent one by one, after a skip ends ---------------------------------------------
    def alloc(self, op_id: int, nbytes: int) -> None:
        if self._skipping and self.error is None:
            self._materialize()
        self._cur = None
        super().alloc(op_id, nbytes)

    def free(self, op_id: int) -> None:
        if self._skipping and self.error is None:
            self._materialize()
        self._cur = None
        super().free(op_id)

    # -- steps made from the template ---------------------------------------------------------------------------
    def run_step(self, t: int, tpl: "StepTemplate") -> None:
        if self.error is not None:
            return
        if self._skipping:
            if self._skip_ok(t, tpl):
                self._skip_step(t, tpl)
                return
            self._materialize()
        if self._retried or not self._worth_noting(t, tpl):
            # the next step asks for other small sizes, or too few steps ask for these, or a retry was seen: no
            # period can end here and be skipped after, so nothing of this step is noted (at the batches gpumem
            # fit probes, nearly every step)
            PlainSink.run_step(self, t, tpl)
            self._cur = None
            return
        self._full_step(t, tpl)

    NOTE_BLOCK = 64
    """Steps whose small sizes :meth:`_worth_noting` compares at once."""

    def _worth_noting(self, t: int, tpl: "StepTemplate") -> bool:
        """Whether step ``t`` could end a period worth skipping: it asks for the small sizes of the step after it
        and of the one before it or the one after that (the fewest for a skip: the step before a period of one
        step, the period, one step skipped). Made from the sizes of :data:`NOTE_BLOCK` steps at once: a step's
        small sizes change where an op's that is small (or asks for nothing) changes its rounded size."""
        blk = self._blk
        if blk is None or blk[0] is not tpl or not 1 <= t - blk[1] <= len(blk[2]) - 2:
            t0 = max(tpl.s0, t - 1)
            steps = np.arange(t0, t0 + self.NOTE_BLOCK + 1, dtype=np.int64)[:, None] - tpl.s0
            g = tpl.growing[tpl.kinds[tpl.growing] == 0]
            r = -(-(tpl.base[g][None, :] + steps * tpl.slope[g][None, :]) // self._rnd) * self._rnd
            changes = ((r[1:] != r[:-1]) & (r[:-1] <= self._small_max)).any(axis=1).tolist()
            blk = self._blk = (tpl, t0, changes)
        c, i = blk[2], t - blk[1]  # c[k]: step blk[1] + k + 1 asks for other small sizes than step blk[1] + k
        return not c[i] and ((i >= 1 and not c[i - 1]) or not c[i + 1])

    def _masks(self, tpl: "StepTemplate", sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rounded bytes of each op of a step asking for ``sizes``, and which are small allocations."""
        rounded = -(-sizes // self._rnd) * self._rnd
        return rounded, (tpl.kinds == 0) & (sizes > 0) & (rounded <= self._small_max)

    def _full_step(self, t: int, tpl: "StepTemplate") -> None:
        """Every op of step ``t`` in one call, the addresses its allocations got read from the table's log."""
        sizes = tpl.sizes(t)
        ptrs = self.ptrs
        ptrs.log_puts(True)
        try:
            self._run_ops_native(tpl.kinds, tpl.op_ids(t), sizes, ptrs)
        except OutOfMemoryError as exc:
            self._stop(exc)
        finally:
            log = ptrs.take_log()
            ptrs.log_puts(False)
        self._cur = None
        if self.error is not None:
            return
        if self._alloc_pos is None or self._alloc_pos[0] is not tpl:
            self._alloc_pos = (tpl, np.flatnonzero(tpl.kinds == 0))
        alloc_pos = self._alloc_pos[1]
        got = np.frombuffer(log, np.uint64)
        if len(got) != len(alloc_pos):
            raise InternalError(f"fast replay: run_ops logged {len(got)} pointers for {len(alloc_pos)} allocations")
        rounded, small = self._masks(tpl, sizes)
        self._cur = _FullStep(t, tpl, small, rounded, got[small[alloc_pos]])

    def end_step(self, step: int) -> None:
        if self.error is not None:
            return
        self._check_prefix(step)
        if self._skipping:  # the step was skipped whole
            self._phase = (self._phase + 1) % len(self._period)
            if self._phase == 0:  # a whole period: the small pool's state is the fixed point's again
                self._pending_steps.clear()
        else:
            cur = self._cur
            if cur is not None and cur.step == step:  # a step made from the template and noted (_full_step)
                state = self._ext.small_pool_state()
                self._hist.append((cur, self._state_before, state))
                del self._hist[:-MAX_PERIOD - 1]
                self._try_template()
                self._state_before = state
            else:  # made by the emitter, or not noted: the next step starts the history (read only as the
                self._hist.clear()  # step before a period, whose own state before is not compared)
                self._state_before = None
        self.step = step + 1
        self._cur = None

    def _try_template(self) -> None:
        """Start skipping when the last ``P`` full steps left the small pool's state as they found it, they and the
        step before them have one small-allocation mask, and the step before made the last one's small requests
        and got its addresses (Note [The small pool skipped on the native engine])."""
        h = self._hist
        last = h[-1][0]
        for period in range(1, MAX_PERIOD + 1):
            if len(h) < period + 1:
                break
            b = h[-period:]
            before = h[-period - 1][0]
            if b[0][1] != b[-1][2]:
                continue
            if any(x.tpl is not last.tpl or not np.array_equal(x.small, last.small)
                   for x in (before, *(y[0] for y in b))):
                continue
            if not (np.array_equal(before.rounded[before.small], last.rounded[last.small])
                    and np.array_equal(before.addrs, last.addrs)):
                continue
            if self._ext.stats()["num_alloc_retries"]:
                self._retried = True  # as the Python sink: no skip after an out-of-memory retry (it only grows)
                return
            if self._plan is None or self._plan.tpl is not last.tpl or not np.array_equal(self._plan_mask, last.small):
                self._make_plan(last.tpl, last.small)
            # the steps of the period and the one before ask for the same small sizes: one last step alike
            last_alike = [self._last_step_alike(x[0].step, x[0].tpl) for x in b]
            self._period = [x[0] for x in b]
            extra = _kept_remainder_nbytes(self.allocator.policy.min_split_small_nbytes, self._rnd)
            self.small_skip_bound_nbytes = max(
                self.small_skip_bound_nbytes,
                *(_native_small_bound_nbytes(x, self._period[i - 1], extra) for i, x in enumerate(self._period)))
            self._last_alike = last_alike
            plan = self._plan
            self._cross_addrs = [[int(x.addrs[pos]) for pos in plan.cross_pos] for x in self._period]
            self._phase = 0
            self._skip_start = self.step + 1
            self._skipping = True
            self.skips_started += 1
            self._skipped_in_skip = False
            self._pending_steps.clear()
            self._trouble_at_skip = self._trouble()
            return

    def _make_plan(self, tpl: "StepTemplate", small: np.ndarray) -> None:
        alloc_pos = np.flatnonzero(tpl.kinds == 0)
        small_j = small[alloc_pos]  # by allocation index
        smallpos = np.cumsum(small_j) - 1
        small_op = small_j[tpl.index]  # an allocation, or a free of one (of this step or the one before: same mask)
        is_free = tpl.kinds == 1
        lg = np.flatnonzero(~small_op)
        freed_here = set(tpl.index[is_free & (tpl.back == 0)].tolist())
        cross_j = [j for j in np.flatnonzero(small_j).tolist() if j not in freed_here]
        old_j = tpl.index[is_free & small_op & (tpl.back == 1)].tolist()
        self._plan = _NativePlan(
            tpl, lg, np.ascontiguousarray(tpl.kinds[lg]),
            tpl.first_id - (tpl.back[lg] + tpl.s0) * tpl.n_allocs + tpl.index[lg], tpl.base[lg], tpl.slope[lg],
            cross_j, [int(smallpos[j]) for j in cross_j], old_j, np.flatnonzero(small_op), int(small_op.sum()))
        self._plan_mask = small

    def _could_grow_past_limit(self, nbytes: int) -> bool:
        """Whether a large request of ``nbytes`` that the fast path does not serve could grow past the limit: a new
        segment of ``segment_nbytes``, or its block's pages all mapped anew (Note [Expandable's small pool
        skipped]); the out-of-memory retry that would follow releases cached small segments too."""
        if self._limit is None:
            return False  # growth runs out of memory only where the device refuses (the result is void then)
        r = -(-nbytes // self._rnd) * self._rnd
        if self._page is not None:
            grow = (-(-r // self._page) + 1) * self._page
        elif self._rule is SegmentRule.EXACT:
            grow = r
        elif self._rule is SegmentRule.PYTORCH:
            grow = 20 * 2**20 if r < 10 * 2**20 else -(-r // (2 * 2**20)) * (2 * 2**20)
        else:
            grow = -(-r // self._granularity) * self._granularity
        return self._ext.reserved_nbytes() + grow > self._limit

    def _last_step_alike(self, t: int, tpl: "StepTemplate") -> int:
        """The last step whose small requests are those of step ``t``, given that each op asks for more bytes from
        step to step or the same (a template's slopes are not negative): an op whose size grows and that is small
        at ``t`` keeps its rounded size while its bytes stay within it; a large one stays large (Note [Decode step
        template]). Only the ops whose size grows can differ (:attr:`StepTemplate.growing`)."""
        g = tpl.growing
        sizes = tpl.base[g] + (t - tpl.s0) * tpl.slope[g]
        r = -(-sizes // self._rnd) * self._rnd
        watch = (tpl.kinds[g] == 0) & (r <= self._small_max)
        if not watch.any():
            return 1 << 62
        return int((tpl.s0 + (r[watch] - tpl.base[g][watch]) // tpl.slope[g][watch]).min())

    def _skip_ok(self, t: int, tpl: "StepTemplate") -> bool:
        """Whether step ``t`` makes the small requests of the period's step it stands for (:meth:`_last_step_alike`)."""
        plan = self._plan
        ts = self._period[self._phase]
        return not (plan is None or plan.tpl is not tpl or ts.tpl is not tpl or t <= ts.step
                    or t > self._last_alike[self._phase])

    def _skip_step(self, t: int, tpl: "StepTemplate") -> None:
        """Step ``t`` with its small ops left out: its large ones sent in one call, stopped before each that the fast
        path does not serve (Note [Stopping before a slow allocation] in ``gpumem/_native/module.cpp``) to ask
        whether it could grow past the limit (then the skip ends there: :meth:`_leave_skip_mid_step`); its small
        allocations that outlive it booked at the period's addresses."""
        plan = self._plan
        ptrs, run_ops = self.ptrs, self._run_ops_native
        kinds = plan.large_kinds
        ids = plan.large_id0 + t * tpl.n_allocs
        sizes = plan.large_base + (t - tpl.s0) * plan.large_slope
        q, n = 0, len(kinds)
        try:
            while q < n:
                q += run_ops(kinds[q:], ids[q:], sizes[q:], ptrs, stop_at_slow=True)
                if q == n:
                    break
                if self._could_grow_past_limit(int(sizes[q])):
                    self.limit_stops += 1
                    self._leave_skip_mid_step(t, tpl, int(plan.large_pos[q]))
                    return
                q += run_ops(kinds[q:q + 1], ids[q:q + 1], sizes[q:q + 1], ptrs)
        except OutOfMemoryError as exc:
            self._stop(exc)  # not foreseen (a device that refused within the limit): the fast result is void
            return
        first = tpl.first_id + (t - tpl.s0) * tpl.n_allocs
        for j, addr in zip(plan.cross_j, self._cross_addrs[self._phase]):
            ptrs[first + j] = addr
        before = first - tpl.n_allocs
        for j in plan.old_j:
            ptrs.pop(before + j, 0)
        self._pending_steps.append(t)
        self._skipped_in_skip = True
        self.skipped_ops += plan.n_small
        self.skipped_steps += 1

    def _leave_skip_mid_step(self, t: int, tpl: "StepTemplate", at: int) -> None:
        """End the skip in step ``t`` before its op ``at`` (a large allocation that could grow past the limit; the
        large ops before it were sent): the small ops skipped in this period are sent, then this step's small ops
        before ``at`` (they and the large ones sent meet in no pool), then every op from ``at`` on, in order."""
        self._materialize()
        plan = self._plan
        sel = np.concatenate([plan.order[plan.order < at], np.arange(at, len(tpl.kinds))])
        self._cur = None
        try:
            self._run_ops_native(np.ascontiguousarray(tpl.kinds[sel]), tpl.op_ids(t)[sel], tpl.sizes(t)[sel],
                                 self.ptrs)
        except OutOfMemoryError as exc:
            self._stop(exc)

    def _materialize(self) -> None:
        """Send the small ops skipped in this period, in order, each checked to land where the period put it; stop
        skipping."""
        if self._pending_steps:
            plan = self._plan
            tpl = plan.tpl
            P = len(self._period)
            order = plan.order
            kinds = np.ascontiguousarray(tpl.kinds[order])
            ids = np.concatenate([tpl.op_ids(t)[order] for t in self._pending_steps])
            sizes = np.concatenate([tpl.sizes(t)[order] for t in self._pending_steps])
            want = np.concatenate([self._period[(t - self._skip_start) % P].addrs for t in self._pending_steps])
            table = native_module().PtrTable()
            t0 = self._pending_steps[0]
            prev = self._period[(t0 - 1 - self._skip_start) % P].addrs.tolist()
            smallpos = np.cumsum(self._plan_mask[np.flatnonzero(tpl.kinds == 0)]) - 1
            first_prev = tpl.first_id + (t0 - 1 - tpl.s0) * tpl.n_allocs
            for j in plan.old_j:  # what the first step frees of the step before it: at the period's addresses
                table[first_prev + j] = prev[int(smallpos[j])]
            table.log_puts(True)
            try:
                self._run_ops_native(np.tile(kinds, len(self._pending_steps)), ids, sizes, table)
            except OutOfMemoryError as exc:
                raise InternalError("fast replay: the small ops of a skipped step ran out of memory when sent late "
                                    "(Note [Small pool skipped at a fixed point])") from exc
            got = np.frombuffer(table.take_log(), np.uint64)
            if len(table) != len(plan.cross_j):  # a free found nothing to free: the ops were not the period's
                raise InternalError(f"fast replay: {len(table)} small blocks left by the steps sent late, not "
                                    f"{len(plan.cross_j)} (Note [Small pool skipped at a fixed point])")
            if len(got) != len(want):
                raise InternalError(f"fast replay: {len(got)} small allocations replayed late, not {len(want)} (Note "
                                    "[Small pool skipped at a fixed point])")
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                raise InternalError(f"fast replay: a small allocation replayed late landed at {int(got[bad]):#x}, "
                                    f"not at its template's {int(want[bad]):#x} (Note [Small pool skipped at a "
                                    "fixed point])")
        self._pending_steps.clear()
        if self._trouble() != self._trouble_at_skip:
            self._void = True  # a retry or an out-of-memory error while skipping (not foreseen)
        self._skipping = False
        if self._skipped_in_skip:  # the steps noted are no longer the last full ones
            self._hist.clear()
            self._state_before = None
        self._skipped_in_skip = False

    def finish(self) -> None:
        """The stream is over."""
        if self._skipping and self.error is None:
            self._materialize()

    @property
    def voided(self) -> bool:
        """Void: an out-of-memory error or retry while small ops were left out."""
        if self._skipping and self._trouble() != self._trouble_at_skip:
            self._void = True
        return self._void


# Note [The peak of blocks on the fast path]
#     ``torch.cuda.max_memory_allocated`` counts blocks (Note [Allocated as PyTorch counts it] in :mod:`.fit`), and a
#     long decode under PyTorch's allocator went 0.16 % above the trace's peak of requests
#     (``reports/hil/long-decode-p4096-h200-2026-11-29.md``, run 4): the KV caches' large blocks keep remainders
#     of up to 1 MiB. The replay's allocator counts blocks, but a sink that leaves out small ops (Notes [Small pool
#     skipped at a fixed point], [The small pool skipped on the native engine]) leaves their blocks out of its
#     count. Its large ops are all sent and land as in the full replay, so at any moment of a skipped step the
#     allocator counts at least the large blocks the full replay holds, and the small blocks that replay holds
#     there are at most those of the step before the skipped one that it frees, plus the highest running sum of
#     the step's own small allocations less its own small frees: the period's steps give both, since a skipped
#     step asks for its phase's small sizes (a block larger than its rounded request by at most the largest
#     multiple of ``round_nbytes`` below ``min_split_small_nbytes``, 0 under ``pytorch``). The allocator's peak
#     plus the largest such bound is therefore at or above the full replay's peak of blocks, and equal to it where
#     nothing was skipped; small ops sent late only count more. The bound is loose: the step's small running peak comes at its end (the logits' float
#     temporaries, up to 1 MiB each at large vocabularies) while the full replay's peak of blocks comes mid-step, so
#     it adds up to that running peak: 0.6 MB on the 7B decode at batch 1, 1.5 MiB on a Llama-3.2-1B shape, 6.4
#     MiB on the 3B accuracy row at batch 135 (the accuracy rows' allocated errors rise by up to 0.45 points, none
#     past +3 %). Exact would need the large pool's count at each op of a skipped step, paired with the small one.
def _kept_remainder_nbytes(min_split_nbytes: int, round_nbytes: int) -> int:
    """The largest remainder a small block keeps unsplit: a multiple of the rounding below ``min_split_nbytes``."""
    return max(0, -(-min_split_nbytes // round_nbytes) * round_nbytes - round_nbytes)


def _sig_small_bound_nbytes(sig: "list[tuple[int, int, int, int]]", prev: "list[tuple[int, int, int, int]]",
                            extra: int) -> int:
    """Note [The peak of blocks on the fast path] for a step of the Python sink: ``sig`` its small ops (kind,
    rounded bytes, steps back, position), ``prev`` those of the step before it."""
    prev_alloc = [r for k, r, _, _ in prev if k == 0]
    own = [r for k, r, _, _ in sig if k == 0]
    held = sum(prev_alloc[pos] + extra for k, _, back, pos in sig if k == 1 and back == 1)
    run = peak = 0
    for k, r, back, pos in sig:
        if k == 0:
            run += r + extra
            peak = max(peak, run)
        elif back == 0:
            run -= own[pos] + extra
    return held + peak


def _native_small_bound_nbytes(step: "_FullStep", prev: "_FullStep", extra: int) -> int:
    """Note [The peak of blocks on the fast path] for a step of the native sink (``prev``: the step before it)."""
    tpl = step.tpl
    alloc_pos = np.flatnonzero(tpl.kinds == 0)
    small_j, rounded_j = step.small[alloc_pos], step.rounded[alloc_pos] + extra
    is_free = tpl.kinds == 1
    delta = np.where(step.small, step.rounded + extra, 0).astype(np.int64)
    own = is_free & (tpl.back == 0) & small_j[tpl.index]
    delta[own] = -rounded_j[tpl.index[own]]
    prev_pos = np.flatnonzero(prev.tpl.kinds == 0)
    prev_small, prev_rounded = prev.small[prev_pos], prev.rounded[prev_pos] + extra
    old = is_free & (tpl.back == 1) & prev_small[tpl.index]
    held = int(prev_rounded[tpl.index[old]].sum())
    return held + max(0, int(np.cumsum(delta).max(initial=0)))


class SinkGroup:
    """Hands each op to every sink (Note [One stream, every policy]); raises :class:`AllStopped` once every
    sink has stopped."""

    def __init__(self, sinks: "list[PlainSink]") -> None:
        self.sinks = sinks

    def _check(self) -> None:
        if all(s.error is not None for s in self.sinks):
            raise AllStopped

    def alloc(self, op_id: int, nbytes: int) -> None:
        for s in self.sinks:
            s.alloc(op_id, nbytes)
        if nbytes and any(s.error is not None for s in self.sinks):
            self._check()

    def free(self, op_id: int) -> None:
        for s in self.sinks:
            s.free(op_id)

    def end_step(self, step: int) -> None:
        for s in self.sinks:
            s.end_step(step)


# -- Note [Decode step template] -------------------------------------------------------------------------------

TEMPLATE_STEPS = (2, 3, 4)
"""The decode steps whose ops, made by the emitter, give the template (step 1 frees the prefill's tensors)."""


@dataclass(frozen=True)
class StepTemplate:
    """The ops of decode step ``t`` as arrays (Note [Decode step template]): ``kinds`` (0 alloc, 1 free),
    ``index`` (an alloc's place among the step's allocations; a free's alloc's), ``back`` (a free: how many
    steps before it its allocation was made), sizes ``base + (t - s0) * slope``, op ids ``first_id +
    (t - s0) * n_allocs + index`` (a free: of step ``t - back``)."""

    kinds: np.ndarray
    index: np.ndarray
    back: np.ndarray
    base: np.ndarray
    slope: np.ndarray
    s0: int
    first_id: int
    n_allocs: int
    growing: np.ndarray = field(init=False, repr=False, compare=False)
    """The positions of the ops whose size grows from step to step (``slope > 0``)."""
    id0: np.ndarray = field(init=False, repr=False, compare=False)
    """The op ids of a step 0 of this template: step ``t``'s are ``id0 + t * n_allocs`` (:meth:`op_ids` in one
    numpy operation, not four: it runs once per step and sink)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "growing", np.flatnonzero(self.slope != 0))
        object.__setattr__(self, "id0", self.first_id - (self.back + self.s0) * self.n_allocs + self.index)

    def sizes(self, t: int) -> np.ndarray:
        """The bytes each op of step ``t`` asks for (0 for frees)."""
        return self.base + (t - self.s0) * self.slope

    def op_ids(self, t: int) -> np.ndarray:
        """The op id each op of step ``t`` names."""
        return self.id0 + t * self.n_allocs

    def alloc_id(self, t: int, j: int) -> int:
        return self.first_id + (t - self.s0) * self.n_allocs + j


def build_template(records: "dict[int, list[tuple[int, int, int]]]") -> "StepTemplate | None":
    """The template from the ops of decode steps 1 .. 4 (``(kind, op id, nbytes)`` each), or None when steps 2,
    3 and 4 are not one structure with sizes affine in the step (then nothing is jumped)."""
    if any(s not in records for s in (1, *TEMPLATE_STEPS)):
        return None
    where: dict[int, tuple[int, int]] = {}
    first: dict[int, int] = {}
    for s in (1, *TEMPLATE_STEPS):
        allocs = [op for k, op, _ in records[s] if k == 0]
        if not allocs or allocs != list(range(allocs[0], allocs[0] + len(allocs))):
            return None
        first[s] = allocs[0]
        for j, op in enumerate(allocs):
            where[op] = (s, j)
    rows = []
    for s in TEMPLATE_STEPS:
        kinds, index, back, sizes = [], [], [], []
        for k, op, n in records[s]:
            if k == 0:
                kinds.append(0), index.append(op - first[s]), back.append(0), sizes.append(n)
            else:
                u = where.get(op)
                if u is None or not 0 <= s - u[0] <= 1:
                    return None  # a free of something older than the step before: no template
                kinds.append(1), index.append(u[1]), back.append(s - u[0]), sizes.append(0)
        rows.append((kinds, index, back, sizes))
    (k2, i2, b2, n2), (k3, i3, b3, n3), (k4, i4, b4, n4) = rows
    if not (k2 == k3 == k4 and i2 == i3 == i4 and b2 == b3 == b4):
        return None
    a2, a3, a4 = (np.array(n, np.int64) for n in (n2, n3, n4))
    slope = a3 - a2
    if not np.array_equal(a4 - a3, slope) or (slope < 0).any():
        return None
    n_allocs = first[3] - first[2]
    if first[4] - first[3] != n_allocs or first[2] - first[1] != n_allocs:
        return None
    return StepTemplate(np.array(k2, np.int8), np.array(i2, np.int64), np.array(b2, np.int64), a2, slope, 2,
                        first[2], n_allocs)


class StepJumper:
    """An op sink in front of a :class:`SinkGroup` that records decode steps 1 .. 4 and, after step 4, makes
    the remaining decode steps from their template (Note [Decode step template])."""

    def __init__(self, group: SinkGroup, on_step: Any, last_step: int) -> None:
        self.group = group
        self.on_step = on_step
        self.last_step = last_step
        self.step = 0
        self.records: dict[int, list[tuple[int, int, int]]] = {}
        self.template: StepTemplate | None = None

    def alloc(self, op_id: int, nbytes: int) -> None:
        if 1 <= self.step <= TEMPLATE_STEPS[-1]:
            self.records.setdefault(self.step, []).append((0, op_id, nbytes))
        self.group.alloc(op_id, nbytes)

    def free(self, op_id: int) -> None:
        if 1 <= self.step <= TEMPLATE_STEPS[-1]:
            self.records.setdefault(self.step, []).append((1, op_id, 0))
        self.group.free(op_id)

    def end_step(self, step: int) -> None:
        """After the prefill (0) and each decode step: the sinks', then ``on_step(step)``."""
        self.step = step + 1
        self.group.end_step(step)
        self.on_step(step)

    def jump(self, step: int, e: Any, live: list[int], cache: list[int]) -> int:
        """After decode step ``step`` (the emitter's hook): make steps ``step + 1 .. last_step`` here."""
        if step != TEMPLATE_STEPS[-1] or self.last_step <= step:
            return step
        tpl = build_template(self.records)
        self.records.clear()
        if tpl is None:
            return step
        lo, hi = tpl.alloc_id(step, 0), tpl.alloc_id(step, tpl.n_allocs)
        carried = [op for op in e.live if op >= tpl.alloc_id(1, 0)]
        if any(not lo <= op < hi for op in carried):
            return step  # something made before this step is still live: the template does not carry it
        self.template = tpl
        for t in range(step + 1, self.last_step + 1):
            for s in self.group.sinks:
                if s.error is None:
                    s.run_step(t, tpl)
            self.end_step(t)
            if all(s.error is not None for s in self.group.sinks):
                raise AllStopped
        last = self.last_step
        # the emitter's state as the last step leaves it: its live tensors renamed and resized
        shift = (last - step) * tpl.n_allocs
        sizes = tpl.sizes(last)
        alloc_pos = np.flatnonzero(tpl.kinds == 0)
        for op in carried:
            rounded, cat = e.live.pop(op)
            n = int(sizes[alloc_pos[op - lo]])
            new = -(-max(n, 1) // 512) * 512
            e.live[op + shift] = (new, cat)
            e.by_cat[cat] += new - rounded
            e.cur += new - rounded
        e.next_id += shift
        live[:] = [op + shift for op in live]
        cache[:] = [op + shift if op >= 0 else op for op in cache]
        return last
