"""The ``expandable`` policy: a model of PyTorch's expandable segments (Note [Expandable segments])."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import POLICIES, AllocatorPolicy, GrowthRule, get_policy
from gpumem.errors import InvalidArgumentError, UnsupportedOperationError
from gpumem.replay import replay_trace
from gpumem.units import MiB

TRACES = "data/traces"


@pytest.fixture
def alloc():
    dev = open_device("sim:rtx-3060-12gb")
    a = CachingAllocator(dev, "expandable")
    yield a
    a.close()
    dev.close()


def test_expandable_is_a_named_policy_on_the_native_engine_where_built(alloc):
    """Pages of a pool's own size run natively (Note [Pages of a pool's own size] in gpumem/_native/engine.cpp)."""
    from gpumem.native import load_engine

    assert "expandable" in POLICIES
    assert get_policy("expandable").large_page_nbytes == 20 * MiB
    assert alloc.uses_vmm and alloc.engine == ("native" if load_engine() is not None else "python")


def test_a_large_request_maps_a_whole_20_mib_page_and_a_small_one_2_mib(alloc):
    p = alloc.allocate(3 * MiB)
    assert alloc.reserved_nbytes == 20 * MiB
    q = alloc.allocate(5 * MiB)  # fits on the page already mapped: no new memory
    assert alloc.reserved_nbytes == 20 * MiB
    s = alloc.allocate(1000)  # small pool: its own range, 2 MiB pages
    assert alloc.reserved_nbytes == 22 * MiB
    big = alloc.allocate(30 * MiB)  # 12 MiB left on the first page, one more page mapped at the end
    assert alloc.reserved_nbytes == 22 * MiB + 20 * MiB
    for ptr in (p, q, s, big):
        alloc.free(ptr)
    alloc.check_consistency()


def test_freed_pages_stay_mapped_until_empty_cache(alloc):
    p = alloc.allocate(50 * MiB)
    held = alloc.reserved_nbytes
    alloc.free(p)
    assert alloc.reserved_nbytes == held  # cached, as PyTorch keeps mapped pages
    q = alloc.allocate(40 * MiB)  # reused from the cache, split (remainder >= 512 B)
    assert alloc.reserved_nbytes == held and alloc.stats.num_splits >= 1
    alloc.free(q)
    assert alloc.empty_cache() == held
    assert alloc.reserved_nbytes == 0
    alloc.check_consistency()


def test_large_blocks_split_any_remainder_of_512_bytes():
    pol = get_policy("expandable")
    assert pol.min_split_large_nbytes == 512 and pol.min_split_small_nbytes == 512


def test_device_without_virtual_memory_is_refused_clearly():
    dev = open_device("sim:jetson-nano-2gb")
    try:
        with pytest.raises(UnsupportedOperationError, match="virtual memory"):
            CachingAllocator(dev, "expandable")
    finally:
        dev.close()


@pytest.mark.parametrize("knobs, match", [
    (dict(large_page_nbytes=20 * MiB), "growth='pages'"),  # default growth is chunks
    (dict(large_page_nbytes=20 * MiB, growth=GrowthRule.PAGES), "steal_empty_pages"),
    (dict(large_page_nbytes=0, growth=GrowthRule.PAGES, steal_empty_pages=False), r"large_page_nbytes must be an int in \[1, "),
])
def test_bad_page_knobs_raise(knobs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        AllocatorPolicy("x", "x", **knobs)


def test_page_not_a_multiple_of_granularity_raises_and_reserves_nothing():
    dev = open_device("sim:rtx-3060-12gb")
    try:
        pol = AllocatorPolicy("x", "x", growth=GrowthRule.PAGES, steal_empty_pages=False, large_page_nbytes=3 * MiB)
        before = dev.mem_info().free_nbytes
        with pytest.raises(InvalidArgumentError, match="granularity"):
            CachingAllocator(dev, pol)
        assert dev.mem_info().free_nbytes == before
    finally:
        dev.close()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64 * MiB)), min_size=1, max_size=40))
def test_reserved_is_whole_pages_never_shrinks_without_empty_cache(ops):
    dev = open_device("sim:rtx-3060-12gb")
    a = CachingAllocator(dev, "expandable")
    try:
        live = []
        last = 0
        for do_free, n in ops:
            if do_free and live:
                a.free(live.pop(n % len(live)))
            else:
                live.append(a.allocate(n))
            held = a.reserved_nbytes
            assert held >= last and held % (2 * MiB) == 0
            assert held >= a.allocated_nbytes
            last = held
        a.check_consistency()
        for p in live:
            a.free(p)
        a.empty_cache()
        assert a.reserved_nbytes == 0
    finally:
        a.close()
        dev.close()


@pytest.mark.parametrize("trace, measured", [
    ("resnet_train.snapshot.pickle.gz", 0.006),  # reports/anchors.md: PyTorch expandable_segments on the H200
    ("gpt2_train.snapshot.pickle.gz", 0.069),
])
def test_overhead_matches_pytorch_measured_on_the_h200(trace, measured):
    r = replay_trace(f"{TRACES}/{trace}", "sim:h200-141gb", policy="expandable", progress=False)
    assert r.ooms == 0
    assert abs(r.overhead - measured) < 0.001
