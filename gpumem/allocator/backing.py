"""Where an allocator's memory comes from: ``malloc``'d segments or virtual memory.

The :class:`~gpumem.allocator.caching.CachingAllocator` does best fit, splitting
and coalescing over blocks; a *backing* supplies the segments those blocks tile
and makes their memory real. Both backings speak only the
:class:`~gpumem.device.Device` interface.

:class:`SegmentBacking`
    The classic design (PyTorch's default, CuPy's pool): a segment is one
    ``device.malloc``; its memory is held, whole, until the segment is released.

:class:`VirtualBacking`
    One reserved virtual range per pool and stream, which only grows at its top;
    physical memory is mapped page by page (the device granularity, 2 MiB) under
    the pages that live blocks touch.

Note [Virtual memory: pages follow live data]
---------------------------------------------
PyTorch's expandable segments map physical memory under a growing segment, but
only give it back when a whole segment tail falls free, and GMLake stitches
non-contiguous physical chunks under one large block. gpumem combines both at
page granularity: every page of the virtual range has a count of live blocks
touching it; a page is mapped while that count is above zero. When a page falls
empty it stays mapped (a free block there is reused with no device call, as in
any caching allocator), but it is *stealable*: when another block needs a page
that is not mapped, the backing takes a physical chunk from its cache of unmapped
chunks, else unmaps an empty page anywhere and maps its chunk where it is needed
(stitching), and only creates a new chunk when there is none. So the physical
memory held never exceeds the largest number of pages live data has touched at
any moment: fragmentation of the address space costs address space, which is
plentiful, not memory. What remains is the partial pages at the edges of live
data, which best fit keeps few.

Note [Why every chunk is one page]
----------------------------------
Chunks of a single granule can back any page, so any empty page can be stolen
for any block. Larger chunks would need fewer ``cuMemMap`` calls for large blocks
but could only move whole; the map calls are paid only when pages change hands,
which the reuse of mapped free blocks keeps rare.
"""

from __future__ import annotations

import abc
import heapq
import logging
from array import array
from typing import Callable

from ..device import Device, PhysicalHandle
from ..errors import OutOfMemoryError
from .block import Block, FreeList
from .policy import AllocatorPolicy

log = logging.getLogger(__name__)

FreeListLookup = Callable[[Block], FreeList]


class Segment:
    """A stretch of device addresses tiled by blocks."""

    __slots__ = ("base", "nbytes", "small", "stream")

    def __init__(self, base: int, nbytes: int, small: bool, stream: int) -> None:
        self.base = base
        self.nbytes = nbytes
        self.small = small
        self.stream = stream


class LimitExceeded(OutOfMemoryError):
    """Growing would take the allocator past its memory limit."""


class Backing(abc.ABC):
    """Supplies segments and physical memory to a caching allocator."""

    def __init__(self, device: Device, policy: AllocatorPolicy, limit_nbytes: int | None) -> None:
        self.device = device
        self.policy = policy
        self.limit_nbytes = limit_nbytes
        self.granularity = device.granularity_nbytes
        self.reserved_nbytes = 0
        self.n_segments = 0
        self.device_calls = 0
        self.on_segment: Callable[[str, int, int, int], None] | None = None
        """Called as ``on_segment(action, addr, nbytes, stream)`` for history recording."""

    def _check_limit(self, extra_nbytes: int, requested: int) -> None:
        if self.limit_nbytes is not None and self.reserved_nbytes + extra_nbytes > self.limit_nbytes:
            info = self.device.mem_info()
            raise LimitExceeded(requested, info.free_nbytes, info.total_nbytes, device=self.device.spec,
                                limit_nbytes=self.limit_nbytes)

    def _segment_event(self, action: str, addr: int, nbytes: int, stream: int) -> None:
        if self.on_segment is not None:
            self.on_segment(action, addr, nbytes, stream)

    @abc.abstractmethod
    def grow(self, small: bool, stream: int, nbytes: int, tail: Block | None) -> Block:
        """Return a free block (in no free list) of at least ``nbytes`` for this pool and stream.

        ``tail`` is this pool's and stream's free block at the top of its growable segment, if
        the backing reported one (virtual mode); the caller has removed it from its free list.
        """

    @abc.abstractmethod
    def tail_block(self, small: bool, stream: int) -> Block | None:
        """The free block that :meth:`grow` would extend, if any."""

    @abc.abstractmethod
    def commit(self, block: Block) -> None:
        """Make a just-allocated block's memory usable; on failure raise and change nothing."""

    @abc.abstractmethod
    def decommit(self, block: Block) -> None:
        """A block was freed."""

    @abc.abstractmethod
    def release_cached(self, free_list_of: FreeListLookup) -> int:
        """Give back to the device the memory that holds no live data; return the bytes released."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give everything back (the allocator has no live blocks, or no longer cares)."""

    def largest_free_nbytes(self, free_lists: list[FreeList]) -> int:
        """The largest request servable without new device memory."""
        return max((fl.largest() for fl in free_lists), default=0)

    def describe(self) -> str:
        return type(self).__name__


