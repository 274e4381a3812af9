"""The pure-Python reference engine of the caching allocator (:class:`PythonEngine`).

It runs every policy: ``malloc``'d segments (:class:`~.backing.SegmentBacking`) or a virtual range
per pool (:class:`~.backing.VirtualBacking`), history recording, pages of any size. The algorithm and
the Notes that explain it are in :mod:`.caching`; the native engine (``gpumem/_native/engine.h``) is
a port of this one (both backings; history and pages of their own size per pool stay here) and makes the same decisions
(``tests/allocator/test_native_differential.py``). Speed is the native engine's job: this one is
written to be read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Iterator

from ..device import Device
from ..errors import (DeviceClosedError, DeviceLostError, DoubleFreeError, InternalError, InvalidArgumentError,
                      InvalidPointerError, OutOfMemoryError)
from ..units import format_bytes
from ..validate import STREAM_END, as_int, check_nbytes, check_pointer, check_stream
from .backing import AddressSpaceExhausted, Backing, LimitExceeded, Segment, SegmentBacking, VirtualBacking, VirtualSegment
from .block import Block, FreeList, TopDownFreeList, append_block, drop_last_block, merge_blocks, split_block
from .engine import OomCause, no_history_error, oom_error
from .fences import StreamFences
from .plan import StepPlan, StepState, check_generation, check_record_limit
from .policy import AllocatorPolicy
from .stats import AllocatorStats

log = logging.getLogger(__name__)

_FREED_MEMORY = 65_536
"""How many freed addresses are remembered, to tell a double free from a bad pointer."""

# Note [Freed addresses, oldest first]
#     A free that names no live block raises DoubleFreeError when the address is among the last
#     _FREED_MEMORY addresses freed, InvalidPointerError otherwise. The engine keeps them in insertion
#     order (an address freed again keeps its first place, as in the native engine's ring, engine.cpp)
#     and forgets the oldest once there are more. That was ``del d[next(iter(d))]`` on a plain dict,
#     which is not O(1): CPython leaves a deleted entry's slot in place until the table is rebuilt, and
#     ``iter`` walks every such slot from the front, so each forget scanned up to tens of thousands of
#     slots. A long replay frees millions of blocks, and a new address past the first 65,536 paid a
#     scan: ``gpumem estimate``'s fast replay at 4,000 new tokens under ``expandable`` took 8.1 s of CPU
#     with the scans, 5.3 s without (``reports/estimate-speed.md``). An OrderedDict forgets its oldest
#     entry in O(1) with the same order, so the same errors are raised
#     (``tests/allocator/test_allocator_units.py``: the oldest forgotten first, in both engines).


class PythonEngine:
    """The reference engine (:class:`~.engine.Engine`) over ``device`` under ``policy``, in
    virtual-memory mode when ``uses_vmm``; ``limit_nbytes``, ``gc_threshold`` and ``record_history``
    as :class:`~.caching.CachingAllocator` takes them, already checked."""

    name = "python"

    def __init__(self, device: Device, policy: AllocatorPolicy, *, uses_vmm: bool, limit_nbytes: int | None,
                 gc_threshold: float | None, record_history: bool) -> None:
        self.device = device
        self.policy = policy
        self.uses_vmm = uses_vmm
        self.limit_nbytes = limit_nbytes
        self.gc_threshold = gc_threshold
        self.fences = StreamFences(device)
        backing_cls = VirtualBacking if uses_vmm else SegmentBacking
        self.backing: Backing = backing_cls(device, policy, limit_nbytes, self.fences)
        self._lock = threading.RLock()
        self._defer: Callable[[], ContextManager[Any]] = getattr(device, "deferred_events", contextlib.nullcontext)
        self._free_lists: dict[tuple[bool, int], FreeList] = {}
        self._live: dict[int, Block] = {}
        self._freed: OrderedDict[int, None] = OrderedDict()
        """The last :data:`_FREED_MEMORY` addresses freed, oldest first (Note [Freed addresses, oldest first])."""
        self._pending: list[Block] = []
        self._stats = AllocatorStats()
        self.backing.allocations = lambda: self._stats.num_allocs   # Note [The ordered steal before a warm-up]
        self._recorder = None
        if record_history:
            from ..trace import TraceRecorder

            self._recorder = TraceRecorder()
            self.backing.on_segment = self._recorder.record_segment
        self._small_max = policy.small_max_nbytes if policy.separate_small_pool else -1
        # the policy's values the hot path reads, read once (Note [The hot path, read once])
        self._round_nbytes = policy.round_nbytes
        self._min_split = {True: policy.min_split_small_nbytes, False: policy.min_split_large_nbytes}
        """The least rest a split leaves, by pool (``True``: small)."""
        self._separate_small = policy.separate_small_pool
        self._closed = False
        self._committed = False
        """Set by :meth:`_grow` when its out-of-memory retry already committed the block."""
        self._lost: DeviceLostError | None = None
        self._plan = StepPlan(self)
        """The step plan layer (Note [Step plans] in :mod:`.plan`): off until the program marks a step."""

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Deferred device events outside, the lock inside (Note [Callbacks run outside the allocator]);
        remembers a device loss so that every later call raises it."""
        with self._defer():
            with self._lock:
                if self._lost is not None:
                    raise DeviceLostError(f"the device was lost: {self._lost}")
                try:
                    yield
                except DeviceLostError as exc:
                    self._lost = exc
                    raise
                finally:
                    if self._recorder is not None:
                        self.backing.sync_export()  # Note [Exporting cached chunks] in .backing

    # -- the hot path ---------------------------------------------------------------------------------
    # Note [The hot path, read once]
    #     ``gpumem estimate`` and ``gpumem fit`` replay millions of allocations and frees through this
    #     engine (``gpumem/estimate/fastreplay.py``), where each call's fixed costs add up: at 1,000 new
    #     tokens of a 7B model, 372,000 calls per policy. So the hot path does each thing once: the
    #     policy's rounding, split rule and pool split are read when the engine is made (the policy is a
    #     checked frozen copy: Note [A policy is checked where it is used] in .policy; the native engine
    #     copies it once too), a plain positive ``int`` skips the argument checks (they would return it
    #     unchanged; anything else still goes through them and raises the same errors), a cache hit
    #     applies the split rule once (:meth:`_kept_nbytes`, then the split it decided; :meth:`_split`
    #     applied it again, and the other paths still call it), and a freed block's free neighbours are
    #     taken out of the free list in one look-up (:meth:`.block.FreeList.discard`: ``in`` then
    #     ``remove`` searched twice). The decisions are the same, call for call: the differential test
    #     (``tests/allocator/test_native_differential.py``) and ``tests/estimate/test_fast_replay.py``
    #     check them. What it saves: ``reports/estimate-speed.md``.
    def allocate(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream``; return the device pointer."""
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        if type(stream) is not int or not 0 <= stream < STREAM_END:
            stream = check_stream(stream)
        if self._plan.active:
            with self._operation():
                return self._plan.allocate(nbytes, stream)
        return self._allocate_engine(nbytes, stream)

    def _allocate_engine(self, nbytes: int, stream: int) -> int:
        """The engine's allocation, arguments checked (the plan layer's fallback)."""
        r = self._round_nbytes
        size = -(-nbytes // r) * r  # policy.round(nbytes)
        small = size <= self._small_max
        # Note [The hot path makes no device call]: a cache hit on a page that already holds live
        # data needs neither the device nor deferred events; everything else runs as an operation.
        # A closed device is asked first: it has given all memory back (Note [No memory from a closed
        # device] in gpumem/_native/module.cpp).
        with self._lock:
            if self._lost is None and not self._closed and not self.device.closed:
                free_list = self._free_lists.get((small, stream))
                if free_list is not None:
                    block = free_list.best_fit(size)
                    if block is not None:
                        kept = self._kept_nbytes(block, size, small)
                        if self.backing.commit_quietly(block, kept):
                            free_list.remove(block)
                            self._stats.cache_hits += 1
                            return self._hand_out(self._split_kept(block, size, kept, free_list), nbytes, stream)
        with self._operation():
            if self._closed:
                raise InvalidArgumentError("allocator is closed")
            if self.device.closed:
                raise DeviceClosedError(f"{self.device.spec} is closed")
            return self._allocate_slow(nbytes, size, small, stream)

    def _rounded(self, nbytes: int) -> int:
        """``policy.round(nbytes)`` (the hot path, :meth:`_allocate_engine`, writes it out; Note [The hot path,
        read once])."""
        r = self._round_nbytes
        return -(-nbytes // r) * r

    def _never_fits(self, size: int) -> bool:
        """Whether a request of ``size`` rounded bytes can never fit: larger than the device or the limit (refused
        at once by :meth:`_allocate_slow`, and no step's leave: Note [A plan that leaves early] in :mod:`.plan`)."""
        return size > self.device.properties().total_nbytes or (self.limit_nbytes is not None
                                                                and size > self.limit_nbytes)

    def _allocate_slow(self, nbytes: int, size: int, small: bool, stream: int) -> int:
        total = self.device.properties().total_nbytes
        if self._never_fits(size):
            # can never fit: refuse at once, without waiting for work or flushing the cache
            self._stats.num_ooms += 1
            self.device.mem_info()  # the native engine asks twice here too (the differential test compares calls)
            raise self._oom_error(nbytes, OomCause.TOO_LARGE if size > total else OomCause.LIMIT)
        self._plan.check_warmup()  # Note [A memory-first warm-up] in .plan
        free_list = self._free_lists.get((small, stream))
        if free_list is None:
            free_list = self._free_lists[(small, stream)] = self._new_free_list()
        block = free_list.best_fit(size)
        if block is None and self._pending:
            self._process_pending(wait=False)  # blocks whose other-stream uses are done, see Note [Streams]
            block = free_list.best_fit(size)
        self._committed = False
        if block is not None:
            free_list.remove(block)
            self._stats.cache_hits += 1
        else:
            block = self._grow(small, stream, size, free_list, nbytes)
        if not self._committed:
            block = self._split(block, size, small, free_list)
            try:
                self.backing.commit(block)
            except OutOfMemoryError:
                self._stats.num_alloc_retries += 1
                self._unsplit_after_failure(block, free_list)
                block = self._retry_after_release(small, stream, size, free_list, nbytes)
            except BaseException:
                # any other failure (a TransientDeviceError...): the block goes back, see the Note
                self._unsplit_after_failure(block, free_list)
                raise
        return self._hand_out(block, nbytes, stream)

    def _hand_out(self, block: Block, nbytes: int, stream: int) -> int:
        """Book a committed block as live and return its address."""
        block.allocated = True
        block.requested = nbytes
        addr = block.addr
        self._live[addr] = block
        # block.size, not the request: an unsplit block is larger, and free() subtracts block.size
        self._stats.count_allocation(block.size, nbytes, self.backing.reserved_nbytes + self._plan.mapped_nbytes)
        if self._recorder is not None:
            self._recorder.record_alloc(addr, nbytes, stream)
        return addr

    def free(self, ptr: int) -> None:
        """Return ``ptr`` to the cache. Unknown pointers and double frees raise, changing nothing.

        The block is reusable at once on its own stream; blocks used on other streams
        (:meth:`record_stream`) once those streams' work up to now is done (Note [Streams]).
        """
        if type(ptr) is not int:
            ptr = as_int(ptr, "ptr")
        if self._plan.active:
            with self._operation():
                if not self._plan.free(ptr):
                    self._free_engine(ptr)
                    self._plan.record_free(ptr)
            return
        self._free_engine(ptr)

    def _free_engine(self, ptr: int) -> None:
        """The engine's free (the plan layer's, for pointers outside its arenas)."""
        with self._lock:  # see Note [The hot path makes no device call]
            block = self._live.get(ptr) if self._lost is None else None
            if block is not None and not block.pending_streams:
                self.backing.decommit(block)  # no device call: fences come when memory goes back
                self._free_booked(ptr, block)
                return
        with self._operation():
            if self._closed:
                raise InvalidArgumentError(f"free of {ptr:#x}: the allocator is closed")
            block = self._live.get(ptr)
            if block is None:
                check_pointer(ptr)
                if ptr in self._freed:
                    raise DoubleFreeError(f"double free of {ptr:#x} in the caching allocator")
                released = self._plan.released_arena(ptr)
                if released is not None and not any(s.base <= ptr < s.base + s.nbytes
                                                    for s in self.backing.segments_list()):
                    raise InvalidPointerError(
                        f"free of {ptr:#x}, which lies in a step plan's arena (at {released[0]:#x}, {released[1]} B) "
                        "given back when nothing in it was live: a double free? (Note [Frees into a given-back arena])")
                raise InvalidPointerError(f"free of {ptr:#x}, which this allocator did not allocate"
                                          + self._inside_live(ptr))
            if block.pending_streams:
                fences = self.fences
                block.fences = {s: fences.record(s) for s in sorted(block.pending_streams)}  # may raise: still live
            else:
                self.backing.decommit(block)
            self._free_booked(ptr, block)

    def _free_booked(self, ptr: int, block: Block) -> None:
        """The bookkeeping of a free whose device side (decommit or fences) is done."""
        del self._live[ptr]
        self._freed[ptr] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)
        st = self._stats
        st.allocated_nbytes -= block.size
        st.requested_nbytes -= block.requested
        st.num_frees += 1
        if self._recorder is not None:
            self._recorder.record_free(ptr, block.stream)
        block.allocated = False
        if block.fences is not None:
            # its pages stay committed until the other streams' events complete, see Note [Streams]
            self._pending.append(block)
            return
        self._insert_free(block)

    # -- growth, splitting, merging --------------------------------------------------------------------
    def _grow(self, small: bool, stream: int, size: int, free_list: FreeList, nbytes: int) -> Block:
        self._stats.cache_misses += 1
        if self.gc_threshold is not None:
            cap = self.limit_nbytes or self.device.properties().total_nbytes
            if self.backing.reserved_nbytes > self.gc_threshold * cap:
                self._stats.num_gc_releases += 1
                self._release_cached(wait=False)
        try:
            return self._grow_once(small, stream, size, free_list)
        except OutOfMemoryError:
            self._stats.num_alloc_retries += 1
            self._committed = True  # the retry split and committed it: allocate() must not commit it again
            return self._retry_after_release(small, stream, size, free_list, nbytes)

    def _grow_once(self, small: bool, stream: int, size: int, free_list: FreeList) -> Block:
        """A new free block (in no free list) of at least ``size`` bytes: a new ``malloc``'d segment
        tiled by one block, or the top of the pool's virtual range (growing this stream's free
        block there, if it is the range's last)."""
        backing = self.backing
        if isinstance(backing, SegmentBacking):
            seg = backing.new_segment(small, stream, size)
            block = Block(seg.base, seg.nbytes, stream, seg)
            append_block(seg, block)
            return block
        vseg = backing.range_of(small)
        tail = vseg.last  # type: ignore[union-attr]
        if tail is not None and tail.stream == stream and not tail.allocated and tail.fences is None \
                and tail in free_list:
            backing.extend(vseg, stream, size - tail.size, size)  # type: ignore[arg-type]
            free_list.remove(tail)
            tail.size = size
            return tail
        addr = backing.extend(vseg, stream, size, size)  # type: ignore[arg-type]
        block = Block(addr, size, stream, vseg)
        append_block(vseg, block)
        return block

    def _release_cached(self, wait: bool) -> int:
        """Give cached memory back (Note [Stream-ordered frees]); then, in virtual memory, drop the free
        blocks at the top of each range so that its address space does not creep up."""
        released = self.backing.release_cached(self._drop_blocks, wait)
        if isinstance(self.backing, VirtualBacking):
            backing = self.backing
            for seg in backing.segments_list():
                while True:
                    last = seg.last
                    if last is None or last.allocated or last.fences is not None:
                        break
                    if not backing.lower_top(seg, last.addr, last.stream, wait):  # type: ignore[arg-type]
                        break
                    self._free_list_of(last).remove(last)
                    drop_last_block(seg)
        return released

    def _anything_to_wait_for(self) -> bool:
        """After a release that did not wait: whether pending blocks or cached memory (still used by
        queued work) remain, so that waiting for them could make room."""
        if self._pending:
            return True
        backing = self.backing
        if isinstance(backing, VirtualBacking):
            if backing.unmapped:
                return True
            for seg in backing.vsegments.values():
                last = seg.last
                if seg.empty or (last is not None and not last.allocated and last.fences is None):
                    return True
            return False
        return any(not seg.live for seg in backing.segments_list())

    def _reown_idle(self, stream: int, free_list: FreeList) -> bool:
        """Virtual memory, out of memory: hand the free blocks of other streams of the pool whose work is
        done (a fence recorded now has completed) to ``stream``, merged with its neighbours, so that the
        address space idle streams freed below live blocks is not lost (Note [One range per pool]).
        Returns whether any block moved."""
        pool = next((k[0] for k, fl in self._free_lists.items() if fl is free_list), None)
        moved = False
        for (small, s), fl in list(self._free_lists.items()):
            if small != pool or s == stream or not len(fl):
                continue
            number = self.fences.record(s)
            if not self.fences.done(s, number):
                continue  # that stream still has work queued: its free blocks stay its own
            self.backing.begin_multi_stream()  # pages track their streams: before any block moves (it may raise)
            for b in fl:
                fl.remove(b)
                b.stream = stream
                self._insert_free(b)
            moved = True
        if moved:
            release = self._release_cached(wait=False)  # a merged free top can now be trimmed
            log.debug("re-owned idle streams' free blocks to stream %d (%d B released)", stream, release)
        return moved

    def _drop_blocks(self, seg: object) -> None:
        """Forget the blocks of a segment the backing gave back (all free: they are merged into one)."""
        b = seg.last  # type: ignore[attr-defined]
        while b is not None:
            if b.allocated or b.fences is not None:
                raise InternalError(f"segment {seg.base:#x} was given back with {b!r} in use")  # type: ignore[attr-defined]
            self._free_list_of(b).remove(b)
            b = b.prev
        seg.last = None  # type: ignore[attr-defined]

    def _retry_after_release(self, small: bool, stream: int, size: int, free_list: FreeList,
                             nbytes: int) -> Block:
        """Make pending blocks reusable and give cached memory back, then try once more to find or grow,
        split and commit a block: first with what is free of work (no waiting), and only if that is
        still short, waiting for the work still using cached memory; and only if that too is short, with a
        step plan's arena dropped (Note [Step plans under memory pressure])."""
        plan = self._plan
        for shrink in (False, True):
            if shrink:
                plan.shrink()
            for wait in (False, True):
                self._process_pending(wait=wait)
                self._release_cached(wait=wait)
                more = not wait and self._anything_to_wait_for()  # before this attempt adds its own free block
                block = None
                try:
                    block = free_list.best_fit(size)
                    if block is None and isinstance(self.backing, VirtualBacking) and self._reown_idle(stream, free_list):
                        block = free_list.best_fit(size)
                    if block is not None:
                        free_list.remove(block)
                    else:
                        block = self._grow_once(small, stream, size, free_list)
                    block = self._split(block, size, small, free_list)
                    self.backing.commit(block)
                    return block
                except OutOfMemoryError as exc:
                    if block is not None:
                        self._unsplit_after_failure(block, free_list)
                    if not more and (shrink or not plan.holds_memory()):
                        self._stats.num_ooms += 1
                        raise self._oom_error(nbytes, exc) from None
                    if not more:
                        break   # the plan's arena next
                except BaseException:
                    if block is not None:
                        self._unsplit_after_failure(block, free_list)
                    raise
        raise InternalError("unreachable")  # pragma: no cover

    def _kept_nbytes(self, block: Block, size: int, small: bool) -> int:
        """The size ``block`` will have once :meth:`_split` has served ``size`` from it."""
        remaining = block.size - size
        min_rest = self._min_split[small]
        return size if remaining >= min_rest and remaining > 0 else block.size

    def _split(self, block: Block, size: int, small: bool, free_list: FreeList) -> Block:
        return self._split_kept(block, size, self._kept_nbytes(block, size, small), free_list)

    def _split_kept(self, block: Block, size: int, kept: int, free_list: FreeList) -> Block:
        """Split ``block`` as :meth:`_kept_nbytes` decided (``kept``: its size after), the rest into ``free_list``."""
        if kept < block.size:
            free_list.add(split_block(block, size))
            self._stats.num_splits += 1
        return block

    def _unsplit_after_failure(self, block: Block, free_list: FreeList) -> None:
        self._insert_free(block)

    def _insert_free(self, block: Block) -> None:
        """Put a free block in its free list, merged with free neighbours of the same segment and stream."""
        free_list = self._free_list_of(block)
        prev = block.prev
        if prev is not None and not prev.allocated and prev.fences is None and free_list.discard(prev):
            block = merge_blocks(prev, block)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.fences is None and free_list.discard(nxt):
            merge_blocks(block, nxt)
        free_list.add(block)

    def _new_free_list(self) -> FreeList:
        """An empty free list: ordered by segment age with ``segments_top_down`` in segment mode (Note
        [Segments top-down] in :mod:`.policy`), by address otherwise."""
        if self.policy.segments_top_down and not self.uses_vmm:
            return TopDownFreeList()
        return FreeList()

    def _free_list_of(self, block: Block) -> FreeList:
        seg = block.segment
        key = (bool(getattr(seg, "small", False)) and self._separate_small, block.stream)
        fl = self._free_lists.get(key)
        if fl is None:
            fl = self._free_lists[key] = self._new_free_list()
        return fl

    def _process_pending(self, wait: bool) -> int:
        """Make freed blocks whose other-stream events have completed reusable (with ``wait``, wait for
        them all); return how many became free. A failing event call is raised, with the blocks not
        yet processed still pending."""
        done = 0
        fences = self.fences
        pending = self._pending
        remaining: list[Block] = []
        i = 0
        blocked: dict[int, int] = {}
        """stream -> a fence found not complete in this pass: later fences there are not complete either
        (events on one stream complete in order), so they are not queried (as PyTorch stops at the first)."""
        try:
            for i, block in enumerate(pending):  # noqa: B007 - i is read after a failure
                ready = True
                for s, n in block.fences.items():  # type: ignore[union-attr]
                    b = blocked.get(s)
                    if b is not None and n >= b:
                        ready = False
                        break
                    if not fences.done(s, n):
                        blocked[s] = n if b is None else min(b, n)
                        ready = False
                        break
                if not ready:
                    if not wait:
                        remaining.append(block)
                        continue
                    fences.wait_all(block.fences)
                self.backing.decommit(block)
                block.fences = None
                block.pending_streams = None
                self._insert_free(block)
                done += 1
            i = len(pending)
        finally:
            self._pending = remaining + pending[i:]
        return done

    def _oom_error(self, nbytes: int, cause: OomCause | OutOfMemoryError) -> OutOfMemoryError:
        """The error of a failed request (:func:`~.engine.oom_error`); ``cause``: why, or the device's or
        backing's error."""
        injected = False
        if isinstance(cause, OutOfMemoryError):
            injected = bool(getattr(cause, "injected", False))
            cause = (OomCause.ADDRESS_SPACE if isinstance(cause, AddressSpaceExhausted)
                     else OomCause.LIMIT if isinstance(cause, LimitExceeded) else OomCause.DEVICE)
        info = self.device.mem_info()
        reserved = self.backing.reserved_nbytes + self._plan.mapped_nbytes   # a step plan's arena counts
        allocated = self._stats.allocated_nbytes
        return oom_error(cause, nbytes, self.policy.round(nbytes), free_nbytes=info.free_nbytes,
                         total_nbytes=info.total_nbytes, device=self.device.spec, allocated_nbytes=allocated,
                         cached_nbytes=reserved - allocated, reserved_nbytes=reserved,
                         limit_nbytes=self.limit_nbytes, va_nbytes=getattr(self.backing, "va_nbytes", 0),
                         injected=injected, segment_mode_vmm=None if self.uses_vmm else self.device.vmm_supported,
                         plan_mapped_nbytes=self._plan.mapped_nbytes,
                         plan_dropped_nbytes=sum(a.mapped_nbytes for a in self._plan.arenas if a.dropped),
                         plan_live_nbytes=self._plan.live_nbytes())

    # -- streams ---------------------------------------------------------------------------------------
    def record_stream(self, ptr: int, stream: int) -> None:
        """Note that the live block at ``ptr`` is used on ``stream`` too (Note [Streams])."""
        with self._operation():
            if self._closed:
                raise InvalidArgumentError(f"record_stream of {ptr:#x}: the allocator is closed")
            if self._plan.arenas and self._plan.record_stream(ptr, stream):
                if self._recorder is not None:   # a use of the plan's allocation is in the history too
                    self._recorder.record_stream_use(ptr, stream)
                return
            block = self._live.get(ptr)
            if block is None:
                raise InvalidPointerError(f"record_stream: {ptr:#x} is not a live allocation" + self._inside_live(ptr))
            if stream != block.stream:
                if block.pending_streams is None:
                    block.pending_streams = set()
                block.pending_streams.add(stream)
                self._plan.record_cross_stream(ptr)
            if self._recorder is not None:
                self._recorder.record_stream_use(ptr, stream)

    def _inside_live(self, ptr: int) -> str:
        """``"; it is inside the live block at 0x..."`` when ``ptr`` points into a live block (error path only)."""
        for b in self._live.values():
            if b.addr < ptr < b.addr + b.size:
                return f"; it is inside the live block at {b.addr:#x} (+{ptr - b.addr:#x}): free that pointer"
        return ""

    def synchronize(self) -> None:
        with self._operation():
            self.device.synchronize()
            self._process_pending(wait=True)

    # -- cache control and introspection -----------------------------------------------------------------
    def empty_cache(self) -> int:
        """Give back the engine's cache and the step plans' arena runs no live allocation touches (Note [When
        marks stop] in :mod:`.plan`); the bytes given back."""
        with self._operation():
            released = self._empty_cache_locked()
            if not self._closed:
                released += self._plan.give_back_idle()
            return released

    def _empty_cache_locked(self) -> int:
        """:meth:`empty_cache` inside an operation (the plan layer gives the cache back before it maps)."""
        if self._closed:
            return 0
        self.device.mem_info()  # a lost device is noticed here (DeviceLostError), even with nothing cached
        self._process_pending(wait=True)
        released = self._release_cached(wait=True)
        for key in [k for k, fl in self._free_lists.items() if not len(fl)]:
            del self._free_lists[key]  # idle streams cost nothing once their cache is gone
        self.fences.forget_idle()  # nor their events and fence entries
        log.debug("empty_cache released %s", format_bytes(released))
        return released

    def consistency_problems(self) -> list[str]:
        with self._operation():
            if self._closed:
                return []  # a closed allocator holds nothing
            self.device.mem_info()  # a lost device raises DeviceLostError (the range listings below do not)
            problems = self.backing.consistency_problems()
            for seg in self.backing.segments_list():
                head = seg.last
                while head is not None and head.prev is not None:
                    head = head.prev
                problems.extend(_chain_problems(seg, head, self.backing.tiled_end(seg), self._free_list_of))
            for (small, stream), fl in self._free_lists.items():
                for b in fl:
                    if b.allocated or b.stream != stream or b.fences is not None:
                        problems.append(f"{b!r} is in the free list of stream {stream} but is not free there")
            live_nbytes = self._plan.live_nbytes()
            for addr, b in self._live.items():
                live_nbytes += b.size
                if not b.allocated or b.addr != addr:
                    problems.append(f"live block {b!r} is not marked allocated at {addr:#x}")
            if live_nbytes != self._stats.allocated_nbytes:
                problems.append(f"live blocks hold {live_nbytes} B, allocated_nbytes is {self._stats.allocated_nbytes}")
            for b in self._pending:
                if b.allocated or not b.fences:
                    problems.append(f"pending block {b!r} has no fences or is allocated")
            reserved = self.backing.reserved_nbytes + self._plan.mapped_nbytes
            if self.backing.reserved_nbytes < 0 or self._stats.allocated_nbytes > reserved:
                problems.append(f"reserved {reserved} B < allocated "
                                f"{self._stats.allocated_nbytes} B")
            return problems

    def reserved_nbytes(self) -> int:
        return self.backing.reserved_nbytes + self._plan.mapped_nbytes

    def allocated_nbytes(self) -> int:
        return self._stats.allocated_nbytes

    def releasable_nbytes(self, with_carried: bool = False) -> int:
        with self._operation():
            if self._closed:
                return 0
            # blocks freed while other streams used them go back with the cache too (it waits for those uses)
            return self.backing.releasable_nbytes(self._pending + (self._carried_blocks() if with_carried else []))

    def _carried_blocks(self) -> list[Block]:
        """The engine's live blocks that the READY step's plan places though they are live at the mark and that go
        before the next step allocates anything: the allocations of the step just ended (its sizes are the
        template's) whose template slot is freed at rank 0 of the next step. One freed later (``zero_grad`` after
        the forward pass) is still live while the arena maps the step's first pages, so it is no room (Note [The
        room counts whole chunks]). None without a READY step."""
        plan = self._plan
        if plan.state is not StepState.READY:
            return []
        out = []
        for ptr, i in plan.cur_map.items():
            if i >= len(plan.prev):
                continue   # not at READY, where the two steps have one length
            _, _, free_own, free_next = plan.prev[i]
            block = self._live.get(ptr)
            if block is not None and free_own < 0 and free_next == 0:   # freed before the next step allocates
                out.append(block)
        return out

    def live_blocks(self) -> list[tuple[int, int]]:
        """The engine's live blocks and the step plan's arenas' live allocations, by address (review attacker 12,
        F4: the arenas' were left out, as *Live blocks* once left them out of the summary)."""
        with self._lock:
            out = [(b.addr, b.size) for b in self._live.values()]
            out += [(ptr, size) for a in self._plan.arenas for ptr, (_, size, _) in a.live.items()]
            return sorted(out)

    def block_size(self, ptr: int) -> int:
        if self._plan.arenas:
            found = self._plan.arena_entry(ptr)
            if found is not None:
                return found[1][1]
        block = self._live.get(ptr)
        if block is None:
            raise InvalidPointerError(f"{ptr:#x} is not a live allocation")
        return block.size

    def reset_peak_stats(self) -> None:
        """Peaks down to the values now; reserved counts a step plan's arena (``Engine::reset_peak_stats``)."""
        with self._lock:
            st = self._stats
            st.peak_allocated_nbytes = st.allocated_nbytes
            st.peak_requested_nbytes = st.requested_nbytes
            st.peak_reserved_nbytes = self.backing.reserved_nbytes + self._plan.mapped_nbytes

    def stats(self) -> AllocatorStats:
        with self._lock:
            st = self._stats.copy()
            st.reserved_nbytes = self.backing.reserved_nbytes + self._plan.mapped_nbytes
            st.num_segments = self.backing.n_segments
            st.active_nbytes = st.allocated_nbytes + sum(b.size for b in self._pending)
            free_lists = list(self._free_lists.values())
            total_free = st.reserved_nbytes - st.allocated_nbytes
            st.inactive_split_nbytes = sum(fl.nbytes for fl in free_lists) if not self.uses_vmm else max(
                0, total_free - getattr(self.backing, "mapped_empty_nbytes", lambda: 0)()
                - sum(h.nbytes for h in getattr(self.backing, "unmapped", ())))
            st.num_live_blocks = len(self._live) + self._plan.live_count()   # arena blocks too, dropped ones' as well
            st.num_free_blocks = sum(len(fl) for fl in free_lists)
            largest = min(self.backing.largest_free_nbytes(free_lists), max(total_free, 0))
            st.largest_free_nbytes = largest
            st.device_calls = self.backing.device_calls + self._plan.counts["arena_calls"]
            st.event_calls = self.fences.device_calls
            st.plan_free_nbytes = max(0, self._plan.mapped_nbytes - self._plan.live_nbytes())
            return st

    def describe(self) -> str:
        return self.backing.describe()

    # -- step plans (Note [Step plans] in .plan) ---------------------------------------------------------
    def _plan_operation(self, name: str, call: Callable[[], Any]) -> Any:
        """``call()`` (a step plan's method) as one operation of an open allocator; ``name`` says who refused."""
        with self._operation():
            if self._closed:
                raise InvalidArgumentError(f"{name}: the allocator is closed")
            return call()

    def mark_step(self) -> int:
        """A step boundary; returns a :class:`~.plan.MarkResult` value."""
        return int(self._plan_operation("mark_step", self._plan.mark))

    def start_plan_warmup(self) -> bool:
        """Begin the memory-first warm-up before the first mark (Note [A memory-first warm-up] in :mod:`.plan`);
        whether it is on."""
        return self._plan_operation("start_plan_warmup", self._plan.start_warmup)

    def stop_plan_warmup(self) -> bool:
        """Stop the memory-first warm-up as if it had not begun (Note [A memory-first warm-up] in :mod:`.plan`);
        whether it was on."""
        return self._plan_operation("stop_plan_warmup", self._plan.stop_warmup)

    def step_template(self, missing_ok: bool = False) -> tuple[list[int], list[int], list[int], list[int], int] | None:
        """The READY step: (requested bytes, streams, free rank in its step, free rank in the next, generation);
        None with ``missing_ok`` when no step waits."""
        with self._lock:
            t = self._plan.template(missing_ok)
            if t is None:
                return None
            return (t.nbytes.tolist(), [int(x) for x in t.streams], t.free_own.tolist(), t.free_next.tolist(),
                    self._plan.generation)

    def install_plan(self, offsets: list[int], generation: int | None = None) -> bool:
        """Install the plan of the READY step (:meth:`.plan.StepPlan.install`); False: ``generation`` is stale."""
        generation = check_generation(generation)
        with self._operation():
            if self._closed:
                raise InvalidArgumentError("install_plan: the allocator is closed")
            return self._plan.install(offsets, generation)

    def step_plan_info(self) -> tuple[int, ...]:
        """The plan layer's counters (:class:`~.plan.PlanInfo`)."""
        with self._lock:
            return self._plan.info().values

    def set_step_record_limit(self, records: int) -> None:
        """Records a recorded step may hold before it is abandoned (Note [When marks stop] in :mod:`.plan`)."""
        records = check_record_limit(records)
        with self._lock:
            self._plan.set_record_limit(records)

    def set_early_leave_steps(self, steps: int) -> None:
        """Planned steps within which a leave drops the plan (Note [A plan that leaves early] in :mod:`.plan`)."""
        with self._lock:
            self._plan.set_early_leave_steps(steps)

    def history(self, label: str):  # -> gpumem.trace.Trace
        if self._recorder is None:
            raise no_history_error()
        with self._lock:
            trace = self._recorder.to_trace(label)
            trace.segment_events = list(self._recorder.segment_events)  # type: ignore[attr-defined]
            return trace

    def close(self) -> int:
        """Note [Closing waits for the streams] in :mod:`.caching`."""
        with self._defer(), self._lock:
            if self._closed:
                return self.backing.reserved_nbytes + self._plan.mapped_nbytes
            self._closed = True
            if self._live:
                log.info("closing an allocator with %d live block(s)", len(self._live))
            failed: set[int] = set()
            all_streams: set[int] = set()
            if self.backing.reserved_nbytes or self.backing.n_segments:
                all_streams = self._streams_in_use()
                for s in sorted(all_streams):
                    try:
                        self.device.stream_synchronize(s)
                    except Exception as exc:  # noqa: BLE001 - that stream's memory is kept, below
                        log.debug("could not synchronize stream %d before closing: %s", s, exc)
                        failed.add(s)
                if failed:
                    try:
                        self.device.synchronize()
                        failed.clear()
                    except Exception as exc:  # noqa: BLE001
                        log.warning("could not synchronize streams %s before closing: %s", sorted(failed), exc)

            try:
                self._plan.close()
            except Exception as exc:  # noqa: BLE001 - the arena's pages stay counted as leaked
                log.warning("could not give the step plan's arena back: %s", exc)

            def keep(seg: Segment) -> bool:
                if not failed:
                    return False
                if isinstance(seg, VirtualSegment):
                    return True  # a range is shared by all streams: any of them may still use it
                return bool(self._segment_streams(seg) & failed)

            self.backing.close(keep)
            if self._recorder is not None:
                self.backing.sync_export()
            self.fences.close()
            self._live.clear()
            self._pending.clear()
            self._free_lists.clear()
            # live blocks are invalid from here: the counters say so (they said the bytes of the blocks dropped)
            self._stats.allocated_nbytes = self._stats.requested_nbytes = 0
            leaked = self.backing.reserved_nbytes + self._plan.mapped_nbytes
            if leaked:
                why = (f"work on streams {sorted(failed)} may still use it" if failed
                       else "giving it back failed")
                log.warning("closed with %s still held on %s (%d segment(s)/range(s)) and not given back: %s",
                            format_bytes(leaked), self.device.spec, self.backing.n_segments, why)
            return leaked

    def _streams_in_use(self) -> set[int]:
        """Every stream whose work may touch memory this allocator holds."""
        streams: set[int] = {0}
        for (_, s) in self._free_lists:
            streams.add(s)
        for b in list(self._live.values()) + self._pending:
            streams.add(b.stream)
            streams.update(b.pending_streams or ())
            streams.update(b.fences or ())
        for seg in self.backing.segments_list():
            streams |= self._segment_streams(seg)
            if isinstance(seg, VirtualSegment):
                for table in (seg.dirty, seg.users):
                    for u in table.values():
                        streams.update((u,) if isinstance(u, int) else u)
                for pf in seg.page_fences.values():
                    streams.update(pf)
                streams.update(seg.top_fences or ())
        streams.update(self.fences.streams())
        return streams

    @staticmethod
    def _segment_streams(seg: Segment) -> set[int]:
        """The streams of the blocks tiling ``seg`` (and of their other-stream uses)."""
        streams = {seg.stream}
        b = seg.last
        while b is not None:
            streams.add(b.stream)
            streams.update(b.pending_streams or ())
            streams.update(b.fences or ())
            b = b.prev
        return streams


