"""Can a jump over decode steps be proved, and what does the proof cost? (issue 22 point 5; a study, not the fast path)::

    python -m benchmarks.affine_jump_study [--batch 50] [--at-step 150] [--small-period 32] [--large-period 33]

Replays every op of a 7B Llama-style model's ``generate()`` under ``pytorch`` (the Python engine over ``malloc``'d
segments). After decode step ``T`` (``--at-step``) it takes one pool's state at ``T - p`` and ``T`` (same segments,
blocks and owners: ``benchmarks/decode_state_period.py``), guesses that every number moves by the same ``D`` per
period of ``p`` steps, and runs that pool's ops of steps ``T + 1 .. T + p`` once on a copy whose every address,
size and request is an affine number ``x + k * slope`` of the period index ``k`` (the requests' slope: the step
template's times ``p``; ``p`` must make every rounded size affine, a multiple of 512 B per period). The engine's own
code makes the decisions (split, merge, booking); each comparison it makes on affine numbers is answered as at
``k = 0`` and narrows the range ``0 .. K`` of periods over which the answer stays the same (an affine function keeps
its sign between two points where it has it). Any comparison but those is refused: a product of two affine
numbers, a rounding that is not affine, a segment to make. If the copy ends with the structure it started with and
every number at ``x + D`` with slope ``D``, the state after ``T + m * p`` steps is the state at ``T`` plus ``m * D``
for ``m = 1 .. K + 1`` (the same decisions at every ``k`` up to ``K``, by induction on ``k``). The study then goes
on replaying and compares that prediction with the replayed state at ``T + m * p``.

Best fit is decided two ways: by the engine's sorted free list (``--sorted-free-list``: insertion compares the
blocks along its binary search, so two free blocks whose sizes cross end the range, whether or not a request lies
between them), or by only what the choice needs: the chosen block fits throughout, and every other block either
stays after it in (size, address) order throughout or keeps its answer to "do I fit?" (and, fitting, its place
after the chosen one), whichever holds longer.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpumem.allocator.backing import Segment, SegmentBacking
from gpumem.allocator.block import Block
from gpumem.allocator.factory import make_allocator
from gpumem.allocator.python_engine import PythonEngine
from gpumem.estimate import ModelShape
from gpumem.estimate.fastreplay import PlainSink, SinkGroup, StepJumper
from gpumem.estimate.workload import stream_inference
from gpumem.specs import open_device

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)


class Refused(Exception):
    """The symbolic run met something it cannot answer for every period at once."""


class Range:
    """The periods ``0 .. kmax`` over which every answer given so far holds."""

    def __init__(self, kmax: int) -> None:
        self.kmax = kmax
        self.comparisons = 0


class Aff:
    """``lo + slope * k`` for the period index ``k`` in ``0 .. rng.kmax``."""

    __slots__ = ("lo", "slope", "rng")

    def __init__(self, lo: int, slope: int, rng: Range) -> None:
        self.lo, self.slope, self.rng = lo, slope, rng

    def _sign(self, other: Any) -> int:
        """The sign of ``self - other`` at ``k = 0``, with the range narrowed to where it stays that sign."""
        lo, s = (self.lo - other.lo, self.slope - other.slope) if type(other) is Aff else (self.lo - other, self.slope)
        rng = self.rng
        rng.comparisons += 1
        if s == 0:
            return (lo > 0) - (lo < 0)
        if lo == 0:
            rng.kmax = 0
            return 0
        if lo > 0:
            if s < 0:
                rng.kmax = min(rng.kmax, (lo - 1) // -s)
            return 1
        if s > 0:
            rng.kmax = min(rng.kmax, (-lo - 1) // s)
        return -1

    def __lt__(self, o: Any) -> bool:
        return self._sign(o) < 0

    def __le__(self, o: Any) -> bool:
        return self._sign(o) <= 0

    def __gt__(self, o: Any) -> bool:
        return self._sign(o) > 0

    def __ge__(self, o: Any) -> bool:
        return self._sign(o) >= 0

    def __eq__(self, o: Any) -> bool:  # type: ignore[override]
        return self._sign(o) == 0

    def __ne__(self, o: Any) -> bool:  # type: ignore[override]
        return self._sign(o) != 0

    def __hash__(self) -> int:
        return hash(self.lo)

    def __bool__(self) -> bool:
        return self._sign(0) != 0

    def __add__(self, o: Any) -> "Aff":
        if type(o) is Aff:
            return Aff(self.lo + o.lo, self.slope + o.slope, self.rng)
        return Aff(self.lo + o, self.slope, self.rng)

    __radd__ = __add__

    def __sub__(self, o: Any) -> "Aff":
        if type(o) is Aff:
            return Aff(self.lo - o.lo, self.slope - o.slope, self.rng)
        return Aff(self.lo - o, self.slope, self.rng)

    def __rsub__(self, o: Any) -> "Aff":
        return Aff(o - self.lo, -self.slope, self.rng)

    def __neg__(self) -> "Aff":
        return Aff(-self.lo, -self.slope, self.rng)

    def __mul__(self, o: Any) -> "Aff":
        if type(o) is not int:
            raise Refused("a product of two affine numbers")
        return Aff(self.lo * o, self.slope * o, self.rng)

    __rmul__ = __mul__

    def __floordiv__(self, d: Any) -> "Aff":
        if type(d) is not int or d <= 0 or self.slope % d:
            raise Refused("a rounding that is not affine in the period")
        return Aff(self.lo // d, self.slope // d, self.rng)

    def __index__(self) -> int:
        raise Refused("an affine number used as an index")


def _lo(x: Any) -> int:
    return x.lo if type(x) is Aff else x


class MinimalFreeList:
    """Best fit by only the comparisons that make the choice (module docstring)."""

    def __init__(self, top_down: bool) -> None:
        self.blocks: dict[int, Block] = {}
        self.nbytes: Any = 0
        self.top_down = top_down

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return iter(list(self.blocks.values()))

    def __contains__(self, b: Block) -> bool:
        return self.blocks.get(id(b)) is b

    def add(self, b: Block) -> None:
        self.blocks[id(b)] = b
        self.nbytes = self.nbytes + b.size

    def remove(self, b: Block) -> None:
        del self.blocks[id(b)]
        self.nbytes = self.nbytes - b.size

    def _key(self, b: Block) -> tuple[Any, Any]:
        if self.top_down:
            seg = b.segment
            return b.size, seg.order + b.addr - seg.base  # type: ignore[attr-defined]
        return b.size, b.addr

    def best_fit(self, size: Any) -> Block | None:
        """The block best fit takes at ``k = 0``, the range narrowed to where it takes that block: the block
        fits throughout, and every other block either keeps its answer to "do I fit?" (and, fitting, stays
        after the chosen one in (size, address) order) or stays after the chosen one throughout, whether it
        fits or not (the larger of the two ranges)."""
        blocks = list(self.blocks.values())
        fits = [b for b in blocks if _lo(b.size) >= _lo(size)]
        if not fits:
            rng = _range_of(size)
            if rng is not None:  # nothing fits at k = 0: nothing may come to fit
                for b in blocks:
                    rng.kmax = min(rng.kmax, _keeps(b.size, size))
            return None
        best = min(fits, key=lambda b: tuple(map(_lo, self._key(b))))
        key = self._key(best)
        rng = _range_of(size) or _range_of(best.size)
        if rng is None:
            return best  # nothing affine: every answer holds at every k
        rng.kmax = min(rng.kmax, _keeps(best.size, size))
        for b in blocks:
            if b is best:
                continue
            after = _keeps_lex(self._key(b), key)  # b stays after best in the order, fitting or not
            fit_kept = _keeps(b.size, size)
            if b in fits or _lo(b.size) >= _lo(size):
                fit_kept = min(fit_kept, after)
            rng.kmax = min(rng.kmax, max(after, fit_kept))
            rng.comparisons += 1
        return best


def _range_of(*xs: Any) -> Range | None:
    for x in xs:
        if type(x) is Aff:
            return x.rng
    return None


def _parts(x: Any) -> tuple[int, int]:
    return (x.lo, x.slope) if type(x) is Aff else (x, 0)


def _sign_range(lo: int, s: int) -> int:
    """The largest ``K`` such that ``lo + s * k`` has the sign it has at ``k = 0`` for ``k = 0 .. K``."""
    if s == 0:
        return 10**18
    if lo == 0:
        return 0
    if lo > 0:
        return 10**18 if s > 0 else (lo - 1) // -s
    return 10**18 if s < 0 else (-lo - 1) // s


def _keeps(a: Any, b: Any) -> int:
    """The periods over which ``a - b`` keeps its sign at ``k = 0``."""
    (al, as_), (bl, bs) = _parts(a), _parts(b)
    return _sign_range(al - bl, as_ - bs)


def _keeps_lex(a: tuple[Any, Any], b: tuple[Any, Any]) -> int:
    """The periods over which the (size, address) key ``a`` stays after ``b`` (-1: it is not after it at
    ``k = 0``)."""
    (a0l, a0s), (b0l, b0s) = _parts(a[0]), _parts(b[0])
    (a1l, a1s), (b1l, b1s) = _parts(a[1]), _parts(b[1])
    d0l, d0s, d1l, d1s = a0l - b0l, a0s - b0s, a1l - b1l, a1s - b1s
    if d0l < 0 or (d0l == 0 and d1l <= 0):
        return -1
    if d0l > 0:
        # the sizes keep their order while the difference stays positive; at the first k where they are equal
        # the addresses decide: one more period if a's address is then after b's
        k = _sign_range(d0l, d0s)
        if k < 10**18 and d0l + d0s * (k + 1) == 0 and d1l + d1s * (k + 1) > 0:
            k += 1
        return k
    if d0s != 0:  # equal sizes at k = 0 only (a's address after b's): a grows past b, or falls before it
        return 10**18 if d0s > 0 else 0
    return _sign_range(d1l, d1s)  # equal sizes throughout: the addresses decide


class _NoStats:
    """The copy's counters: no peak compared (the study asks for decisions, not figures)."""

    def __init__(self) -> None:
        self.allocated_nbytes: Any = 0
        self.requested_nbytes: Any = 0
        self.num_frees = 0
        self.num_splits = 0
        self.cache_hits = 0

    def count_allocation(self, size: Any, nbytes: Any, reserved_nbytes: int) -> None:
        pass