class SegmentBacking(Backing):
    """Segments from ``device.malloc``; see the module docstring."""

    def __init__(self, device: Device, policy: AllocatorPolicy, limit_nbytes: int | None) -> None:
        super().__init__(device, policy, limit_nbytes)
        self.segments: dict[int, Segment] = {}
        self._heads: dict[int, Block] = {}

    def tail_block(self, small: bool, stream: int) -> Block | None:
        return None

    def grow(self, small: bool, stream: int, nbytes: int, tail: Block | None) -> Block:
        seg_nbytes = self.policy.segment_nbytes(small, nbytes, self.granularity)
        self._check_limit(seg_nbytes, nbytes)
        ptr = self.device.malloc(seg_nbytes)
        self.device_calls += 1
        seg = Segment(ptr, seg_nbytes, small, stream)
        self.segments[ptr] = seg
        self.reserved_nbytes += seg_nbytes
        self.n_segments += 1
        block = Block(ptr, seg_nbytes, stream, seg)
        self._heads[ptr] = block
        self._segment_event("segment_alloc", ptr, seg_nbytes, stream)
        return block

    def commit(self, block: Block) -> None:
        return None

    def decommit(self, block: Block) -> None:
        return None

    def release_cached(self, free_list_of: FreeListLookup) -> int:
        released = 0
        for base, seg in list(self.segments.items()):
            head = self._heads[base]
            if head.allocated or head.pending_streams or head.size != seg.nbytes:
                continue  # holds live data, or was freed but waits for a stream sync point
            free_list_of(head).remove(head)
            self.device.free(base)
            self.device_calls += 1
            del self.segments[base]
            del self._heads[base]
            self.reserved_nbytes -= seg.nbytes
            self.n_segments -= 1
            released += seg.nbytes
            self._segment_event("segment_free", base, seg.nbytes, seg.stream)
        return released

    def close(self) -> None:
        for base, seg in list(self.segments.items()):
            try:
                self.device.free(base)
            except Exception as exc:  # noqa: BLE001 - closing gives back what it can
                log.warning("could not free segment %#x: %s", base, exc)
        self.segments.clear()
        self._heads.clear()
        self.reserved_nbytes = 0
        self.n_segments = 0

    def describe(self) -> str:
        return f"segments ({self.n_segments} live, rule={self.policy.segment_rule.value})"


class VirtualSegment(Segment):
    """A reserved virtual range that grows at its top, mapped page by page."""

    __slots__ = ("top", "last", "refs", "chunks", "empty")

    def __init__(self, base: int, nbytes: int, small: bool, stream: int, granularity: int) -> None:
        super().__init__(base, nbytes, small, stream)
        self.top = 0
        """Bytes from ``base`` tiled by blocks."""
        self.last: Block | None = None
        n_pages = nbytes // granularity
        self.refs = array("l", bytes(8 * n_pages)) if array("l").itemsize == 8 else array("q", bytes(8 * n_pages))
        """Live blocks touching each page."""
        self.chunks: list[PhysicalHandle | None] = [None] * n_pages
        """The physical chunk mapped at each page, if any."""
        self.empty: dict[int, None] = {}
        """Pages mapped but touched by no live block (insertion-ordered: oldest first)."""


