"""Unit tests of the caching allocator: rounding, pools, best fit, splitting and coalescing,
caching, out-of-memory handling, limits, streams, bad input, threads, reports and history."""

from __future__ import annotations

import itertools
import random
import re
import threading

import pytest

from gpumem import sim
from gpumem import open_device
from gpumem.allocator import POLICIES, AllocatorPolicy, CachingAllocator, VmmMode, get_policy
from gpumem.allocator.backing import SegmentBacking, VirtualBacking
from gpumem.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidPointerError,
    OutOfMemoryError,
    TransientDeviceError,
    UnsupportedOperationError,
)
from gpumem.replay import replay
from gpumem.trace import Trace, load_trace, save_pytorch_snapshot
from gpumem.units import KiB, MiB

from allocator_helpers import (
    LiveBlock,
    check_allocator,
    check_pattern,
    page_handles,
    pages_of,
    small_device,
    write_pattern,
)

ALL_POLICIES = ["gpumem", "bestfit", "pytorch", "cupy"]
SEGMENT_POLICIES = ["bestfit", "pytorch", "cupy"]


@pytest.fixture
def dev():
    d = small_device(384)
    yield d
    d.close()


def make(dev, policy="gpumem", **kw) -> CachingAllocator:
    return CachingAllocator(dev, policy, **kw)


def stats_dict(alloc):
    return alloc.snapshot_stats().as_dict()


# -- rounding and pools ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes, size", [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024),
                                          (1 * MiB + 1, 1 * MiB + 512), (3 * MiB - 7, 3 * MiB)])
def test_requests_round_up_to_512(dev, policy, nbytes, size):
    alloc = make(dev, policy)
    p = alloc.allocate(nbytes)
    assert p % 512 == 0
    assert alloc.block_size(p) == size
    st = alloc.snapshot_stats()
    assert st.requested_nbytes == nbytes
    assert st.allocated_nbytes == alloc.block_size(p)
    assert get_policy(policy).round(nbytes) == size
    alloc.free(p)
    assert alloc.allocated_nbytes == 0


def _pool_of(alloc, ptr) -> bool:
    """Whether the block at ``ptr`` lives in small-pool memory (private state)."""
    if isinstance(alloc.backing, SegmentBacking):
        seg = next(s for s in alloc.backing.segments.values() if s.base <= ptr < s.base + s.nbytes)
    else:
        seg = next(s for s in alloc.backing.vsegments.values() if s.base <= ptr < s.base + s.nbytes)
    return seg.small


@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch"])
def test_small_and_large_requests_use_separate_pools(dev, policy):
    alloc = make(dev, policy)
    small = [alloc.allocate(n) for n in (1, 4 * KiB, 1 * MiB)]
    large = [alloc.allocate(n) for n in (1 * MiB + 1, 2 * MiB, 12 * MiB)]
    assert all(_pool_of(alloc, p) for p in small)
    assert not any(_pool_of(alloc, p) for p in large)
    if policy != "gpumem":
        # the small pool grows in 2 MiB segments
        small_segs = [s for s in alloc.backing.segments.values() if s.small]
        assert {s.nbytes for s in small_segs} == {2 * MiB}
    check_allocator(alloc, {p: LiveBlock(p, n, 0, 0) for p, n in
                            zip(small + large, (1, 4 * KiB, 1 * MiB, 1 * MiB + 1, 2 * MiB, 12 * MiB))})


def test_cupy_has_one_pool_and_exact_segments(dev):
    alloc = make(dev, "cupy")
    p = alloc.allocate(1000)
    q = alloc.allocate(3 * MiB + 5)
    assert not _pool_of(alloc, p) and not _pool_of(alloc, q)
    assert sorted(s.nbytes for s in alloc.backing.segments.values()) == [1024, 3 * MiB + 512]


