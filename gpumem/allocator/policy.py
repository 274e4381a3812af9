"""Named allocator policies: gpumem's own and models of the allocators people use.

A policy is data, not code: the :class:`~gpumem.allocator.caching.CachingAllocator`
reads it to decide how to round, which pool a request goes to, how large a new
segment is, when a free block may be split, and whether memory comes from
``cudaMalloc``-style segments or from virtual memory. Comparing allocators is
then comparing policies on one engine, on the same trace and device.

============  ==================================================================
``gpumem``    the default: virtual memory where the device supports it (page-granular
              physical backing, stitched from any free chunk), else ``bestfit``
``bestfit``   a plain best-fit cache without virtual memory: segments of the request
              rounded up to the granularity, any remainder split off
``pytorch``   a model of PyTorch's default CUDACachingAllocator: 2 MiB small segments,
              20 MiB segments for requests under 10 MiB, larger ones rounded to 2 MiB;
              large blocks split only when more than 1 MiB remains
``cupy``      a model of CuPy's MemoryPool: one ``cudaMalloc`` of the rounded request
              per segment, best-fit with splitting, no small/large distinction
============  ==================================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..units import MiB, align_up


class VmmMode(str, enum.Enum):
    """Whether a policy backs memory with CUDA virtual memory management."""

    AUTO = "auto"
    """Virtual memory where the device supports it, segments elsewhere."""
    ALWAYS = "always"
    """Virtual memory or an error."""
    NEVER = "never"
    """Always ``malloc``'d segments."""


class GrowthRule(str, enum.Enum):
    """How the virtual-memory backing sizes the physical chunks it creates (Note [Chunks of several pages]
    in :mod:`.backing`)."""

    PAGES = "pages"
    """Every chunk is one page (the granularity); an empty page is stolen before a chunk is created
    (the behaviour before issue 7, kept for comparison)."""
    CHUNKS = "chunks"
    """A chunk covers a whole run of pages a block needs (capped), grows ahead at the top of a range,
    and moves whole; chunks are created while the held memory stays within ``page_slack`` of the most
    pages live data touched, and stolen only past that."""


class SegmentRule(str, enum.Enum):
    """How large a new segment is for a request of ``n`` bytes (segment mode only)."""

    GRANULAR = "granular"
    """``n`` rounded up to the device granularity (2 MiB)."""
    PYTORCH = "pytorch"
    """Small pool: 2 MiB. Large: 20 MiB under 10 MiB, else ``n`` rounded up to 2 MiB."""
    EXACT = "exact"
    """Exactly ``n`` (already rounded to ``round_nbytes``), as CuPy's pool does."""