class _NoMemory(dict):
    """The copy's freed-address memory: decides nothing, so compares nothing."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __len__(self) -> int:
        return 0


def pool_blocks(engine: PythonEngine, small: bool) -> list[tuple[Segment, list[Block]]]:
    out = []
    for seg in sorted((s for s in engine.backing.segments_list() if s.small == small), key=lambda s: s.base):
        blocks, b = [], seg.last
        while b is not None:
            blocks.append(b)
            b = b.prev
        out.append((seg, blocks[::-1]))
    return out


def owner(tpl: Any, op: int, step: int) -> tuple:
    if op >= tpl.alloc_id(1, 0):
        return (step - (tpl.s0 + (op - tpl.first_id) // tpl.n_allocs), (op - tpl.first_id) % tpl.n_allocs)
    return ("op", op)


def state(engine: PythonEngine, sink: PlainSink, tpl: Any, step: int, small: bool) -> tuple[tuple, np.ndarray]:
    """One pool's (structure with owners, numbers: address, size, requested of each block) after ``step``."""
    op_at = {addr: op for op, addr in sink.ptrs.items() if addr}
    structure, numbers = [], []
    for seg, blocks in pool_blocks(engine, small):
        structure.append((seg.base, seg.nbytes, seg.live,
                          tuple((b.allocated, owner(tpl, op_at[b.addr], step) if b.allocated else None) for b in blocks)))
        for b in blocks:
            numbers += (b.addr, b.size, b.requested if b.allocated else 0)
    return tuple(structure), np.array(numbers, dtype=np.int64)


