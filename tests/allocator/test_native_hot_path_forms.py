"""The native engine's free lists in both of their forms (Note [A few free blocks in an array] in
``gpumem/_native/engine.cpp``): a sorted array of keys while a list holds few blocks, an ordered set past that,
and the moves between the two. The engine must decide exactly as the Python reference whichever form a list is
in: the same pointers (the same best fit), device calls, stats and live blocks after every operation. And the
freed addresses the hot path's frees remember (Note [Freed addresses, oldest first] in
``gpumem/allocator/python_engine.py``) at the edge where the oldest is forgotten, in both engines alike.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import open_device, sim
from gpumem.allocator import CachingAllocator
from gpumem.errors import DoubleFreeError, InvalidPointerError
from gpumem.allocator.policy import get_policy
from gpumem.native import load_engine
from gpumem.units import KiB

from allocator_helpers import small_profile

if load_engine() is None:  # pragma: no cover - the engine is optional
    pytest.skip("the native engine (gpumem._engine) is not built", allow_module_level=True)

from test_native_differential import Pair  # noqa: E402 - after the skip: it needs the engine too

ARRAY_MAX = 32
"""engine.cpp kArrayMax: a list past this many blocks becomes a set (it goes back at 8)."""

POLICIES = [get_policy("gpumem"),
            dataclasses.replace(get_policy("gpumem"), name="one-pool", separate_small_pool=False),
            get_policy("pytorch"),  # segment mode, free lists keyed top-down (the block's place, not its address)
            get_policy("bestfit")]


def _holes(pair: Pair, n: int, sizes: list[int]) -> list[int]:
    """``n`` allocations of ``sizes`` (cycled) on stream 0, then every other one freed: about n/2 free blocks
    that cannot merge, in one free list. The pointers still live."""
    ptrs = [pair.both("allocate", sizes[i % len(sizes)], 0)[1] for i in range(n)]
    for p in ptrs[::2]:
        pair.both("free", p)
    return ptrs[1::2]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("n", [ARRAY_MAX, 2 * ARRAY_MAX + 2, 6 * ARRAY_MAX])
def test_free_lists_past_the_array_and_back_decide_the_same(policy, n):
    """Many holes (a set), allocations that take them back one by one down to a few (the array again), frees
    that merge them: the same pointers, calls and stats as the Python engine all along."""
    pair = Pair(lambda: sim.SimDevice(small_profile(384)), policy=policy)
    sizes = [512, 3 * KiB, 700, 8 * KiB, 2 * KiB + 1]
    live = _holes(pair, n, sizes)
    taken = [pair.both("allocate", sizes[i % len(sizes)], 0)[1] for i in range(n // 2 + 3)]
    for p in taken[::3] + live[::2]:
        pair.both("free", p)
    again = [pair.both("allocate", 1 * KiB + 7 * i, 0)[1] for i in range(n // 3)]
    for p in taken[1::3] + taken[2::3] + live[1::2] + again:
        pair.both("free", p)
    for alloc in pair.allocs:
        alloc.check_consistency()  # raises on a broken invariant


@settings(max_examples=25, deadline=None)
@given(n=st.integers(4, 5 * ARRAY_MAX),
       sizes=st.lists(st.integers(1, 24 * KiB), min_size=1, max_size=6),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 24 * KiB), st.integers(0, 10**6)), max_size=120),
       policy=st.sampled_from(POLICIES))
def test_random_ops_over_many_holes_decide_the_same(n, sizes, ops, policy):
    """Random allocations and frees over a list of up to 80 holes: whatever form it is in, the same decisions."""
    pair = Pair(lambda: sim.SimDevice(small_profile(384)), policy=policy)
    live = _holes(pair, n, sizes)
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            r = pair.both("allocate", nbytes, 0)
            if r[0] == "ok":
                live.append(r[1])
        else:
            pair.both("free", live.pop(pick % len(live)))
    for p in live:
        pair.both("free", p)
    for alloc in pair.allocs:
        alloc.check_consistency()  # raises on a broken invariant


def _second_free(engine: str) -> list[str]:
    """What a second free of the first address says, with that address freed again (not re-remembered) just
    before the 65,536th address after it, and at the edge of being forgotten."""
    d = open_device("sim:h200-141gb")
    out = []
    try:
        alloc = CachingAllocator(d, "gpumem", engine=engine)
        n = 65_536 + 1
        ptrs = [alloc.allocate(512) for _ in range(n)]
        for p in ptrs[:-1]:  # 65,536 addresses: the first one still remembered
            alloc.free(p)
        again = alloc.allocate(512)  # the first address again: freed again, it keeps its first place
        out.append(str(again == ptrs[0]))
        alloc.free(again)
        for p in (ptrs[0], ptrs[1]):
            try:
                alloc.free(p)
            except (DoubleFreeError, InvalidPointerError) as exc:
                out.append(type(exc).__name__)
        alloc.free(ptrs[-1])  # the 65,537th address: the first one is forgotten now
        for p in (ptrs[0], ptrs[1]):
            try:
                alloc.free(p)
            except (DoubleFreeError, InvalidPointerError) as exc:
                out.append(type(exc).__name__)
        back = alloc.allocate(512)  # the forgotten first address again: freed, it is remembered anew
        out.append(str(back == ptrs[0]))
        alloc.free(back)
        try:
            alloc.free(back)
        except (DoubleFreeError, InvalidPointerError) as exc:
            out.append(type(exc).__name__)
        alloc.close()
    finally:
        d.close()
    return out


def test_freed_addresses_at_the_edge_of_memory_are_told_the_same():
    """An address freed again through the hot path while remembered keeps its first place; forgotten, it is an
    invalid pointer; freed once more, it is remembered anew: in both engines alike."""
    native = _second_free("native")
    assert native == _second_free("python")
    assert native == ["True", "DoubleFreeError", "DoubleFreeError", "InvalidPointerError", "DoubleFreeError",
                      "True", "DoubleFreeError"]
