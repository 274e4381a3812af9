"""Memory resources and the layers over them: each on its own, then stacked."""

from __future__ import annotations

import logging

import pytest

import gpumem
from gpumem.errors import DeviceClosedError, InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from gpumem.managers.layers import (FailureCallbackLayer, LimitingLayer, LoggingLayer, StatisticsLayer,
                                    TrackingLayer)
from gpumem.managers.regions import region
from gpumem.allocator import make_allocator
from gpumem.allocator.resource import AlignmentLayer
from gpumem.managers.resource import DeviceResource, MemoryResource, find_layer, stack_layers
from gpumem.managers.tracker import AllocationTracker, Location
from gpumem.units import MiB


@pytest.fixture
def dev():
    with gpumem.open_device("sim:gtx-1050-2gb") as d:
        yield d


@pytest.fixture(params=["device", "allocator"])
def base(request, dev):
    """A base resource (the device, or an allocator: a resource itself) under the alignment layer."""
    r = AlignmentLayer(DeviceResource(dev) if request.param == "device" else make_allocator(dev))
    yield r
    r.close()


def live_nbytes(aligned: AlignmentLayer) -> int:
    """Bytes live in the base under ``aligned`` (requested for the device, rounded for an allocator)."""
    up = aligned.upstream
    return up.outstanding_nbytes() if isinstance(up, DeviceResource) else up.allocated_nbytes


BAD_ALLOCATE = [
    ((0,), "nbytes"), ((-5,), "nbytes"), ((1.5,), "nbytes"), ((True,), "nbytes"),
    ((1024, 3), "alignment"), ((1024, 0), "alignment"), ((1024, 1 << 31), "alignment"),
    ((1024, 256, -1), "stream"), ((1024, 256, "0"), "stream"),
]


@pytest.mark.parametrize("args,what", BAD_ALLOCATE)
def test_bad_arguments_change_nothing(base, dev, args, what):
    before = dev.n_allocations
    with pytest.raises(InvalidArgumentError, match=what):
        base.allocate(*args)
    assert dev.n_allocations == before


@pytest.mark.parametrize("alignment", [1, 64, 256, 512, 4096, 1 << 21])
def test_alignment_is_honoured(base, alignment):
    ptrs = [base.allocate(1000 + i, alignment) for i in range(3)]
    assert all(p % alignment == 0 for p in ptrs)
    for i, p in enumerate(ptrs):
        base.deallocate(p, 1000 + i, alignment)
    assert live_nbytes(base) == 0 and base.padded_count() == 0


def test_deallocate_must_match(base, dev):
    p = base.allocate(4096, 4096)
    with pytest.raises(InvalidArgumentError, match="nbytes=4096"):
        base.deallocate(p, 4000, 4096)
    with pytest.raises(InvalidArgumentError, match="alignment=4096"):
        base.deallocate(p, 4096, 256)
    with pytest.raises(InvalidPointerError):
        base.deallocate(p + 256, 4096, 4096)
    assert base.padded_count() == 1 and live_nbytes(base) >= 4096
    base.deallocate(p, 4096, 4096)
    with pytest.raises(InvalidPointerError):  # double free
        base.deallocate(p, 4096, 4096)


def test_device_resource_is_unpooled(dev):
    r = DeviceResource(dev)
    p = r.allocate(8 * MiB)
    assert dev.n_allocations == 1
    r.deallocate(p, 8 * MiB)
    assert dev.n_allocations == 0
    assert r.empty_cache() == 0


@pytest.mark.parametrize("policy", ["bestfit", "bucket"])
def test_an_allocator_is_a_pooling_resource(dev, policy):
    r = make_allocator(dev, policy)
    assert isinstance(r, MemoryResource)
    p = r.allocate(8 * MiB)
    r.deallocate(p, 8 * MiB)
    assert r.reserved_nbytes > 0          # cached, not given back
    assert r.empty_cache() > 0
    assert r.reserved_nbytes == 0
    r.close()
    with pytest.raises((DeviceClosedError, InvalidArgumentError), match="closed"):
        r.allocate(1)


def test_layers_refuse_a_source_that_is_no_resource(dev):
    with pytest.raises(InvalidArgumentError, match="MemoryResource"):
        StatisticsLayer(dev)


def test_statistics_layer(base):
    s = StatisticsLayer(base)
    a = s.allocate(3 * MiB)
    b = s.allocate(5 * MiB)
    s.deallocate(a, 3 * MiB)
    st = s.statistics()
    assert (st.current_nbytes, st.peak_nbytes, st.total_nbytes) == (5 * MiB, 8 * MiB, 8 * MiB)
    assert (st.current_count, st.peak_count, st.total_count, st.n_deallocations) == (1, 2, 2, 1)
    s.reset_peak()
    assert s.statistics().peak_nbytes == 5 * MiB
    with pytest.raises(InvalidPointerError):
        s.deallocate(a, 3 * MiB)
    assert s.statistics() == st.__class__(**{**st.__dict__, "peak_nbytes": 5 * MiB, "peak_count": 1})
    s.deallocate(b, 5 * MiB)