class VirtualBacking(Backing):
    """Virtual ranges with page-granular physical backing; see Note [Virtual memory: pages follow live data]."""

    def __init__(self, device: Device, policy: AllocatorPolicy, limit_nbytes: int | None) -> None:
        super().__init__(device, policy, limit_nbytes)
        total = device.properties().total_nbytes
        g = self.granularity
        self.va_nbytes = -(-int(total * policy.va_reserve_factor) // g) * g
        self.vsegments: dict[tuple[bool, int], VirtualSegment] = {}
        self.unmapped: list[PhysicalHandle] = []
        """Physical chunks held but mapped nowhere."""
        self.n_chunks = 0
        self.n_steals = 0
        self.n_syncs = 0
        self.live_pages = 0
        """Pages touched by at least one live block, over all ranges."""
        self.peak_live_pages = 0

    def _segment(self, small: bool, stream: int) -> VirtualSegment:
        key = (small and self.policy.separate_small_pool, stream)
        seg = self.vsegments.get(key)
        if seg is None:
            base = self.device.address_reserve(self.va_nbytes)
            self.device_calls += 1
            seg = VirtualSegment(base, self.va_nbytes, key[0], stream, self.granularity)
            self.vsegments[key] = seg
            self.n_segments += 1
        return seg

    def tail_block(self, small: bool, stream: int) -> Block | None:
        seg = self.vsegments.get((small and self.policy.separate_small_pool, stream))
        if seg is None or seg.last is None or seg.last.allocated or seg.last.pending_streams:
            return None
        return seg.last

    def grow(self, small: bool, stream: int, nbytes: int, tail: Block | None) -> Block:
        seg = self._segment(small, stream)
        if tail is not None:
            extra = nbytes - tail.size
            if seg.top + extra > seg.nbytes:
                raise self._va_exhausted(nbytes)
            seg.top += extra
            tail.size = nbytes
            return tail
        if seg.top + nbytes > seg.nbytes:
            raise self._va_exhausted(nbytes)
        block = Block(seg.base + seg.top, nbytes, stream, seg)
        block.prev = seg.last
        if seg.last is not None:
            seg.last.next = block
        seg.last = block
        seg.top += nbytes
        return block

    def _va_exhausted(self, nbytes: int) -> OutOfMemoryError:
        info = self.device.mem_info()
        return OutOfMemoryError(nbytes, info.free_nbytes, info.total_nbytes, device=self.device.spec,
                                hint="The allocator's virtual range is exhausted; raise va_reserve_factor.")

    # -- pages ------------------------------------------------------------------------------
    def _pages(self, block: Block) -> tuple[VirtualSegment, int, int]:
        """The block's range and the first and last page indices it touches."""
        seg: VirtualSegment = block.segment  # type: ignore[assignment]
        g = self.granularity
        return seg, (block.addr - seg.base) // g, (block.addr + block.size - 1 - seg.base) // g

    def commit(self, block: Block) -> None:
        seg, first, last = self._pages(block)
        refs = seg.refs
        if first == last and refs[first]:
            refs[first] += 1  # the common case: a page already holding live data
            return
        chunks = seg.chunks
        need = [p for p in range(first, last + 1) if refs[p] == 0 and chunks[p] is None]
        if need:
            self._map_pages(seg, need, first, last, block.size)
        empty = seg.empty
        for p in range(first, last + 1):
            if refs[p] == 0:
                empty.pop(p, None)
                self.live_pages += 1
            refs[p] += 1
        if self.live_pages > self.peak_live_pages:
            self.peak_live_pages = self.live_pages

    def decommit(self, block: Block) -> None:
        seg, first, last = self._pages(block)
        refs = seg.refs
        for p in range(first, last + 1):
            refs[p] -= 1
            if refs[p] == 0:
                seg.empty[p] = None
                self.live_pages -= 1

    def _stealable(self, seg: VirtualSegment, first: int, last: int) -> int:
        own = sum(1 for p in range(first, last + 1) if p in seg.empty) if seg.empty else 0
        return sum(len(s.empty) for s in self.vsegments.values()) - own

    def _map_pages(self, seg: VirtualSegment, need: list[int], first: int, last: int, requested: int) -> None:
        """Map a physical chunk under each page in ``need``; all or nothing."""
        g = self.granularity
        shortfall = len(need) - len(self.unmapped)
        if shortfall > 0 and self.policy.steal_empty_pages:
            # Create freely up to the slack above the most pages live data ever touched; past it, steal.
            touched = max(self.peak_live_pages, self.live_pages + len(need))
            allowance = int(touched * (1.0 + self.policy.page_slack)) - self.n_chunks
            creatable = max(0, min(shortfall, allowance))
            shortfall = max(creatable, shortfall - self._stealable(seg, first, last))
        created: list[PhysicalHandle] = []
        if shortfall > 0:
            self._check_limit(shortfall * g, requested)
            try:
                for _ in range(shortfall):
                    created.append(self.device.mem_create(g))
                    self.device_calls += 1
            except BaseException:
                for h in created:
                    self.device.mem_release(h)
                raise
            self.unmapped.extend(created)
            self.n_chunks += len(created)
            self.reserved_nbytes += len(created) * g
        n_steal = len(need) - len(self.unmapped)
        if n_steal > 0:
            self.unmapped.extend(self._steal(seg, first, last, n_steal))
        mapped: list[int] = []
        try:
            for p in need:
                handle = self.unmapped.pop()
                va = seg.base + p * g
                try:
                    self.device.mem_map(va, g, handle, 0)
                except BaseException:
                    self.unmapped.append(handle)
                    raise
                seg.chunks[p] = handle
                mapped.append(p)
                self.device_calls += 1
            # one access call per contiguous run of newly mapped pages
            run_start = prev = mapped[0]
            for p in mapped[1:] + [None]:  # type: ignore[list-item]
                if p is not None and p == prev + 1:
                    prev = p
                    continue
                self.device.mem_set_access(seg.base + run_start * g, (prev - run_start + 1) * g)
                self.device_calls += 1
                if p is not None:
                    run_start = prev = p
        except BaseException:
            for p in mapped:  # undo: unmap what this call mapped, keep the chunks cached
                handle = seg.chunks[p]
                seg.chunks[p] = None
                self.device.mem_unmap(seg.base + p * g, g)
                assert handle is not None
                self.unmapped.append(handle)
            raise

    def _steal(self, seg: VirtualSegment, first: int, last: int, count: int) -> list[PhysicalHandle]:
        """Unmap ``count`` empty pages (none of ``[first, last]`` of ``seg``) and return their chunks.

        The highest-addressed empty pages go first: best fit breaks ties towards low
        addresses, so live data gathers low and the pages it is least likely to want
        back soon are the high ones (this halved the steals on the gpt2 trace).
        """
        g = self.granularity
        candidates: list[tuple[int, int, VirtualSegment]] = []
        for other in self.vsegments.values():
            for p in heapq.nlargest(count + (last - first + 1), other.empty):
                if other is seg and first <= p <= last:
                    continue
                candidates.append((other.base + p * g, p, other))
        candidates.sort(reverse=True)
        handles: list[PhysicalHandle] = []
        synced = False
        for _, p, other in candidates[:count]:
            if other.stream != seg.stream and not synced:
                # the page's last user ran on another stream: wait for it before reuse
                self.device.synchronize()
                self.n_syncs += 1
                synced = True
            del other.empty[p]
            handle = other.chunks[p]
            other.chunks[p] = None
            assert handle is not None
            self.device.mem_unmap(other.base + p * g, g)
            self.device_calls += 1
            self.n_steals += 1
            handles.append(handle)
        if len(handles) < count:
            raise AssertionError("fewer stealable pages than counted")
        return handles

    # -- giving memory back ---------------------------------------------------------------------
    def release_cached(self, free_list_of: FreeListLookup) -> int:
        g = self.granularity
        released = 0
        for seg in self.vsegments.values():
            for p in list(seg.empty):
                handle = seg.chunks[p]
                seg.chunks[p] = None
                assert handle is not None
                self.device.mem_unmap(seg.base + p * g, g)
                self.device.mem_release(handle)
                self.device_calls += 2
                released += g
            seg.empty.clear()
            self._trim_top(seg, free_list_of)
        for handle in self.unmapped:
            self.device.mem_release(handle)
            self.device_calls += 1
            released += g
        self.unmapped.clear()
        self.n_chunks -= released // g
        self.reserved_nbytes -= released
        return released

    def _trim_top(self, seg: VirtualSegment, free_list_of: FreeListLookup) -> None:
        """Drop a free block at the top of the range, so the address space does not creep up."""
        last = seg.last
        if last is None or last.allocated or last.pending_streams:
            return
        free_list_of(last).remove(last)
        seg.top = last.addr - seg.base
        seg.last = last.prev
        if seg.last is not None:
            seg.last.next = None

    def close(self) -> None:
        g = self.granularity
        for seg in self.vsegments.values():
            for p, handle in enumerate(seg.chunks):
                if handle is not None:
                    try:
                        self.device.mem_unmap(seg.base + p * g, g)
                        self.device.mem_release(handle)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("could not unmap page %d: %s", p, exc)
            try:
                self.device.address_free(seg.base, seg.nbytes)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not free address range %#x: %s", seg.base, exc)
        for handle in self.unmapped:
            try:
                self.device.mem_release(handle)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not release chunk: %s", exc)
        self.vsegments.clear()
        self.unmapped.clear()
        self.reserved_nbytes = 0
        self.n_chunks = 0
        self.n_segments = 0

    def mapped_empty_nbytes(self) -> int:
        return sum(len(s.empty) for s in self.vsegments.values()) * self.granularity

    def largest_free_nbytes(self, free_lists: list[FreeList]) -> int:
        # any request up to the cached chunks can be stitched without new device memory
        cached = (len(self.unmapped) + sum(len(s.empty) for s in self.vsegments.values())) * self.granularity
        return max(super().largest_free_nbytes(free_lists), cached)

    def describe(self) -> str:
        return (f"virtual memory ({len(self.vsegments)} range(s) of {self.va_nbytes >> 30} GiB, "
                f"{self.n_chunks} chunks of {self.granularity >> 20} MiB, {self.n_steals} steals)")
