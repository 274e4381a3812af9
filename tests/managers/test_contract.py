"""One allocation contract (issue 21 step 2): allocators are resources, alignment is a layer,
statistics are counters, and a manager allocation is recorded in few maps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.allocator import CachingAllocator, MemoryResource, make_allocator
from gpumem.allocator.bucket import BucketAllocator
from gpumem.allocator.resource import DEFAULT_ALIGNMENT, AlignmentLayer
from gpumem.errors import InternalError, InvalidArgumentError, InvalidPointerError
from gpumem.managers import GpuMemoryManager
from gpumem.managers.layers import Counter, LimitingLayer, StatisticsLayer
from gpumem.managers.resource import DeviceResource
from gpumem.units import MiB


@pytest.fixture
def dev():
    with gpumem.open_device("sim:gtx-1050-2gb") as d:
        yield d


# -- the counter ------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 40)), max_size=60))
def test_counter_value_peak_total_invariants(ops):
    c = Counter()
    value = peak = total = 0
    for add, n in ops:
        if add:
            c.add(n)
            value, total = value + n, total + n
            peak = max(peak, value)
        elif n <= value:
            c.sub(n)
            value -= n
        else:
            before = (c.value, c.peak, c.total)
            with pytest.raises(InternalError, match="below 0"):
                c.sub(n)
            assert (c.value, c.peak, c.total) == before
        assert (c.value, c.peak, c.total) == (value, peak, total)
        assert 0 <= c.value <= c.peak <= c.total
    c.reset_peak()
    assert c.peak == c.value


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4 * MiB)), max_size=40), st.sampled_from(["device", "gpumem"]))
def test_statistics_layer_matches_a_model_over_random_sequences(ops, source):
    with gpumem.open_device("sim:gtx-1050-2gb") as d:
        base = DeviceResource(d) if source == "device" else make_allocator(d, source)
        s = StatisticsLayer(base)
        live: list[tuple[int, int]] = []
        cur = peak = total = n_total = peak_n = 0
        for alloc, n in ops:
            if alloc or not live:
                live.append((s.allocate(n), n))
                cur, total, n_total = cur + n, total + n, n_total + 1
                peak, peak_n = max(peak, cur), max(peak_n, len(live))
            else:
                p, m = live.pop(n % len(live))
                s.deallocate(p, m)
                cur -= m
            st_ = s.statistics()
            assert (st_.current_nbytes, st_.peak_nbytes, st_.total_nbytes) == (cur, peak, total)
            assert (st_.current_count, st_.peak_count, st_.total_count) == (len(live), peak_n, n_total)
            assert st_.current_nbytes <= st_.peak_nbytes <= st_.total_nbytes
        s.close()


def test_statistics_layer_keeps_no_map_and_a_bad_pointer_changes_nothing(dev):
    s = StatisticsLayer(DeviceResource(dev))
    p = s.allocate(MiB)
    assert not [v for v in vars(s).values() if isinstance(v, dict)]
    before = s.statistics()
    with pytest.raises(InvalidPointerError):
        s.deallocate(p + 256, MiB)
    assert s.statistics() == before
    s.deallocate(p, MiB)
    s.close()


# -- allocators are resources --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,kind", [("gpumem", CachingAllocator), ("bestfit", CachingAllocator),
                                         ("bucket", BucketAllocator)])
def test_make_allocator_builds_a_memory_resource(dev, policy, kind):
    a = make_allocator(dev, policy)
    assert isinstance(a, kind) and isinstance(a, MemoryResource)
    p = a.allocate(MiB, stream=0)
    a.deallocate(p, MiB)
    with pytest.raises(InvalidPointerError):
        a.deallocate(p, MiB)  # double free: refused by the allocator itself
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        a.deallocate(p, 0)
    a.close()


@pytest.mark.parametrize("policy,option", [("gpumem", "max_pooled_per_bucket"), ("bucket", "gc_threshold"),
                                           ("bucket", "engine")])
def test_make_allocator_refuses_an_option_of_the_other_allocator(dev, policy, option):
    before = dev.n_allocations
    with pytest.raises(InvalidArgumentError, match=option):
        make_allocator(dev, policy, **{option: 1})
    assert dev.n_allocations == before


@pytest.mark.parametrize("source", ["device", "gpumem", "bucket"])
def test_a_base_resource_refuses_alignment_above_256_naming_the_layer(dev, source):
    base = DeviceResource(dev) if source == "device" else make_allocator(dev, source)
    before = dev.n_allocations
    with pytest.raises(InvalidArgumentError, match="AlignmentLayer"):
        base.do_allocate(MiB, 4096, 0) if source != "device" else base.allocate(MiB, 4096)
    assert dev.n_allocations == before
    base.close()


# -- the alignment layer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alignment", [0, 3, -256, 1 << 31, 1.5, True, "512", None])
def test_alignment_layer_refuses_bad_alignments_and_changes_nothing(dev, alignment):
    layer = AlignmentLayer(DeviceResource(dev))
    keep = layer.allocate(MiB, 4096)
    before = (dev.n_allocations, layer.padded_count())
    with pytest.raises(InvalidArgumentError, match="alignment must be (a power of two|an int)"):
        layer.allocate(MiB, alignment)
    with pytest.raises(InvalidArgumentError, match="alignment must be (a power of two|an int)"):
        layer.deallocate(keep, MiB, alignment)
    with pytest.raises(InvalidArgumentError, match="alignment must be (a power of two|an int)"):
        AlignmentLayer(DeviceResource(dev), alignment)
    assert (dev.n_allocations, layer.padded_count()) == before
    layer.deallocate(keep, MiB, 4096)
    assert layer.padded_count() == 0 and dev.n_allocations == 0
    layer.close()


@pytest.mark.parametrize("alignment", [1, 256, 512, 1 << 16, 1 << 21])
def test_alignment_layer_pads_only_above_256(dev, alignment):
    base = DeviceResource(dev)
    layer = AlignmentLayer(base)
    p = layer.allocate(1000, alignment)
    assert p % alignment == 0
    assert layer.padded_count() == (alignment > DEFAULT_ALIGNMENT)
    assert base.outstanding_nbytes() == 1000 + max(0, alignment - DEFAULT_ALIGNMENT)
    layer.deallocate(p, 1000, alignment)
    assert layer.padded_count() == 0 and base.outstanding_nbytes() == 0


def test_alignment_layer_least_alignment_applies_to_every_call(dev):
    layer = AlignmentLayer(make_allocator(dev), 1 << 16)
    ptrs = [layer.allocate(1000 + i) for i in range(4)]
    assert all(p % (1 << 16) == 0 for p in ptrs)
    for i, p in enumerate(ptrs):
        layer.deallocate(p, 1000 + i)
    assert layer.padded_count() == 0
    layer.close()


def test_limiting_layer_keeps_no_map(dev):
    lim = LimitingLayer(DeviceResource(dev), 4 * MiB)
    p = lim.allocate(MiB)
    assert lim.used_nbytes == MiB and not [v for v in vars(lim).values() if isinstance(v, dict)]
    lim.deallocate(p, MiB)
    assert lim.used_nbytes == 0
    lim.close()


# -- how many maps record one manager allocation ------------------------------------------------------------------
def _maps_keyed_by(root: object, key: int) -> list[str]:
    """Paths of the dicts reachable from ``root`` through gpumem objects that have ``key`` among their keys."""
    seen: set[int] = set()
    found: list[str] = []
    todo: list[tuple[str, object]] = [("manager", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            if key in obj and not all(isinstance(k, bool) for k in obj):
                found.append(path)
            todo += [(path + "[]", v) for v in obj.values() if type(v).__module__.startswith("gpumem")]
        elif isinstance(obj, (list, tuple)):
            todo += [(path + "[]", v) for v in obj if type(v).__module__.startswith("gpumem")]
        else:
            for name, v in getattr(obj, "__dict__", {}).items():
                if isinstance(v, (dict, list, tuple)) or type(v).__module__.startswith("gpumem"):
                    todo.append((f"{path}.{name}", v))
    return sorted(found)


#: Maps a manager allocation enters: the manager's handles, the tracking layer's ids, the tracker's
#: records (keyed by buffer id) and the pool's live blocks (or the device resource's sizes). Before the
#: one contract it was 7: the statistics and limiting layers and the bridge resource kept one each.
MAX_MAPS_PER_ALLOCATION = 4


@pytest.mark.parametrize("pooling", [True, False])
def test_a_manager_allocation_is_recorded_in_at_most_four_maps(pooling):
    with GpuMemoryManager("sim:t4-16gb", enable_pooling=pooling) as m:
        a = m.allocate(3 * MiB)
        maps = _maps_keyed_by(m, a.ptr)
        maps += [p for p in _maps_keyed_by(m, a.buffer_id) if ".tracker." in p]
        native = isinstance(m._base, CachingAllocator) and m._base.engine == "native"
        n = len(maps) + native  # the native engine's live-block map is in C++, out of Python's sight
        assert n <= MAX_MAPS_PER_ALLOCATION, maps
        assert not [p for p in maps if "_sizes" in p]
        m.deallocate(a)