def test_statistics_count_refusals(base, dev):
    s = StatisticsLayer(base)
    with pytest.raises(OutOfMemoryError):
        s.allocate(dev.properties().total_nbytes * 2)
    st = s.statistics()
    assert st.n_failures == 1 and st.current_nbytes == 0 and st.total_count == 0


def test_limiting_layer_refuses_and_changes_nothing(base, dev):
    lim = LimitingLayer(base, 10 * MiB)
    a = lim.allocate(6 * MiB)
    n_dev = dev.n_allocations
    with pytest.raises(OutOfMemoryError, match="Refused by the limit") as err:
        lim.allocate(5 * MiB)
    assert err.value.limit_nbytes == 10 * MiB and err.value.requested_nbytes == 5 * MiB
    assert lim.used_nbytes == 6 * MiB and dev.n_allocations == n_dev
    b = lim.allocate(4 * MiB)                        # exactly up to the limit
    lim.deallocate(a, 6 * MiB)
    lim.deallocate(b, 4 * MiB)
    assert lim.used_nbytes == 0
    with pytest.raises(InvalidArgumentError, match="limit_nbytes"):
        LimitingLayer(base, 0)


def test_limiting_layer_gives_back_its_claim_when_upstream_fails(dev):
    lim = LimitingLayer(DeviceResource(dev), 1 << 40)   # a limit past the device
    with pytest.raises(OutOfMemoryError):
        lim.allocate(dev.properties().total_nbytes + 1)
    assert lim.used_nbytes == 0


def test_tracking_layer(base):
    t = TrackingLayer(base, capture_stacks=True)
    with region("load"):
        p = t.allocate(2 * MiB)
    bid = t.buffer_id(p)
    info = t.tracker.get(bid)
    assert (info.nbytes, info.region, info.ptr, info.location) == (2 * MiB, "load", p, Location.GPU)
    assert info.stack and "test_layers.py" in info.site()
    t.deallocate(p, 2 * MiB)
    assert len(t.tracker) == 0
    with pytest.raises(InvalidPointerError):
        t.buffer_id(p)
    with pytest.raises(InvalidArgumentError, match="AllocationTracker"):
        TrackingLayer(base, tracker=object())


def test_logging_layer(base, caplog):
    lg = LoggingLayer(base, level=logging.INFO)
    with caplog.at_level(logging.DEBUG, logger="gpumem.managers.layers"):
        p = lg.allocate(1 * MiB)
        lg.deallocate(p, 1 * MiB)
        with pytest.raises(OutOfMemoryError):
            lg.allocate(1 << 40)
    text = caplog.text
    assert f"allocate {MiB} align=256 stream=0 -> {p:#x}" in text
    assert f"deallocate {p:#x} {MiB}" in text
    assert f"allocate {1 << 40} align=256 stream=0 failed" in text
    with pytest.raises(InvalidArgumentError):
        LoggingLayer(base, logger="x")


def test_logging_layer_writes_an_rmm_log_gpumem_reads(dev, tmp_path):
    from gpumem.trace import load_trace

    path = tmp_path / "mr.csv"
    lg = LoggingLayer(LimitingLayer(make_allocator(dev), 64 * MiB), csv_path=path)
    ptrs = [lg.allocate(n * MiB) for n in (1, 2, 3)]
    lg.deallocate(ptrs[1], 2 * MiB)
    with pytest.raises(OutOfMemoryError):
        lg.allocate(100 * MiB)
    lg.close()
    assert path.read_text().splitlines()[0] == "Thread,Time,Action,Pointer,Size,Stream"
    trace = load_trace(path)
    assert trace.n_allocs == 3 and trace.n_failed_allocs == 1 and trace.n_live_at_end == 2
    assert sorted(trace.nbytes[trace.kinds == 0].tolist()) == [MiB, 2 * MiB, 3 * MiB]
    with pytest.raises(InvalidArgumentError, match="csv_path"):
        LoggingLayer(DeviceResource(dev), csv_path=3)