@dataclass
class Outcome:
    pool: str
    period: int
    ops: int = 0
    seconds: float = 0.0
    comparisons: int = 0
    proven: int = 0
    """Periods after ``T`` whose state the run proves (K + 1), 0 when refused."""
    why: str = ""
    checked: int = 0
    agreed: int = 0


def symbolic_period(engine: PythonEngine, sink: PlainSink, tpl: Any, t_end: int, small: bool, p: int,
                    before: tuple[tuple, np.ndarray], now: tuple[tuple, np.ndarray], sorted_free_list: bool,
                    out: Outcome) -> np.ndarray | None:
    """Run the pool's ops of steps ``t_end + 1 .. t_end + p`` on an affine copy; return ``D`` when proved."""
    if before[0] != now[0]:
        out.why = "structure differs a period before"
        return None
    slope = (now[1] - before[1]).tolist()
    rng = Range(10**9)
    t0 = time.perf_counter()
    shell = object.__new__(PythonEngine)
    shell.policy, shell.uses_vmm, shell._small_max = engine.policy, False, engine._small_max
    shell.backing = object.__new__(SegmentBacking)
    shell.backing.reserved_nbytes = engine.backing.reserved_nbytes
    shell._live, shell._freed, shell._pending, shell._stats, shell._recorder = {}, _NoMemory(), [], _NoStats(), None
    fl = shell._new_free_list() if sorted_free_list else MinimalFreeList(engine.policy.segments_top_down)
    shell._free_lists = {(small, 0): fl}
    op_at = {addr: op for op, addr in sink.ptrs.items() if addr}
    ptr: dict[int, Any] = {}
    segs = []
    it = iter(slope)
    for seg, blocks in pool_blocks(engine, small):
        copy = Segment(seg.base, seg.nbytes, seg.small, seg.stream)
        copy.order, copy.live, copy.dirty, copy.fence = seg.order, seg.live, seg.dirty, seg.fence
        prev = None
        for b in blocks:
            sa, ss, sr = next(it), next(it), next(it)
            nb = Block(Aff(b.addr, sa, rng), Aff(b.size, ss, rng), b.stream, copy)
            nb.allocated, nb.prev = b.allocated, prev
            if prev is not None:
                prev.next = nb
            prev = nb
            if b.allocated:
                nb.requested = Aff(b.requested, sr, rng)
                shell._live[nb.addr] = nb
                ptr[op_at[b.addr]] = nb.addr
            else:
                fl.add(nb)
        copy.last = prev
        segs.append(copy)
    rnd, small_max = engine.policy.round_nbytes, engine._small_max
    try:
        for t in range(t_end + 1, t_end + p + 1):
            for kind, op, n, s in zip(tpl.kinds.tolist(), tpl.op_ids(t).tolist(), tpl.sizes(t).tolist(),
                                      (tpl.slope * p).tolist()):
                if kind == 0:
                    if not n:
                        if s:
                            raise Refused("a zero-byte request that grows")
                        continue
                    if (-(-n // rnd) * rnd <= small_max) != small:
                        continue  # the other pool's
                    nbytes = Aff(n, s, rng)
                    size = shell.policy.round(nbytes)
                    if (size <= small_max) != small:
                        raise Refused("a request that changes pool")
                    block = fl.best_fit(size)
                    if block is None:
                        raise Refused("a segment to make")
                    fl.remove(block)
                    block = shell._split(block, size, small, fl)
                    block.segment.live += 1
                    ptr[op] = shell._hand_out(block, nbytes, 0)
                    out.ops += 1
                else:
                    q = ptr.pop(op, None)
                    if q is not None:
                        b = shell._live[q]
                        shell.backing.decommit(b)
                        shell._free_booked(q, b)
                        out.ops += 1
    except Refused as exc:
        out.why = str(exc)
        return None
    finally:
        out.seconds = time.perf_counter() - t0
        out.comparisons = rng.comparisons
    # the copy's end: the structure it started with, every number one D on with slope D?
    op_of = {id(a): op for op, a in ptr.items()}
    structure, lo, sl = [], [], []
    for copy in segs:
        blocks, b = [], copy.last
        while b is not None:
            blocks.append(b)
            b = b.prev
        row = []
        for b in reversed(blocks):
            row.append((b.allocated, owner(tpl, op_of[id(b.addr)], t_end + p) if b.allocated else None))
            for x in (b.addr, b.size, b.requested if b.allocated else 0):
                lo.append(_lo(x))
                sl.append(x.slope if type(x) is Aff else 0)
        structure.append((copy.base, copy.nbytes, copy.live, tuple(row)))
    d = now[1] - before[1]
    live = np.repeat(np.array([a for s in now[0] for a, _ in s[3]], dtype=bool), 3)
    keep = np.ones(len(d), dtype=bool)
    keep[2::3] = live[2::3]  # a free block's requested bytes are stale: they decide nothing
    if tuple(structure) != now[0] or not np.array_equal((np.array(lo) - now[1] - d)[keep], np.zeros(keep.sum())) \
            or not np.array_equal((np.array(sl) - d)[keep], np.zeros(keep.sum())):
        out.why = "the period does not end one step of D on"
        return None
    out.proven = rng.kmax + 1
    return d


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.affine_jump_study", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=50, help="batch size (default 50)")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--at-step", type=int, default=150, help="the decode step T after which a period is run (default 150)")
    ap.add_argument("--small-period", type=int, default=32, help="the small pool's period in steps (default 32; 0: skip)")
    ap.add_argument("--large-period", type=int, default=33, help="the large pool's period in steps (default 33; 0: skip)")
    ap.add_argument("--check", type=int, default=6, help="proven periods compared with the replay (default 6)")
    ap.add_argument("--sorted-free-list", action="store_true", help="decide best fit by the engine's sorted free list")
    ap.add_argument("--device", default="sim:h200-141gb", help="simulated device (default sim:h200-141gb)")
    args = ap.parse_args()
    T = args.at_step
    pools = [(small, p) for small, p in ((True, args.small_period), (False, args.large_period)) if p > 0]
    dev = open_device(args.device)
    alloc = make_allocator(dev, "pytorch")
    engine = alloc._engine
    sink = PlainSink(alloc)
    outcomes = {small: Outcome("small" if small else "large", p) for small, p in pools}
    seen: dict[tuple[bool, int], tuple[tuple, np.ndarray]] = {}
    predicted: dict[tuple[bool, int], np.ndarray] = {}
    last = T + max(p for _, p in pools) * (args.check + 1)

    def on_step(step: int) -> None:
        tpl = jumper.template
        if tpl is None:
            return
        for small, p in pools:
            if step in (T - p, T) or (small, step) in predicted:
                seen[(small, step)] = state(engine, sink, tpl, step, small)
            if step == T:
                out = outcomes[small]
                d = symbolic_period(engine, sink, tpl, T, small, p, seen[(small, T - p)], seen[(small, T)],
                                    args.sorted_free_list, out)
                if d is not None:
                    for m in range(1, min(out.proven, args.check) + 1):
                        predicted[(small, T + m * p)] = seen[(small, T)][1] + m * d
            if (small, step) in predicted:
                out = outcomes[small]
                out.checked += 1
                got = seen[(small, step)]
                out.agreed += got[0] == seen[(small, T)][0] and np.array_equal(got[1], predicted[(small, step)])

    jumper = StepJumper(SinkGroup([sink]), on_step, last)
    stream_inference(LLAMA_7B, 2, (jumper,), on_step=jumper.end_step, jump=jumper.jump, batch_size=args.batch,
                     prompt_len=args.prompt_len, new_tokens=last + 1)
    alloc.close()
    dev.close()
    how = "the engine's sorted free list" if args.sorted_free_list else "the comparisons the choice needs"
    print(f"7B, batch {args.batch}, prompt {args.prompt_len}, pytorch, period run after step {T}; best fit by {how}")
    print(f"{'pool':<6} {'period':>6} {'ops':>7} {'s':>6} {'us/op':>6} {'comparisons':>11} {'proven periods':>14} "
          f"{'replay agrees':>13}  refused by")
    for out in outcomes.values():
        print(f"{out.pool:<6} {out.period:>6} {out.ops:>7} {out.seconds:>6.2f} {out.seconds / max(out.ops, 1) * 1e6:>6.1f} "
              f"{out.comparisons:>11} {out.proven:>14} {f'{out.agreed} of {out.checked}':>13}  {out.why or '-'}")


if __name__ == "__main__":
    main()
