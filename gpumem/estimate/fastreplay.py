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

    :class:`SkippingSink` replays every op of the first decode steps. At the end of each step it notes the
    small pool's state (every small segment's blocks: address, size, allocated; its live count and flags) and
    the step's small ops (kind, rounded size, and for a free which step and position allocated it) with the
    address each small allocation got. Once two consecutive steps ``t-1`` and ``t`` made the same small ops,
    got the same addresses, and the small pool's state was the same before ``t-1``, before ``t`` and after
    ``t``, step ``t+1`` starts in that state and, as long as its small ops are the same again, the
    deterministic allocator makes the same decisions for them (induction on the steps: the frees name the
    addresses the step before got, which are those of the template), grows nothing in the small pool and
    ends in the same state. So its small ops are not sent: each skipped allocation is booked at its template
    address, each skipped free forgotten. Large ops are all sent, in order. The limit sees the same sum (the
    small pool's reserve is constant over a fixed point), and the peak reserved is the same (the small pool's
    reserve never changes while skipped, and the large pool's changes only at large allocations, all made).

    A small op that differs from the template (a size rounded to the next 512 B) ends the skip: the ops of the
    step skipped so far are first sent, in order (the small pool is independent of the large ops sent in
    between), and each must land at its template address, else :class:`~gpumem.errors.InternalError`. Any
    out-of-memory error or retry in a replay that skipped something (the retry releases small segments, whose
    state mid-step is not the fixed point's) voids the fast result: the caller replays that policy in full.
    ``replay_inference(..., full_replay=True)`` keeps the reference path, and
    ``tests/estimate/test_fast_replay.py`` checks the two to the byte on random shapes and lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..allocator.backing import SegmentBacking
from ..allocator.python_engine import PythonEngine
from ..errors import InternalError, OutOfMemoryError

__all__ = ["SinkGroup", "PlainSink", "SkippingSink", "can_skip_small_pool", "AllStopped"]


MAX_PERIOD = 4
"""The longest run of decode steps after which the small pool may repeat (Note [Small pool skipped at a fixed
point]: the 7B model's repeats every 3 steps)."""


class AllStopped(Exception):
    """Every sink of a :class:`SinkGroup` has stopped (out of memory): the rest of the workload is not made."""


def _engine_of(allocator: Any) -> Any:
    return getattr(allocator, "_engine", None)


def can_skip_small_pool(allocator: Any) -> bool:
    """Whether Note [Small pool skipped at a fixed point] applies: the Python engine over ``malloc``'d
    segments with a separate small pool, no history and no garbage-collection threshold."""
    eng = _engine_of(allocator)
    return (isinstance(eng, PythonEngine) and isinstance(eng.backing, SegmentBacking)
            and eng.policy.separate_small_pool and eng.gc_threshold is None and eng._recorder is None)


class PlainSink:
    """Sends every op to ``allocator``; stops at its first out-of-memory error (Note [One stream, every policy])."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self._allocate = allocator.allocate
        self._free = allocator.free
        self.ptrs: dict[int, int] = {}
        self.error: OutOfMemoryError | None = None
        self.skipped_ops = 0

    def alloc(self, op_id: int, nbytes: int) -> None:
        if self.error is None:
            try:
                # a zero-byte allocation takes no memory (as in replay()): no pointer, its free is skipped
                self.ptrs[op_id] = self._allocate(nbytes, 0) if nbytes else 0
            except OutOfMemoryError as exc:
                self.error = exc

    def free(self, op_id: int) -> None:
        p = self.ptrs.pop(op_id, 0)
        if p and self.error is None:
            self._free(p)

    def end_step(self, step: int) -> None:
        """Called after the prefill (0) and each decode step."""

    @property
    def voided(self) -> bool:
        """Whether the fast result must be replaced by the full replay."""
        return False


@dataclass
class _Step:
    """The small ops of one step: ``sig`` (kind, rounded size, for a free (steps back, position)) and the
    addresses its small allocations got."""

    sig: list[tuple[int, int, int, int]] = field(default_factory=list)
    addrs: list[int] = field(default_factory=list)


class SkippingSink(PlainSink):
    """A :class:`PlainSink` that leaves out a decode step's small ops at a fixed point of the small pool
    (Note [Small pool skipped at a fixed point])."""

    def __init__(self, allocator: Any) -> None:
        super().__init__(allocator)
        eng = _engine_of(allocator)
        self._engine = eng
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

    # -- the small pool's state ---------------------------------------------------------------------------
    def _small_state(self) -> tuple:
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

    # -- ops -------------------------------------------------------------------------------------------------
    def _is_small(self, nbytes: int) -> bool:
        return nbytes > 0 and self._round(nbytes) <= self._small_max

    def alloc(self, op_id: int, nbytes: int) -> None:
        if self.error is not None:
            return
        if not self._is_small(nbytes):
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

    def _materialize(self) -> None:
        """Send the small ops skipped in this step, in order, each where the template put it; stop skipping."""
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
        cur = self._cur
        if self._skipping:
            if self._k != len(self._template.sig):  # the step made fewer small ops than the template
                self._materialize()
            else:
                self._k = 0
                self._phase = (self._phase + 1) % len(self._templates)
                self._template = self._templates[self._phase]
                if self._phase == 0:  # a whole period skipped: the small pool's state is the template's again
                    self._pending.clear()
        if not self._skipping:
            state = self._small_state()
            if step >= 1:
                self._history.append((cur, self._state_before, state))
                del self._history[:-2 * MAX_PERIOD]
                self._try_template()
            self._state_before = state
        self.step = step + 1
        self._cur = _Step()

    def _try_template(self) -> None:
        """Start skipping when the last ``2P`` full steps are two equal runs of ``P`` steps that leave the small
        pool as they found it (``P`` = 1 .. :data:`MAX_PERIOD`)."""
        h = self._history
        if self._engine._stats.num_alloc_retries:
            return
        for period in range(1, MAX_PERIOD + 1):
            if len(h) < 2 * period:
                break
            a, b = h[-2 * period:-period], h[-period:]
            if all(x[0].sig == y[0].sig and x[0].addrs == y[0].addrs for x, y in zip(a, b)) \
                    and a[0][1] == b[0][1] == b[-1][2]:
                self._templates = [x[0] for x in b]
                self._phase = 0
                self._template = self._templates[0]
                self._skipping = True
                self._skipped_any = True
                self._k = 0
                return

    def finish(self) -> None:
        """The stream is over (its last ops are the end of generate(), never skipped as a step)."""
        if self._skipping and self.error is None:
            self._materialize()

    @property
    def voided(self) -> bool:
        if not self._skipped_any:
            return False
        st = self._engine.stats()
        return self.error is not None or st.num_alloc_retries > 0 or st.num_ooms > 0


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