@dataclass(frozen=True)
class AllocatorPolicy:
    """Every knob of the caching allocator, with a name for reports."""

    name: str
    description: str
    vmm: VmmMode = VmmMode.AUTO
    round_nbytes: int = 512
    small_max_nbytes: int = 1 * MiB
    """Requests up to this size go to the small pool."""
    separate_small_pool: bool = True
    """Keep small requests in their own pool (segments or virtual range)."""
    segment_rule: SegmentRule = SegmentRule.GRANULAR
    small_segment_nbytes: int = 2 * MiB
    min_split_small_nbytes: int = 512
    """Split a small-pool block when at least this much would remain."""
    min_split_large_nbytes: int = 512
    """Split a large-pool block when at least this much would remain."""
    va_reserve_factor: float = 2.0
    """Virtual memory mode: address space reserved per pool and stream, as a multiple of device memory."""
    steal_empty_pages: bool = True
    """Virtual memory mode: remap a cached empty page rather than create a new physical chunk."""
    page_slack: float = 0.005
    """Virtual memory mode: physical memory may exceed the most pages live data ever touched by this
    fraction before empty pages are stolen (fewer device calls for a little more memory; Note [Chunks
    of several pages] in :mod:`.backing`). The behaviour before issue 7: 0 with ``growth=PAGES``."""
    growth: GrowthRule = GrowthRule.CHUNKS
    """Virtual memory mode: how physical chunks are sized and moved (:class:`GrowthRule`)."""
    chunk_max_fraction: float = 1 / 256
    """``growth=CHUNKS``: a new chunk holds at most this fraction of the memory held then (at least one
    page), so that memory locked in partly live chunks stays small."""
    chunk_max_nbytes: int = 1 << 30
    """``growth=CHUNKS``: and at most this many bytes."""
    grow_ahead_fraction: float = 0.0
    """``growth=CHUNKS``: a chunk created for a run that ends at the top of a range is extended past it
    to this fraction of the memory held (within ``page_slack``, ``chunk_max_*`` and unmapped address
    space), so that the next blocks grown at the top find their pages mapped. Off by default: on the
    traces it saved no calls (``reports/growth-sweep.md``)."""

    def __post_init__(self) -> None:
        if self.round_nbytes <= 0 or self.round_nbytes & (self.round_nbytes - 1):
            raise InvalidArgumentError("round_nbytes must be a positive power of two")
        if self.va_reserve_factor < 1.0:
            raise InvalidArgumentError("va_reserve_factor must be at least 1")
        if not isinstance(self.growth, GrowthRule):
            try:
                object.__setattr__(self, "growth", GrowthRule(self.growth))
            except ValueError:
                raise InvalidArgumentError(f"unknown growth rule {self.growth!r}; choose one of "
                                           f"{', '.join(r.value for r in GrowthRule)}") from None
        for knob in ("page_slack", "chunk_max_fraction", "grow_ahead_fraction"):
            value = getattr(self, knob)
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"{knob} must be between 0 and 1, not {value!r}")
        if self.chunk_max_nbytes <= 0:
            raise InvalidArgumentError("chunk_max_nbytes must be positive")

    def round(self, nbytes: int) -> int:
        """The block size for a request of ``nbytes``."""
        return align_up(nbytes, self.round_nbytes)

    def segment_nbytes(self, small: bool, nbytes: int, granularity: int) -> int:
        """The size of a new segment for a (rounded) request of ``nbytes`` in segment mode."""
        rule = self.segment_rule
        if rule is SegmentRule.EXACT:
            return nbytes
        if small and self.separate_small_pool and nbytes <= self.small_segment_nbytes:
            return self.small_segment_nbytes
        if rule is SegmentRule.PYTORCH:
            return 20 * MiB if nbytes < 10 * MiB else align_up(nbytes, 2 * MiB)
        return align_up(nbytes, granularity)


POLICIES: dict[str, AllocatorPolicy] = {
    p.name: p
    for p in (
        AllocatorPolicy(
            "gpumem",
            "gpumem default: virtual memory with page-granular, stitched physical backing",
            vmm=VmmMode.AUTO,
        ),
        AllocatorPolicy(
            "bestfit",
            "plain best-fit cache without virtual memory (granular segments, any split)",
            vmm=VmmMode.NEVER,
        ),
        AllocatorPolicy(
            "pytorch",
            "model of PyTorch's default CUDACachingAllocator (2/20 MiB segments, split > 1 MiB)",
            vmm=VmmMode.NEVER,
            segment_rule=SegmentRule.PYTORCH,
            min_split_large_nbytes=1 * MiB + 1,
        ),
        AllocatorPolicy(
            "cupy",
            "model of CuPy's MemoryPool (a cudaMalloc per rounded request, best-fit, split)",
            vmm=VmmMode.NEVER,
            separate_small_pool=False,
            segment_rule=SegmentRule.EXACT,
        ),
    )
}

DEFAULT_POLICY = "gpumem"


def get_policy(name: "str | AllocatorPolicy") -> AllocatorPolicy:
    """The named policy (``gpumem``, ``bestfit``, ``pytorch``, ``cupy``), or ``name`` if already a policy."""
    if isinstance(name, AllocatorPolicy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown allocator policy {name!r}; choose one of {', '.join(POLICIES)}") from None
