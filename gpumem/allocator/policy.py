"""Named allocator policies: gpumem's own and models of the allocators people use.

A policy is data, not code: the :class:`~gpumem.allocator.caching.CachingAllocator`
reads it to decide how to round, which pool a request goes to, how large a new
segment is, when a free block may be split, and whether memory comes from
``cudaMalloc``-style segments or from virtual memory. Comparing allocators is
then comparing policies on one engine, on the same trace and device.

==============  ==================================================================
``gpumem``      the default: virtual memory where the device supports it (page-granular
                physical backing, stitched from any free chunk), else ``bestfit``
``bestfit``     a plain best-fit cache without virtual memory: segments of the request
                rounded up to the granularity, any remainder split off
``pytorch``     a model of PyTorch's default CUDACachingAllocator: 2 MiB small segments,
                20 MiB segments for requests under 10 MiB, larger ones rounded to 2 MiB;
                large blocks split only when more than 1 MiB remains; among equal sizes
                the newest segment first (Note [Segments top-down])
``cupy``        a model of CuPy's MemoryPool: one ``cudaMalloc`` of the rounded request
                per segment, best-fit with splitting, no small/large distinction
``expandable``  a model of PyTorch's expandable segments
                (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): a virtual range per
                pool, mapped in pages of 2 MiB (small pool) / 20 MiB (large pool) at its
                end as it grows, best fit, any remainder of 512 B or more split off, and
                pages unmapped only by ``empty_cache`` or the out-of-memory retry
                (Note [Expandable segments])
==============  ==================================================================

Note [Expandable segments]
--------------------------
PyTorch's ``ExpandableSegment`` (``c10/cuda/CUDACachingAllocator.cpp``) reserves
address space of 1 1/8 times the device memory per stream and pool and maps
physical memory under it in pages of ``kSmallBuffer`` (2 MiB) for the small pool
and ``kLargeBuffer`` (20 MiB) for the large one. A request takes the best-fitting
*mapped* free block of its pool and stream; with none, the allocator takes the
lowest unmapped stretch of the stream's segment (with the free block just before
it) and maps the request's size rounded up to whole pages there, which at first
is always the end of the mapped part. With expandable segments
``should_split`` splits any remainder of at least ``kMinBlockSize`` (512 B) in
both pools. Freed blocks stay mapped; ``empty_cache`` (and the retry after a failed
map) unmaps the whole pages inside free blocks. The model is gpumem's virtual
backing with ``growth=PAGES``, no stealing (a page once mapped stays where it is
until the cache is released), pages of 2 / 20 MiB (``small_page_nbytes`` /
``large_page_nbytes``) and 1 1/8 of the device memory of address space. What
differs: gpumem shares one range per pool among streams (PyTorch: one segment per
stream and pool; free lists are per stream in both, so a single-stream trace is
replayed identically), and after a release gpumem's best fit may place a block
over any unmapped hole where PyTorch takes the lowest one large enough. It runs
on either engine (the native one: Note [Pages of a pool's own size] in ``gpumem/_native/engine.cpp``).

Note [Segments top-down]
------------------------
PyTorch's ``get_free_block`` takes ``lower_bound`` in a block set ordered by
``(stream, size, address)``: the smallest free block that fits and, among blocks
of that size, the *lowest address*. Which one that is depends on where
``cudaMalloc`` put the segments, and on the H200 (driver 580, CUDA 13) the driver
places each new segment *below* the earlier ones: the 111 ``segment_alloc``
entries of ``data/traces/llama_generate`` go from ``0x7f1dd6000000`` down to
``0x7f1c3a000000`` (the large ones all downwards; small ones fill gaps). So the tie
goes to the newest segment. The simulator hands out addresses upwards, so with
plain address order the model took the *oldest* one: on llama_generate, whose
generate() loop makes many blocks of one size (KV-cache ``torch.cat`` results,
prefill temporaries of one shape), that placed the 258 MiB prefill blocks in other
free blocks than PyTorch did, and the model ended one 258 MiB segment short of
PyTorch's 111 (12.8 % overhead against 20.0 % measured). Given the segments' real
addresses (replaying with a device that returns the trace's ``segment_alloc``
addresses) the model puts every one of the 439,138 allocations at PyTorch's address
and reserves exactly PyTorch's 4.18 GiB; with ``segments_top_down`` (each new
segment sorts below all earlier ones, contiguously; offsets inside a segment
ascending) it ends with the same 111 segments, 20.03 %, while gpt2, resnet and
bert stay at 18.06 %, 45.29 % and 24.31 % (measured 18.1, 45.3, 24.3). On a
generate() of the multi-head 7B at batch 16 x prompt 4096 recorded on the H200
(``tests/allocator/data/generate_7b_b16_p4096_n8.snapshot.pickle.gz``) the model
makes PyTorch's 76 segments, 62.79 GiB (55.08 GiB in address order).

Since 2026-11-29 the simulated device places segments as the driver does (Note
[Where the driver places a segment] in :mod:`gpumem.sim.device`: 32 MiB slots
handed out downwards, a slot's room filled upwards), and ``pytorch`` orders ties
by address, PyTorch's own rule, as every policy does: that keeps the four figures
above and the 76 segments, and makes exact what the top-down order missed, where
a later segment lies *above* an earlier one (a 7B decode of 3,000 tokens, 0.21 %
under live before; the tied Qwen2 generate row's recorded ops, 12 MiB over;
``llama_varlen_train_h200``, 2.49 % under). ``segments_top_down`` stays an
option (a device whose addresses only go up).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace

from ..errors import InvalidArgumentError
from ..units import MiB, align_up
from ..validate import check_int_in_range, check_real_in_range


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


WARMUP_CHUNKS = 4096
"""While a step plan's warm-up grows memory-first (:meth:`AllocatorPolicy.memory_first`), a new chunk holds
``1 / WARMUP_CHUNKS`` of the memory held, at least one page: about this many chunks at most, where one-page
chunks made every steal scan tens of thousands (attacker 14, F1)."""


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
    page_slack_min_nbytes: int = 4 * MiB
    """``growth=CHUNKS``: the slack is at least this many bytes (whole pages, rounded down), however little
    live data touched: ``page_slack`` alone rounds to no page under 200 pages (400 MiB of 2 MiB pages), where
    two pools taking turns at one page steal it back and forth at every allocation (Note [A slack of at
    least one page] in :mod:`.backing`)."""
    growth: GrowthRule = GrowthRule.CHUNKS
    """Virtual memory mode: how physical chunks are sized and moved (:class:`GrowthRule`)."""
    chunk_max_fraction: float = 1 / 256
    """``growth=CHUNKS``: a new chunk holds at most this fraction of the memory held then (at least one
    page), so that memory locked in partly live chunks stays small."""
    chunk_max_nbytes: int = 1 << 30
    """``growth=CHUNKS``: and at most this many bytes."""
    small_page_nbytes: int | None = None
    """Virtual memory mode with ``growth=PAGES`` and no stealing: the page size of the small pool's range
    (a multiple of the device granularity; None: the granularity). Note [Expandable segments]."""
    large_page_nbytes: int | None = None
    """Likewise for the large pool's range (PyTorch's expandable segments: 20 MiB)."""
    segments_top_down: bool = False
    """Segment mode: among free blocks of equal size, best fit takes the one of the newest segment (then
    the lowest offset in it), as PyTorch's lowest-address tie-break would where ``cudaMalloc`` placed each new
    segment below the earlier ones (Note [Segments top-down]). Off (every named policy): the lowest address the
    device gave, which on the simulated device is where the driver would have placed it."""
    grow_ahead_fraction: float = 0.0
    """``growth=CHUNKS``: a chunk created for a run that ends at the top of a range is extended past it
    to this fraction of the memory held (within ``page_slack``, ``chunk_max_*`` and unmapped address
    space), so that the next blocks grown at the top find their pages mapped. Off by default: on the
    traces it saved no calls (``reports/growth-sweep.md``)."""

    busy_slack: float = 0.05
    """``growth=CHUNKS``, past the slack: when every idle chunk that could be stolen is still used by queued
    GPU work, a chunk is created while the memory held stays within ``page_slack + busy_slack`` of the most
    pages live data touched, and past that the busy chunk is waited for (Note [Wait, do not grow, behind
    the GPU] in :mod:`.backing`). ``inf``: always create, waiting only when the device or the limit refuses
    (the rule before issue 18); 0: always wait."""

    stream_ordered_steal: bool = False
    """``growth=CHUNKS``, past the slack: an idle chunk whose pending work is all on the stream of the block
    that needs it is stolen at once, ordered after that work on the stream, instead of grown past or
    waited for: mapped under the new block first, its old mapping unmapped once its fence completes (Note
    [Stream-ordered steal] in :mod:`.backing`). Off (the default: it costs step time live where steps
    steal): the ``busy_slack`` rule alone; but on after a step plan's warm-up has ended (:attr:`steal_after_warmup`)
    and, where :attr:`steal_before_warmup` says so, before one begins."""

    wait_own_stream: bool = False
    """``growth=CHUNKS``, past the slack, when no idle chunk that could be stolen is free of queued GPU work: one
    whose pending work is all on the stream of the block that needs it (of the largest of those, the one whose
    fence the GPU reaches first: Note [Wait for the oldest fence] in :mod:`.backing`) is waited for and stolen,
    before the ``busy_slack`` rule may create a chunk; the ``busy_slack`` rule is left for chunks that other
    streams' work still uses (Note [Wait for the program's own stream] in :mod:`.backing`). Off (the default): it
    held single-stream inference at a fraction of the overhead live, but costs step time where steps steal (GPT-2
    training without step plans +4.8 % in the oldest fence's first version, +12 % before it; ResNet-50 +21 % and
    ViT +3.1 % as it is now); the ``busy_slack`` rule alone. With ``stream_ordered_steal`` on, that steal takes
    such a chunk first."""

    wait_on_gpu: bool = False
    """``growth=CHUNKS``, past the ``busy_slack`` rule's bound: the busy idle chunk that is stolen is waited for on
    the GPU, not the host: the stream that needs it waits (``stream_wait_event``) for the fences of the other streams
    still using it, and the chunk is mapped under the new block at once, its old mapping unmapped once those fences
    complete, as the stream-ordered steal does (Note [Wait on the GPU, not the host] in :mod:`.backing`). The same
    chunk is stolen as with the host's wait; the host does not stall, but the stream's later work runs after the
    other streams' (live on the H200, multistream_infer: steps 23.8 ms against 25.5-27.0, memory 10.74 % above peak
    allocated against 5.43 %). Off by default; ``GPUMEM_WAIT_ON_GPU=1`` for gpumem.torch."""

    plan_warmup: bool = True
    """``growth=CHUNKS`` with step plans: from the first ``mark_step()`` (or from ``start_plan_warmup()``, which
    automatic marks call before the first step) until a plan is installed, grow as the memory-first setting does
    (one-page chunks, no page slack, stream-ordered steal), then by this policy's own knobs again; it ends too at
    the 8th mark with no plan, and after 2**14 allocations with no mark (Note [A memory-first warm-up] in
    :mod:`.plan`). No effect on a program that never marks a step, nor under another growth rule, nor
    without ``steal_empty_pages`` (one-page chunks that are never stolen cost calls and save nothing)."""

    warmup_give_back: bool = True
    """``plan_warmup``: a warm-up that ends with no plan (its 8th mark, or 2**14 allocations with no mark) gives the
    engine's idle cache back at once (``empty_cache``), its one-page chunks with it, and the engine grows by this
    policy's chunks from there. Off: what the warm-up grew stays and serves the steps after it, which saves that
    step's release (250-370 ms once, live) but moves its one-page chunks' pages in the steady steps that follow
    (+17 % step time, median of five rounds on Llama with variable lengths): Note [A memory-first warm-up] in
    :mod:`.plan`."""

    steal_after_warmup: bool = True
    """``plan_warmup``: a warm-up that ends (a plan installed, its 8th mark with none, or 2**14 allocations with no
    mark) leaves the stream-ordered steal on (:attr:`stream_ordered_steal`) for the rest of the run, whatever that
    knob says (what a plan misses is served so): where the marks form no plan, the program marks steps that do not
    repeat, and there the ``busy_slack`` rule grew 4-6 % past peak allocated live (Note [The ordered steal after a
    warm-up] in :mod:`.backing`). A program that never begins a warm-up (inference under gpumem.torch, whose
    automatic marks begin it with the first optimizer on a GPU; marks turned off) or stops it by hand is
    :attr:`steal_before_warmup`'s (the steal too by default, until that rule's budget is spent);
    one that begins it by hand (``start_plan_warmup()``) and never marks gets the steal after 2**14 allocations.
    Off: the policy's own knobs after it, as before. Set it in Python (``dataclasses.replace(policy,
    steal_after_warmup=False)``) or, for gpumem.torch, with ``GPUMEM_STEAL_AFTER_WARMUP=0``."""

    steal_before_warmup: bool = True
    """A program that has not begun a step plan's warm-up (none yet, or one stopped by hand) grows with the
    stream-ordered steal on (:attr:`stream_ordered_steal`), whatever that knob says, until the steals made so (of
    every kind) pass 512 plus one per 256 allocations: then the rule ends for the run. Such programs are inference
    under gpumem.torch (whose automatic marks begin a warm-up with the first optimizer on a GPU), replays of traces
    that mark no step, programs with marks turned off, and a policy without ``plan_warmup`` (no warm-up ever begins).
    On by default: live on the H200 it takes ``generate()`` from 5.00 to 1.45 % above peak allocated for 0.19 % of
    its step in host time; training with marks off, where it only moved pages (a third of ResNet-50's step), loses
    it within about ten steps (Note [The ordered steal before a warm-up] in :mod:`.backing`). Off:
    ``dataclasses.replace(policy, steal_before_warmup=False)`` in Python or, for gpumem.torch,
    ``GPUMEM_STEAL_BEFORE_WARMUP=0`` (or ``gpumem.torch.configure(policy)`` with it, before the first allocation)."""

    def memory_first(self) -> "AllocatorPolicy":
        """This policy with the memory-first setting of its growth knobs: no page slack (nor its floor), the
        stream-ordered steal, chunks of 1 / :data:`WARMUP_CHUNKS` of the memory held (one page under 8 GiB of
        2 MiB pages). What a step plan's warm-up grows by (Note [A memory-first warm-up] in :mod:`.plan`)."""
        return replace(self, page_slack=0.0, page_slack_min_nbytes=0, stream_ordered_steal=True,
                                   chunk_max_fraction=1 / WARMUP_CHUNKS)

    def chunk_cap_pages(self, held_pages: int, page_nbytes: int) -> int:
        """The most pages a new chunk may hold when ``held_pages`` are held: ``chunk_max_fraction`` of them and
        ``chunk_max_nbytes``, at least one page (Note [Chunks of several pages] in :mod:`.backing`)."""
        return max(1, min(int(held_pages * self.chunk_max_fraction), self.chunk_max_nbytes // page_nbytes))

    def __post_init__(self) -> None:
        # Note [Every knob has a range]: each field is checked against the range the allocators can
        # honour (table below; the native engine's arithmetic is 64-bit), and the error names the
        # field and its range: a negative size or a NaN fraction would otherwise surface far away,
        # as a wrong split or an engine error. Integers may be any integer type (np.int64); bools
        # are refused where a number is meant, and numbers where a bool is.
        for field, (kind, lo, hi) in _FIELD_RANGES.items():
            value = getattr(self, field)
            if kind == "int?" and value is None:
                continue
            if kind == "bool":
                if value.__class__ is not bool:
                    raise InvalidArgumentError(f"AllocatorPolicy.{field} must be a bool, got {value!r:.60}")
                continue
            if kind == "float+inf":   # checked below: inf (no bound) is allowed
                continue
            if kind == "str":
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"AllocatorPolicy.{field} must be a str, got {value!r:.60}")
                continue
            number = (check_int_in_range(value, f"AllocatorPolicy.{field}", lo, hi) if kind != "float"
                      else check_real_in_range(value, f"AllocatorPolicy.{field}", lo, hi))
            object.__setattr__(self, field, number)
        # busy_slack takes inf (no bound), which the finite ranges above do not
        if isinstance(self.busy_slack, bool) or not isinstance(self.busy_slack, (int, float)) or \
                not self.busy_slack >= 0.0:
            raise InvalidArgumentError(f"AllocatorPolicy.busy_slack must be a number >= 0 (inf: no bound), "
                                       f"got {self.busy_slack!r:.60}")
        object.__setattr__(self, "busy_slack", float(self.busy_slack))
        if self.round_nbytes & (self.round_nbytes - 1):
            raise InvalidArgumentError(f"AllocatorPolicy.round_nbytes must be a power of two in [1, 2**62], "
                                       f"got {self.round_nbytes}")
        for field, enum_type, label in (("vmm", VmmMode, "vmm mode"), ("segment_rule", SegmentRule, "segment rule"),
                                        ("growth", GrowthRule, "growth rule")):
            value = getattr(self, field)
            if not isinstance(value, enum_type):
                try:
                    object.__setattr__(self, field, enum_type(value))
                except (ValueError, TypeError):
                    raise InvalidArgumentError(f"AllocatorPolicy.{field}: unknown {label} {value!r:.60}; choose one "
                                               f"of {', '.join(r.value for r in enum_type)}") from None
        if self.custom_pages and (self.growth is not GrowthRule.PAGES or self.steal_empty_pages):
            raise InvalidArgumentError("small_page_nbytes / large_page_nbytes need growth='pages' and "
                                       "steal_empty_pages=False (a chunk moves only to a page of its size)")

    @property
    def custom_pages(self) -> bool:
        """Whether a pool's virtual range has pages other than the device granularity."""
        return self.small_page_nbytes is not None or self.large_page_nbytes is not None

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


_SIZE_END = (1 << 63) - 1
_FIELD_RANGES: dict[str, tuple[str, float, float]] = {
    "name": ("str", 0, 0),
    "description": ("str", 0, 0),
    "round_nbytes": ("int", 1, 1 << 62),
    "small_max_nbytes": ("int", 0, _SIZE_END),
    "separate_small_pool": ("bool", 0, 0),
    "small_segment_nbytes": ("int", 1, _SIZE_END),
    "min_split_small_nbytes": ("int", 0, _SIZE_END),
    "min_split_large_nbytes": ("int", 0, _SIZE_END),
    "va_reserve_factor": ("float", 1.0, 4096.0),
    "steal_empty_pages": ("bool", 0, 0),
    "page_slack": ("float", 0.0, 1.0),
    "page_slack_min_nbytes": ("int", 0, _SIZE_END),
    "chunk_max_fraction": ("float", 0.0, 1.0),
    "chunk_max_nbytes": ("int", 1, _SIZE_END),
    "small_page_nbytes": ("int?", 1, _SIZE_END),
    "large_page_nbytes": ("int?", 1, _SIZE_END),
    "segments_top_down": ("bool", 0, 0),
    "grow_ahead_fraction": ("float", 0.0, 1.0),
    "busy_slack": ("float+inf", 0.0, float("inf")),
    "stream_ordered_steal": ("bool", 0, 0),
    "wait_own_stream": ("bool", 0, 0),
    "wait_on_gpu": ("bool", 0, 0),
    "plan_warmup": ("bool", 0, 0),
    "warmup_give_back": ("bool", 0, 0),
    "steal_after_warmup": ("bool", 0, 0),
    "steal_before_warmup": ("bool", 0, 0),
}
"""Each field of :class:`AllocatorPolicy`: its kind and its inclusive range (Note [Every knob has a range])."""

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
        AllocatorPolicy(
            "expandable",
            "model of PyTorch's expandable segments (virtual range mapped in 2/20 MiB pages at its end, split >= 512 B)",
            vmm=VmmMode.ALWAYS,
            va_reserve_factor=1.125,
            steal_empty_pages=False,
            steal_before_warmup=False,   # PyTorch's segments never steal
            page_slack=0.0,
            growth=GrowthRule.PAGES,
            small_page_nbytes=2 * MiB,
            large_page_nbytes=20 * MiB,
        ),
    )
}