def _chain_problems(seg: Segment, head: Block | None, end: int, free_list_of: Callable[[Block], FreeList]) -> list[str]:
    """Blocks tile ``[seg.base, end)`` in order, each free one in its free list, live counts right."""
    problems: list[str] = []
    cursor = seg.base
    b = head
    prev = None
    live = 0
    while b is not None:
        if b.prev is not prev or b.addr != cursor or b.size <= 0 or b.segment is not seg:
            problems.append(f"block chain broken at {b!r} (expected {cursor:#x})")
            break
        if b.allocated:
            live += 1
        elif b.fences is not None or b.pending_streams:
            live += 1  # freed, waiting for other streams: still counted by the backing
        elif b not in free_list_of(b):
            problems.append(f"free block {b!r} is in no free list")
        cursor = b.addr + b.size
        prev = b
        b = b.next
    if prev is not getattr(seg, "last", prev):
        problems.append(f"segment {seg.base:#x}: last block is not the end of the chain")
    if cursor != end:
        problems.append(f"blocks of segment {seg.base:#x} end at {cursor:#x}, expected {end:#x}")
    if isinstance(seg, Segment) and not isinstance(seg, VirtualSegment) and live != seg.live:
        problems.append(f"segment {seg.base:#x} counts {seg.live} live blocks, its chain has {live}")
    return problems