def test_failure_callback_frees_and_retries(dev):
    base = make_allocator(dev, "bestfit", limit=64 * MiB)
    calls = []

    def cb(nbytes, exc):
        calls.append((nbytes, type(exc).__name__))

    fc = FailureCallbackLayer(base, [cb, base.empty_cache])
    p = fc.allocate(40 * MiB)
    fc.deallocate(p, 40 * MiB)                      # 40 MiB stay cached in a segment
    q = fc.allocate(50 * MiB)   # needs the cache given back (by the allocator's own retry or the callbacks)
    assert all(c == (50 * MiB, "OutOfMemoryError") for c in calls)
    fc.deallocate(q, 50 * MiB)
    with pytest.raises(OutOfMemoryError):
        fc.allocate(100 * MiB)                      # past the limit: retried once, then raised
    assert fc.n_failures >= 1
    base.close()


def test_failure_callback_recovers_with_a_releasing_callback(dev):
    inner = LimitingLayer(DeviceResource(dev), 10 * MiB)
    hog = inner.allocate(8 * MiB)
    released = []

    def release():
        inner.deallocate(hog, 8 * MiB)
        released.append(True)

    fc = FailureCallbackLayer(inner, [release])
    p = fc.allocate(6 * MiB)
    assert released == [True] and (fc.n_failures, fc.n_recovered) == (1, 1)
    fc.deallocate(p, 6 * MiB)


def test_failure_callback_that_raises_is_logged(dev, caplog):
    inner = LimitingLayer(DeviceResource(dev), MiB)

    def broken(nbytes, exc):
        raise RuntimeError("boom")

    fc = FailureCallbackLayer(inner, [broken], max_retries=2)
    with caplog.at_level(logging.WARNING), pytest.raises(OutOfMemoryError):
        fc.allocate(2 * MiB)
    assert caplog.text.count("boom") == 2
    with pytest.raises(InvalidArgumentError):
        FailureCallbackLayer(inner, [42])
    with pytest.raises(InvalidArgumentError):
        FailureCallbackLayer(inner, max_retries=-1)


@pytest.mark.parametrize("pooled", [False, True])
def test_full_stack(dev, pooled, caplog):
    base = make_allocator(dev) if pooled else DeviceResource(dev)
    tracker = AllocationTracker()
    top = LoggingLayer(TrackingLayer(StatisticsLayer(LimitingLayer(AlignmentLayer(
        FailureCallbackLayer(base, [base.empty_cache])), 32 * MiB)), tracker))
    assert [type(r).__name__ for r in stack_layers(top)] == [
        "LoggingLayer", "TrackingLayer", "StatisticsLayer", "LimitingLayer", "AlignmentLayer",
        "FailureCallbackLayer", type(base).__name__]
    stats = find_layer(top, StatisticsLayer)
    with region("a"):
        ptrs = [top.allocate(4 * MiB, 512) for _ in range(7)]
    with pytest.raises(OutOfMemoryError):
        top.allocate(8 * MiB)
    assert stats.statistics().current_nbytes == 28 * MiB
    assert tracker.region_stats("a").live_nbytes == 28 * MiB
    for p in ptrs:
        top.deallocate(p, 4 * MiB, 512)
    assert stats.statistics().current_nbytes == 0 and len(tracker) == 0
    assert isinstance(top, MemoryResource) and top.device is dev
    top.close()
    assert dev.n_allocations == 0


def test_limit_refusal_makes_no_device_call_under_its_lock():
    # the refusal called memory_info() with the layer's lock held; that device call delivered a due
    # memory event to a PressureMonitor whose callback allocated through the same manager -> the thread
    # waited for itself and every later allocate blocked
    import threading

    from gpumem import sim
    from gpumem.managers import GpuMemoryManager, MemoryConfig, PressureMonitor
    from gpumem.units import GiB

    calls = []

    def setup(at_s):
        d = gpumem.open_device("sim:t4-16gb", pressure=sim.Step(12 * GiB, at_s=at_s))
        m = GpuMemoryManager(d, config=MemoryConfig(gpu_memory_fraction=0.1))
        m.allocate(m.usable_memory - MiB)

        def cb(change):
            calls.append(change)
            m.deallocate(m.allocate(4096))
        mon = PressureMonitor(d, callbacks=[cb], interval_s=60).start()
        return d, m, mon

    d, m, mon = setup(1e9)
    mon.stop()
    t0 = d.now_s                                          # the deterministic clock after setup
    m.close(); d.close()
    d, m, mon = setup(t0 + 1e-9)                          # the tenant arrives during the next device call
    raised = []

    def over_limit():
        try:
            m.allocate(2 * MiB)
        except OutOfMemoryError as e:
            raised.append(e)
    t = threading.Thread(target=over_limit, daemon=True)
    t.start()
    t.join(10)
    alive = t.is_alive()
    if alive:
        mon._stop_event.set()
    assert not alive, "allocate deadlocked on the limit layer's lock"
    assert calls and len(raised) == 1 and "Refused by" in str(raised[0])
    a = m.allocate(4096)                                  # the manager still works
    m.deallocate(a)
    mon.stop()
    m.close(); d.close()
