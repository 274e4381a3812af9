"""Allocator statistics and the ``memory_summary()`` table.

The names follow ``torch.cuda.memory_stats`` where a counterpart exists:

* *allocated*: bytes in live blocks (sizes after rounding); *requested*: what callers asked for;
* *reserved*: device memory the allocator holds (segments, or mapped and cached physical chunks);
* *active*: allocated plus blocks freed but waiting for a stream sync point;
* *inactive split*: free bytes inside memory that also holds live data (unusable for
  a request larger than the holes);
* *external fragmentation*: ``1 - largest free block / total free``: 0 when all cached
  memory could serve one request, towards 1 when it is scattered in small holes;
* *overhead*: ``peak reserved / peak requested - 1``: what the allocator held beyond the
  program's live data at its worst moment (the figure the benchmarks compare).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ..units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .plan import PlanInfo
    from .policy import AllocatorPolicy


@dataclass
class AllocatorStats:
    """Counters kept by :class:`~gpumem.allocator.caching.CachingAllocator`."""

    allocated_nbytes: int = 0
    requested_nbytes: int = 0
    reserved_nbytes: int = 0
    active_nbytes: int = 0
    inactive_split_nbytes: int = 0
    largest_free_nbytes: int = 0
    peak_allocated_nbytes: int = 0
    peak_requested_nbytes: int = 0
    peak_reserved_nbytes: int = 0
    num_allocs: int = 0
    num_frees: int = 0
    num_live_blocks: int = 0
    num_free_blocks: int = 0
    num_segments: int = 0
    num_splits: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_gc_releases: int = 0
    device_calls: int = 0
    """Memory calls made (malloc, free, reserve, create, map, set access, unmap, release)."""
    event_calls: int = 0
    """Event calls made for stream-ordered frees (record, query, synchronize, destroy)."""
    plan_free_nbytes: int = 0
    """A step plan's arenas' mapped bytes no live allocation holds: reserved, but no cache any request of the
    engine can take (Note [The step plan's arena in the summary])."""

    def copy(self) -> "AllocatorStats":
        return replace(self)

    def count_allocation(self, size: int, nbytes: int, reserved_nbytes: int) -> None:
        """Count a block of ``size`` bytes handed out for a request of ``nbytes``, with ``reserved_nbytes``
        held from the device now, and raise the peaks it passes."""
        self.allocated_nbytes += size
        self.requested_nbytes += nbytes
        self.num_allocs += 1
        if self.allocated_nbytes > self.peak_allocated_nbytes:
            self.peak_allocated_nbytes = self.allocated_nbytes
        if self.requested_nbytes > self.peak_requested_nbytes:
            self.peak_requested_nbytes = self.requested_nbytes
        if reserved_nbytes > self.peak_reserved_nbytes:
            self.peak_reserved_nbytes = reserved_nbytes

    @property
    def free_nbytes(self) -> int:
        """Reserved bytes not in live blocks."""
        return self.reserved_nbytes - self.allocated_nbytes

    @property
    def external_fragmentation(self) -> float:
        """``1 - largest free block / total free`` (0 when nothing is free). Free here is reserved less
        *active*: a block freed but waiting for its stream's work (``record_stream``) is not free yet; nor is
        a step plan's arena's free space, which is no cache (``plan_free_nbytes``)."""
        free = self.reserved_nbytes - max(self.active_nbytes, self.allocated_nbytes) - self.plan_free_nbytes
        return 0.0 if free <= 0 else max(0.0, 1.0 - self.largest_free_nbytes / free)

    @property
    def overhead(self) -> float:
        """``peak reserved / peak requested - 1`` (0 before any allocation)."""
        if self.peak_requested_nbytes == 0:
            return 0.0
        return self.peak_reserved_nbytes / self.peak_requested_nbytes - 1.0

    def as_dict(self) -> dict[str, int | float]:
        d: dict[str, int | float] = dict(asdict(self))
        d["free_nbytes"] = self.free_nbytes
        d["external_fragmentation"] = self.external_fragmentation
        d["overhead"] = self.overhead
        return d


def format_summary(st: AllocatorStats, policy: "AllocatorPolicy", device_spec: str, backing: str,
                   plan: "PlanInfo | None" = None, vmm: bool = True) -> str:
    """The text table behind ``memory_summary()``.

    Note [The step plan's arena in the summary]: a step plan's arena (``plan``, Note [Step plans] in
    :mod:`.plan`) is device memory the engine's cache does not own: its mapped bytes count in *Reserved*
    and its live allocations in *Allocated* (as ``memory_stats()`` and the peaks count them), but its free
    bytes are no cached block any request of the engine could take, and the backing line (the engine's
    chunks) does not hold it. Counted as cache, a planned step's arena read as ``Cached, free`` with
    ``Largest free block 0 B``: 100 % fragmentation of a cache that has none. So the table names the arena
    on a line of its own (state, slots, mapped, live), and *Cached, free*, *Inactive split*, *Largest free
    block* and *External fragmentation* are the engine's cache alone: the arena's free bytes
    (``mapped - live``) taken out, and so are blocks freed but still waiting for their streams' work
    (*Active* less *Allocated*), which no request can take yet. ``vmm``: whether ``st.inactive_split_nbytes`` is the virtual-memory
    engines' ``free - mapped empty - unmapped``, which counts the arena's free bytes (the segment backing's
    free lists never do). *Live blocks* counts the arenas' live allocations, the current plan's and those
    still live in the arenas of dropped plans (a dropped arena stays until its last one is freed), as
    *Allocated* counts their bytes: the engines' ``num_live_blocks`` counted the engine's blocks only, so a
    planned step's live tensors (and a kept one pinning a dropped arena) were missing from the count while
    their bytes were in *Allocated*, and ``gpumem_torch_pool_delete`` (which refuses a pool with live
    blocks) did not see them.
    """
    arena_free = 0
    if plan is not None:
        arena_free = max(0, plan.mapped_nbytes - plan.live_nbytes)
    pending = max(0, st.active_nbytes - st.allocated_nbytes)   # freed, waiting for their streams: not cached yet
    free = max(0, st.free_nbytes - pending - arena_free)
    inactive = max(0, st.inactive_split_nbytes - arena_free) if vmm else st.inactive_split_nbytes
    largest = min(st.largest_free_nbytes, free)
    fragmentation = 0.0 if free <= 0 else max(0.0, 1.0 - largest / free)
    rows = [
        ("Allocated", st.allocated_nbytes, st.peak_allocated_nbytes),
        ("Requested", st.requested_nbytes, st.peak_requested_nbytes),
        ("Reserved", st.reserved_nbytes, st.peak_reserved_nbytes),
        ("Active", st.active_nbytes, None),
        ("Cached, free", free, None),
        ("Inactive split", inactive, None),
        ("Largest free block", largest, None),
    ]
    width = 66
    lines = [
        "=" * width,
        f" gpumem memory summary: {device_spec}, policy '{policy.name}'",
        f" backing: {backing}",
    ]
    if plan is not None and (plan.state != 0 or plan.mapped_nbytes):
        lines.append(f" step plan: {plan.state_name}, {plan.slots} slots, arena {format_bytes(plan.mapped_nbytes)} "
                     f"mapped, {format_bytes(plan.live_nbytes)} live (in Reserved and Allocated, not in the "
                     f"cache's rows)")
    lines += [
        "-" * width,
        f" {'Metric':<22}{'Current':>21}{'Peak':>21}",
        "-" * width,
    ]
    for name, cur, peak in rows:
        lines.append(f" {name:<22}{format_bytes(cur):>21}{(format_bytes(peak) if peak is not None else ''):>21}")
    lines.append("-" * width)
    counts = [
        ("Allocations", st.num_allocs), ("Frees", st.num_frees), ("Live blocks", st.num_live_blocks),
        ("Free blocks", st.num_free_blocks), ("Segments", st.num_segments), ("Splits", st.num_splits),
        ("Cache hits", st.cache_hits), ("Cache misses", st.cache_misses), ("Retries", st.num_alloc_retries),
        ("OOMs", st.num_ooms), ("Device calls", st.device_calls), ("Event calls", st.event_calls),
    ]
    for name, value in counts:
        lines.append(f" {name:<22}{value:>21,}")
    lines.append("-" * width)
    lines.append(f" {'External fragmentation':<22}{fragmentation:>21.2%}")
    lines.append(f" {'Peak overhead':<22}{st.overhead:>21.2%}")
    lines.append("=" * width)
    return "\n".join(lines)