DEFAULT_POLICY = "gpumem"


def get_policy(name: "str | AllocatorPolicy") -> AllocatorPolicy:
    """The named policy (``gpumem``, ``bestfit``, ``pytorch``, ``cupy``, ``expandable``), or ``name`` checked
    if already a policy (:func:`checked_policy`)."""
    if isinstance(name, AllocatorPolicy):
        return checked_policy(name)
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown allocator policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def checked_policy(policy: AllocatorPolicy) -> AllocatorPolicy:
    """``policy`` itself when its values are the ones its checks let through, else a plain checked copy.

    Note [A policy is checked where it is used]: ``__post_init__`` checks a policy when it is made, but a
    frozen dataclass can still be changed past it (``object.__setattr__``) and a subclass can answer a
    field through a property, differently on each read. The Python engine reads the policy on every call
    and the native one copies it once, so such a policy made them disagree (round_nbytes=0: the native
    engine refused it, the Python one raised ZeroDivisionError at the first allocation). Every field is
    read once here and the values checked again by building a plain :class:`AllocatorPolicy`; the
    original is kept only where it is a plain policy holding exactly those values (same types).

    Raises :class:`~gpumem.errors.InvalidArgumentError` naming the first field out of its range.
    """
    values = {f.name: getattr(policy, f.name) for f in fields(AllocatorPolicy)}
    checked = AllocatorPolicy(**values)
    if type(policy) is AllocatorPolicy and all(
            type(value) is type(getattr(checked, name)) and value == getattr(checked, name)
            for name, value in values.items()):
        return policy
    return checked