def test_pytorch_segment_sizes(dev):
    alloc = make(dev, "pytorch")
    alloc.allocate(100)          # small: a 2 MiB segment
    alloc.allocate(11 * MiB)     # 10 MiB or more: rounded up to 2 MiB
    alloc.allocate(3 * MiB)      # large under 10 MiB: a 20 MiB segment
    assert sorted(s.nbytes for s in alloc.backing.segments.values()) == [2 * MiB, 12 * MiB, 20 * MiB]


def test_pytorch_does_not_split_off_a_megabyte_or_less(dev):
    alloc = make(dev, "pytorch")
    p = alloc.allocate(11 * MiB + 1)  # a 12 MiB segment; 1 MiB - 512 would remain: not split
    assert alloc.block_size(p) == 12 * MiB
    st = alloc.snapshot_stats()
    assert st.allocated_nbytes == 12 * MiB and st.requested_nbytes == 11 * MiB + 1
    alloc.free(p)
    st = alloc.snapshot_stats()
    assert st.allocated_nbytes == 0 and st.requested_nbytes == 0


# -- best fit, splitting, coalescing, caching -------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_best_fit_picks_the_smallest_fitting_block(dev, policy):
    alloc = make(dev, policy)
    sizes = {"a": 24 * MiB, "b": 12 * MiB, "c": 16 * MiB}
    ptrs = {}
    keep = []
    for name, n in sizes.items():
        ptrs[name] = alloc.allocate(n)
        keep.append(alloc.allocate(2 * MiB))  # separators, so free blocks do not merge
    for name in sizes:
        alloc.free(ptrs[name])
    calls = alloc.snapshot_stats().device_calls
    assert alloc.allocate(11 * MiB) == ptrs["b"]
    assert alloc.allocate(13 * MiB) == ptrs["c"]
    assert alloc.allocate(20 * MiB) == ptrs["a"]
    assert alloc.snapshot_stats().device_calls == calls


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_best_fit_breaks_ties_towards_the_lowest_address(dev, policy):
    alloc = make(dev, policy)
    a, s1, b, s2 = (alloc.allocate(n) for n in (12 * MiB, 2 * MiB, 12 * MiB, 2 * MiB))
    alloc.free(b)
    alloc.free(a)
    assert alloc.allocate(12 * MiB) == min(a, b)  # pytorch too (Note [Segments top-down])


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_split_then_coalesce_in_any_order(dev, policy, order):
    alloc = make(dev, policy)
    big = alloc.allocate(6 * MiB)
    alloc.free(big)
    parts = [alloc.allocate(2 * MiB) for _ in range(3)]
    # all three carved out of the cached block, back to back
    assert parts == [big, big + 2 * MiB, big + 4 * MiB]
    assert alloc.snapshot_stats().num_splits >= 2
    for i in order:
        alloc.free(parts[i])
        check_allocator(alloc, {p: LiveBlock(p, 2 * MiB, 0, 0) for p in parts if p in dict(alloc.live_blocks())})
    st = alloc.snapshot_stats()
    assert st.num_free_blocks == 1
    assert st.largest_free_nbytes >= 6 * MiB
    calls = st.device_calls
    assert alloc.allocate(6 * MiB) == big  # whole again
    assert alloc.snapshot_stats().device_calls == calls


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes", [100, 300 * KiB, 3 * MiB, 25 * MiB])
def test_cached_reuse_costs_no_device_call(dev, policy, nbytes):
    alloc = make(dev, policy)
    p = alloc.allocate(nbytes)
    alloc.free(p)
    before = alloc.snapshot_stats()
    sim_calls = sum(dev.stats.calls.values())
    for _ in range(5):
        q = alloc.allocate(nbytes)
        assert q == p
        alloc.free(q)
    after = alloc.snapshot_stats()
    assert after.device_calls == before.device_calls
    assert sum(dev.stats.calls.values()) == sim_calls
    assert after.cache_hits == before.cache_hits + 5
    assert after.cache_misses == before.cache_misses


# -- out of memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", SEGMENT_POLICIES)
def test_oom_releases_the_cache_and_retries(dev, policy):
    alloc = make(dev, policy)
    ptrs = [alloc.allocate(100 * MiB) for _ in range(3)]
    for p in ptrs:
        alloc.free(p)
    before = alloc.snapshot_stats()
    assert before.reserved_nbytes >= 300 * MiB  # cached, in three segments of 100 MiB
    q = alloc.allocate(200 * MiB)  # fits neither a cached block nor the device's 52 MiB free
    after = alloc.snapshot_stats()
    assert after.num_alloc_retries == before.num_alloc_retries + 1
    assert after.num_ooms == 0
    assert after.reserved_nbytes == 200 * MiB
    assert dev.process_used_nbytes == 200 * MiB
    check_allocator(alloc, {q: LiveBlock(q, 200 * MiB, 0, 0)}, exact_device_accounting=policy != "cupy")


def test_virtual_memory_reuses_freed_pages_without_a_retry(dev):
    alloc = make(dev, "gpumem")
    ptrs = [alloc.allocate(100 * MiB, stream=0) for _ in range(3)]
    for p in ptrs:
        alloc.free(p)
    # another stream has its own range: two pages are created (the slack's floor: Note [A slack of at least
    # one page]) and the rest stolen from stream 0's empty ones
    q = alloc.allocate(200 * MiB, stream=1)
    st = alloc.snapshot_stats()
    assert st.num_alloc_retries == 0 and st.num_ooms == 0
    assert st.reserved_nbytes == 304 * MiB
    assert alloc.backing.n_steals == 98
    check_allocator(alloc, {q: LiveBlock(q, 200 * MiB, 1, 0)})
    alloc.free(q)
    alloc.empty_cache()
    assert alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_oom_error_says_what_and_why(dev, policy):
    alloc = make(dev, policy)
    keep = alloc.allocate(40 * MiB)
    cached = alloc.allocate(30 * MiB)
    alloc.free(cached)
    before = stats_dict(alloc)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.allocate(1024 * MiB)
    exc = info.value
    msg = str(exc)
    assert isinstance(exc, MemoryError)
    assert "(1073741824 bytes)" in msg and "1.00 GiB" in msg
    assert exc.requested_nbytes == 1024 * MiB
    assert exc.total_nbytes == 384 * MiB and "384.00 MiB total" in msg
    assert exc.free_nbytes == dev.mem_info().free_nbytes and "free of" in msg
    assert exc.allocated_nbytes == alloc.block_size(keep) and "allocated" in msg
    assert exc.cached_nbytes == alloc.reserved_nbytes - alloc.allocated_nbytes and "reserved but unused" in msg
    assert exc.device == dev.spec and dev.spec in msg
    assert exc.hint and "Try:" in msg
    after = stats_dict(alloc)
    for key in ("allocated_nbytes", "requested_nbytes", "num_allocs", "num_frees", "peak_reserved_nbytes",
                "peak_allocated_nbytes", "peak_requested_nbytes"):
        assert after[key] == before[key], key
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["reserved_nbytes"] <= before["reserved_nbytes"]  # the cache was given back
    assert alloc.live_blocks() == [(keep, alloc.block_size(keep))]


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("limit, limit_nbytes, text", [(64 * MiB, 64 * MiB, "64.00 MiB"),
                                                       (0.25, 96 * MiB, "96.00 MiB")])
def test_limit_as_bytes_or_fraction(dev, policy, limit, limit_nbytes, text):
    alloc = make(dev, policy, limit=limit)
    assert alloc.limit_nbytes == limit_nbytes
    p = alloc.allocate(40 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.allocate(limit_nbytes - 30 * MiB)
    msg = str(info.value)
    assert f"its limit is {text}" in msg
    assert "limit" in info.value.hint
    assert info.value.limit_nbytes == limit_nbytes
    assert alloc.reserved_nbytes <= limit_nbytes
    alloc.free(p)
    q = alloc.allocate(limit_nbytes - 30 * MiB)  # fits once the first block is gone
    assert alloc.reserved_nbytes <= limit_nbytes
    alloc.free(q)


@pytest.mark.parametrize("limit", [0, -1, 0.0, 1.5, -0.5, True, "1", [1]])
def test_bad_limits_are_refused(dev, limit):
    with pytest.raises(InvalidArgumentError):
        make(dev, limit=limit)


@pytest.mark.parametrize("threshold", [0, 0.0, 1, 1.0, 1.5, -0.1, "0.5"])
def test_bad_gc_thresholds_are_refused(dev, threshold):
    with pytest.raises(InvalidArgumentError):
        make(dev, gc_threshold=threshold)


@pytest.mark.parametrize("policy", SEGMENT_POLICIES)
def test_gc_threshold_gives_cache_back_before_growing(dev, policy):
    plain = make(small_device(384), policy)
    gc = make(dev, policy, gc_threshold=0.5)  # 192 MiB of the 384 MiB card
    for alloc in (plain, gc):
        a = alloc.allocate(100 * MiB)
        alloc.allocate(100 * MiB)
        alloc.free(a)  # 100 MiB cached; 200 MiB reserved
        alloc.allocate(150 * MiB)
    assert plain.snapshot_stats().num_gc_releases == 0
    assert plain.reserved_nbytes == 350 * MiB
    assert gc.snapshot_stats().num_gc_releases == 1
    assert gc.reserved_nbytes == 250 * MiB
    assert gc.snapshot_stats().num_alloc_retries == 0


def test_gc_threshold_is_relative_to_the_limit(dev):
    alloc = make(dev, "bestfit", limit=200 * MiB, gc_threshold=0.5)
    a = alloc.allocate(60 * MiB)
    alloc.allocate(60 * MiB)
    alloc.free(a)
    alloc.allocate(70 * MiB)  # 120 MiB reserved > 100 MiB: the cached 60 MiB go first
    assert alloc.snapshot_stats().num_gc_releases == 1
    assert alloc.reserved_nbytes == 130 * MiB


# -- failures injected by the device ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes", [100, 30 * MiB])
def test_transient_device_error_changes_nothing(policy, nbytes):
    dev = small_device(384)
    alloc = make(dev, policy)
    keep = alloc.allocate(5 * MiB)
    # the next allocation call to the device (malloc or mem_create) fails once
    dev.faults.plan = sim.FaultPlan(transient_error_calls=frozenset({dev.faults.allocation_calls + 1}))
    keep_block = LiveBlock(keep, 5 * MiB, 0, 1)
    write_pattern(dev, keep_block)
    failures = 0
    for _ in range(3):
        before = stats_dict(alloc), alloc.live_blocks()
        try:
            p = alloc.allocate(nbytes)
        except TransientDeviceError:
            failures += 1
            after = stats_dict(alloc), alloc.live_blocks()
            assert after[1] == before[1]
            for key in ("allocated_nbytes", "requested_nbytes", "reserved_nbytes", "num_allocs"):
                assert after[0][key] == before[0][key], key
            check_allocator(alloc, {keep: keep_block}, exact_device_accounting=policy != "cupy")
            continue
        alloc.free(p)
    assert failures == 1
    check_pattern(dev, keep_block)
    alloc.free(keep)
    alloc.empty_cache()
    assert alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_injected_oom_is_retried_after_releasing_the_cache(policy):
    dev = small_device(384)
    alloc = make(dev, policy)
    keep = alloc.allocate(3 * MiB)
    spare = alloc.allocate(5 * MiB)
    alloc.free(spare)
    # from now on every allocation call (malloc or mem_create) fails: the retry cannot help
    n = dev.faults.allocation_calls
    dev.faults.plan = sim.FaultPlan(fail_allocation_calls=frozenset(range(n + 1, n + 100)))
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(64 * MiB)
    st = alloc.snapshot_stats()
    assert st.num_ooms == 1 and st.num_alloc_retries == 1
    assert alloc.live_blocks() == [(keep, alloc.block_size(keep))]
    check_allocator(alloc, {keep: LiveBlock(keep, 3 * MiB, 0, 0)}, exact_device_accounting=policy != "cupy")


# -- streams ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes", [1000, 4 * MiB])
def test_a_block_freed_on_one_stream_is_not_reused_on_another(dev, policy, nbytes):
    alloc = make(dev, policy)
    p = alloc.allocate(nbytes, stream=0)
    alloc.free(p)
    q = alloc.allocate(nbytes, stream=1)
    assert q != p
    assert not (q < p + nbytes and p < q + nbytes)
    r = alloc.allocate(nbytes, stream=0)
    assert r == p


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes", [1000, 4 * MiB])
def test_record_stream_delays_reuse_until_the_other_stream_is_done(dev, policy, nbytes):
    """A block used on stream 1 by a kernel still running is neither reused nor given back; once
    the kernel is done it is reusable with no manual synchronize()."""
    alloc = make(dev, policy)
    p = alloc.allocate(nbytes, stream=0)
    size = alloc.block_size(p)
    p_pages = {pg: h for pg, h in page_handles(dev).items() if pg in pages_of(p, size)}
    alloc.record_stream(p, 1)
    alloc.record_stream(p, 0)  # its own stream: nothing to wait for
    work = dev.launch(1, 0.01, touches=[(p, nbytes)], name="reader")
    alloc.free(p)
    assert alloc.snapshot_stats().active_nbytes == size
    q = alloc.allocate(nbytes, stream=0)
    assert not (q < p + size and p < q + size), "a block waiting for another stream was reused"
    if alloc.uses_vmm:
        # nor was its physical memory: a chunk that backed p backs q only where it still backs p
        # (a page both share), never moved under q elsewhere
        handles = page_handles(dev)
        for pg in pages_of(q, alloc.block_size(q)):
            if handles[pg] in p_pages.values():
                assert p_pages.get(pg) == handles[pg], "a chunk of the waiting block was remapped under q"
    assert not work.done
    alloc.empty_cache()  # waits for the kernel, then the block is free (and its cache given back)
    assert work.done
    assert alloc.snapshot_stats().active_nbytes == alloc.block_size(q)
    alloc.check_consistency()


def test_record_stream_block_is_reusable_once_its_event_completes(dev):
    """PyTorch's process_events: a cache miss looks at pending blocks; no synchronize() needed."""
    alloc = make(dev, "bestfit")
    p = alloc.allocate(2 * MiB)  # a whole segment: the next request misses the cache
    alloc.record_stream(p, 1)
    work = dev.launch(1, 0.01, touches=[(p, 1000)])
    alloc.free(p)
    assert alloc.allocate(2 * MiB) != p  # the kernel on stream 1 still reads p
    dev.advance(0.02)
    assert work.done
    assert alloc.allocate(2 * MiB) == p


def test_record_stream_on_its_own_stream_does_not_delay(dev):
    alloc = make(dev, "bestfit")
    p = alloc.allocate(1000)
    alloc.record_stream(p, 0)
    alloc.free(p)
    assert alloc.allocate(1000) == p


def test_record_stream_of_unknown_pointer(dev):
    alloc = make(dev)
    with pytest.raises(InvalidPointerError):
        alloc.record_stream(0x1234, 1)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_pending_blocks_are_given_back_by_empty_cache(dev, policy):
    alloc = make(dev, policy)
    ptrs = [alloc.allocate(n, stream=0) for n in (1000, 4 * MiB, 30 * MiB)]
    works = []
    for p in ptrs:
        alloc.record_stream(p, 1)
        works.append(dev.launch(1, 0.005, touches=[(p, 1000)]))
        alloc.free(p)
    alloc.empty_cache()  # waits for the kernels on stream 1, as PyTorch's empty_cache does
    assert all(w.done for w in works)
    assert alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0
    assert alloc.snapshot_stats().active_nbytes == 0


# -- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("nbytes", [0, -1, -4096, 1.5, 2.0, "8", True, False, None])
def test_bad_sizes_are_refused_and_change_nothing(dev, policy, nbytes):
    alloc = make(dev, policy)
    p = alloc.allocate(1000)
    before = stats_dict(alloc)
    calls = sum(dev.stats.calls.values())
    with pytest.raises(InvalidArgumentError):
        alloc.allocate(nbytes)
    assert stats_dict(alloc) == before
    assert sum(dev.stats.calls.values()) == calls
    assert alloc.live_blocks() == [(p, 1024)]


@pytest.mark.parametrize("stream", ["0", 1.0, None, True])
def test_bad_streams_are_refused(dev, stream):
    alloc = make(dev)
    before = stats_dict(alloc)
    with pytest.raises(InvalidArgumentError):
        alloc.allocate(1000, stream)
    assert stats_dict(alloc) == before


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_bad_frees_raise_and_change_nothing(dev, policy):
    alloc = make(dev, policy)
    p = alloc.allocate(1000)
    q = alloc.allocate(5 * MiB)
    alloc.free(q)
    before = stats_dict(alloc)
    with pytest.raises(InvalidPointerError) as info:
        alloc.free(0x1234_5000)
    assert not isinstance(info.value, DoubleFreeError)
    with pytest.raises(InvalidPointerError):
        alloc.free(p + 512)  # inside a live block, not its start
    with pytest.raises(DoubleFreeError):
        alloc.free(q)
    for bad in (0, -1, "x", 1.5, None):
        with pytest.raises(InvalidArgumentError):
            alloc.free(bad)
    assert stats_dict(alloc) == before
    assert alloc.live_blocks() == [(p, 1024)]
    alloc.free(p)
    with pytest.raises(DoubleFreeError):
        alloc.free(p)


@pytest.mark.parametrize("engine,policy", [("python", "pytorch"), ("python", "gpumem"), ("native", "gpumem")])
def test_the_oldest_freed_address_is_forgotten_first(engine, policy):
    """Note [Freed addresses, oldest first] in gpumem/allocator/python_engine.py: the last 65,536 addresses freed
    are remembered (a second free of one is a double free); the oldest is forgotten first, in both engines, also
    when an address freed again keeps its first place."""
    d = open_device("sim:h200-141gb")
    try:
        alloc = CachingAllocator(d, policy, engine=engine)
        n = 65_536 + 2
        ptrs = [alloc.allocate(512) for _ in range(n)]
        for p in ptrs[:2]:
            alloc.free(p)
        again = alloc.allocate(512)  # one of the two, freed again below: it keeps its first place
        assert again in ptrs[:2]
        alloc.free(again)
        for p in ptrs[2:]:
            alloc.free(p)
        with pytest.raises(InvalidPointerError) as info:  # forgotten: the first two of 65,538 addresses
            alloc.free(ptrs[0])
        assert not isinstance(info.value, DoubleFreeError)
        with pytest.raises(InvalidPointerError) as info:
            alloc.free(ptrs[1])
        assert not isinstance(info.value, DoubleFreeError)
        with pytest.raises(DoubleFreeError):  # the oldest one still remembered
            alloc.free(ptrs[2])
        alloc.close()
    finally:
        d.close()


def test_unknown_policy_and_policies_by_name(dev):
    assert set(POLICIES) == {"gpumem", "bestfit", "pytorch", "cupy", "expandable"}
    for name in POLICIES:
        assert get_policy(name).name == name
        alloc = make(small_device(), name)
        assert alloc.policy is POLICIES[name]
    with pytest.raises(InvalidArgumentError, match="bestfit"):
        make(dev, "tcmalloc")
    with pytest.raises(InvalidArgumentError):
        get_policy(None)
    custom = AllocatorPolicy("mine", "a custom policy", vmm=VmmMode.NEVER, round_nbytes=4096)
    alloc = make(dev, custom)
    assert alloc.block_size(alloc.allocate(1)) == 4096
    with pytest.raises(InvalidArgumentError):
        AllocatorPolicy("bad", "not a power of two", round_nbytes=1000)


def test_backing_follows_the_device(dev):
    assert isinstance(make(dev, "gpumem").backing, VirtualBacking)
    for name in SEGMENT_POLICIES:
        assert isinstance(make(dev, name).backing, SegmentBacking)
    nano = open_device("sim:jetson-nano-2gb")
    alloc = make(nano, "gpumem")
    assert not alloc.uses_vmm and isinstance(alloc.backing, SegmentBacking)
    p = alloc.allocate(3 * MiB)
    block = LiveBlock(p, 3 * MiB, 0, 7)
    write_pattern(nano, block)
    check_pattern(nano, block)
    alloc.free(p)
    alloc.empty_cache()
    assert nano.process_used_nbytes == 0
    with pytest.raises(UnsupportedOperationError):
        make(nano, AllocatorPolicy("vmm-only", "needs VMM", vmm=VmmMode.ALWAYS))


def test_close(dev):
    with make(dev, "gpumem") as alloc:
        alloc.allocate(5 * MiB)
        alloc.allocate(100)
    assert dev.process_used_nbytes == 0 and dev.mapping_ranges() == []
    alloc.close()  # idempotent
    with pytest.raises(InvalidArgumentError):
        alloc.allocate(100)
    seg = make(dev, "bestfit")
    seg.allocate(5 * MiB)
    seg.close()
    assert dev.process_used_nbytes == 0 and dev.n_allocations == 0


# -- threads ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["gpumem", "bestfit"])
def test_threads(policy):
    dev = open_device("sim:a100-80gb")
    alloc = make(dev, policy)
    errors: list[BaseException] = []
    kept: dict[int, LiveBlock] = {}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: dict[int, int] = {}
        try:
            for _ in range(400):
                if mine and rng.random() < 0.45:
                    p = rng.choice(list(mine))
                    del mine[p]
                    alloc.free(p)
                else:
                    n = rng.choice([1, 700, 4 * KiB, 300 * KiB, 1 * MiB + 1, 5 * MiB, 24 * MiB])
                    p = alloc.allocate(n, stream=rng.randrange(2))
                    assert p not in mine
                    mine[p] = n
            with lock:
                for p, n in mine.items():
                    assert p not in kept
                    kept[p] = LiveBlock(p, n, 0, 0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_allocator(alloc, kept)
    for p in kept:
        alloc.free(p)
    st = alloc.snapshot_stats()
    assert st.allocated_nbytes == 0 and st.num_allocs == st.num_frees
    alloc.empty_cache()
    assert alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0


# -- reports and history ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_memory_summary(dev, policy):
    alloc = make(dev, policy)
    p = alloc.allocate(3 * MiB)
    alloc.allocate(1000)
    alloc.free(p)
    text = alloc.memory_summary()
    for row in ("Allocated", "Requested", "Reserved", "Active", "Cached, free", "Inactive split",
                "Largest free block", "Allocations", "Frees", "Live blocks", "Free blocks", "Segments",
                "Splits", "Cache hits", "Cache misses", "Retries", "OOMs", "Device calls",
                "External fragmentation", "Peak overhead"):
        assert row in text, row
    assert dev.spec in text and f"policy '{policy}'" in text
    assert ("virtual memory" if policy == "gpumem" else "segments") in text
    stats = alloc.memory_stats()
    assert stats["allocated_nbytes"] == 1024 and stats["num_allocs"] == 2 and stats["num_frees"] == 1
    assert {"free_nbytes", "external_fragmentation", "overhead"} <= set(stats)


def _churn(alloc, seed=5, n=300):
    rng = random.Random(seed)
    live = []
    for _ in range(n):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(alloc.allocate(rng.choice([100, 3000, 200 * KiB, 2 * MiB + 3, 7 * MiB]), rng.randrange(2)))
    return live


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_history_is_a_trace_that_replays_to_the_same_peak(dev, policy):
    alloc = make(dev, policy, record_history=True)
    live = _churn(alloc)
    trace = alloc.history()
    assert isinstance(trace, Trace)
    st = alloc.snapshot_stats()
    assert trace.n_allocs == st.num_allocs and trace.n_frees == st.num_frees
    assert trace.n_live_at_end == len(live)
    assert trace.peak_live_nbytes == st.peak_requested_nbytes
    again = make(small_device(), policy)
    result = replay(trace, again, progress=False)
    assert result.ooms == 0
    assert result.peak_live_bytes == st.peak_requested_nbytes
    assert again.snapshot_stats().peak_allocated_nbytes == st.peak_allocated_nbytes


def test_history_needs_record_history(dev):
    with pytest.raises(InvalidArgumentError, match="record_history"):
        make(dev).history()


@pytest.mark.parametrize("policy", ["gpumem", "bestfit"])
def test_history_exports_to_a_pytorch_snapshot(dev, policy, tmp_path):
    alloc = make(dev, policy, record_history=True)
    _churn(alloc, seed=9, n=120)
    trace = alloc.history()
    path = save_pytorch_snapshot(trace, tmp_path / "gpumem.pickle")
    back = load_trace(path)
    assert back.source == "pytorch-snapshot"
    assert back.ops_equal(trace, times=False, addrs=False)
    assert back.peak_live_nbytes == trace.peak_live_nbytes
    gz = save_pytorch_snapshot(trace, tmp_path / "gpumem.pickle.gz")
    assert load_trace(gz).ops_equal(trace, times=False, addrs=False)


# -- consistent validation and clear messages (review finding F10) ----------------------------------------
def test_pointer_and_stream_validation_is_consistent_and_clear():
    import numpy as np

    from gpumem.errors import InvalidArgumentError, InvalidPointerError

    from allocator_helpers import small_device

    dev = small_device(384)
    alloc = CachingAllocator(dev)

    class Ptr(int):
        pass

    p = alloc.allocate(MiB)
    alloc.record_stream(np.int64(p), 1)
    alloc.free(np.int64(p))  # record_stream accepted it: free does too
    q = alloc.allocate(MiB)
    alloc.free(Ptr(q))  # an int subclass is the same pointer
    for bad in (2**64, 2**80, -1):
        with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
            alloc.allocate(1, bad)
    r = alloc.allocate(MiB)
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
        alloc.record_stream(r, 2**80)
    with pytest.raises(InvalidArgumentError):
        alloc.record_stream(r, True)
    with pytest.raises(InvalidPointerError, match=f"inside the live block at {r:#x}"):
        alloc.free(r + 1)
    with pytest.raises(InvalidPointerError, match=f"{r + 1:#x}"):
        alloc.record_stream(r + 1, 1)
    alloc.close()
    with pytest.raises(InvalidArgumentError, match="allocator is closed"):
        alloc.free(r)
    with pytest.raises(InvalidArgumentError, match="allocator is closed"):
        alloc.record_stream(r, 1)
    dev.close()


def test_a_block_waiting_for_its_streams_is_active_not_cached_free():
    """New user 9, F5: a block freed after a use on another stream, still waiting for that stream's work, was
    counted in Active and in Cached, free (more than Reserved), and in the external fragmentation's free bytes."""
    from gpumem.units import format_bytes

    for engine in ("python", "native"):
        alloc = CachingAllocator(open_device("sim:h200-141gb"), engine=engine)
        a = alloc.allocate(1 << 20, 7)
        b = alloc.allocate(4096, 7)
        alloc.record_stream(a, 9)
        alloc.free(a)
        alloc.free(b)
        st = alloc.stats
        pending = st.active_nbytes - st.allocated_nbytes
        assert pending == 1 << 20
        free = st.reserved_nbytes - st.active_nbytes
        assert st.external_fragmentation == (0.0 if free <= 0 else max(0.0, 1 - st.largest_free_nbytes / free))
        summary = alloc.memory_summary()
        cached = re.search(r"Cached, free\s+(\S+ \S+)", summary).group(1)
        assert cached == format_bytes(free), engine
        alloc.close()
