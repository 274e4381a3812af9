"""GpuMemoryManager on simulated profiles from 2 GB to 141 GB (and on a real GPU with --gpumem-device cuda:0)."""

from __future__ import annotations

import logging
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

import gpumem
from gpumem.errors import (DeviceClosedError, DeviceNotFoundError, InvalidArgumentError, InvalidPointerError,
                           OutOfMemoryError)
from gpumem.managers import Allocation, GpuMemoryManager, MemoryConfig, region
from gpumem.managers.reserve import compute_reserve
from gpumem.units import GiB, MiB

SMALL_TO_LARGE = ["sim:gtx-1050-2gb", "sim:jetson-nano-2gb", "sim:rtx-3060-12gb", "sim:a100-80gb", "sim:h200-141gb"]


def _state(m: GpuMemoryManager):
    dev = m.device
    return (m.get_detailed_stats(), dev.n_allocations, len(dev.mapping_ranges()), len(m.live_allocations()),
            len(m.tracker) if m.tracker is not None else None)


@pytest.mark.parametrize("spec", SMALL_TO_LARGE)
def test_attributes_add_up(spec):
    with GpuMemoryManager(spec) as m:
        mem = m.memory_info()
        assert m.total_memory == mem.total_nbytes == m.properties.total_nbytes
        assert m.reserved_memory + m.usable_memory == m.total_memory
        assert 0 < m.usable_memory < mem.free_nbytes
        assert m.reserved_memory >= m.reserve.nbytes
        # the fraction (0.9 by default) or the reserve, whichever keeps more
        assert m.usable_memory == min(mem.free_nbytes - m.reserve.emergency_nbytes,
                                      int(0.9 * m.total_memory) - m.reserve.context_nbytes)


def test_two_gb_card_gets_most_of_itself():
    with GpuMemoryManager("sim:gtx-1050-2gb", config=MemoryConfig.for_constrained()) as m:
        assert m.usable_memory > 0.85 * m.total_memory       # the seeds' rule left 61 %


def test_fraction_caps_usable():
    with GpuMemoryManager("sim:a100-80gb", config=MemoryConfig(gpu_memory_fraction=0.5)) as m:
        assert m.usable_memory == int(0.5 * m.total_memory) - m.reserve.context_nbytes


def test_fraction_below_what_is_in_use_leaves_nothing():
    with pytest.raises(OutOfMemoryError, match="nothing is usable"):
        GpuMemoryManager("sim:jetson-nano-2gb", config=MemoryConfig(gpu_memory_fraction=0.2))


@pytest.mark.parametrize("spec", ["sim:gtx-1050-2gb", "sim:h200-141gb"])
@pytest.mark.parametrize("pooling", [True, False])
def test_refuses_past_usable_and_changes_nothing(spec, pooling):
    with GpuMemoryManager(spec, enable_pooling=pooling) as m:
        a = m.allocate(m.usable_memory // 2, tag="half")
        before = _state(m)
        with pytest.raises(OutOfMemoryError, match="usable memory") as err:
            m.allocate(m.usable_memory - a.nbytes + 1)
        assert err.value.requested_nbytes == m.usable_memory - a.nbytes + 1
        after = _state(m)
        assert after[1:] == before[1:]
        assert after[0].allocated_nbytes == before[0].allocated_nbytes
        b = m.allocate(m.usable_memory - a.nbytes)            # exactly what is left fits
        m.deallocate(b)
        m.deallocate(a)


@pytest.mark.parametrize("bad,exc", [
    ((0,), InvalidArgumentError), ((-1,), InvalidArgumentError), ((1.5,), InvalidArgumentError),
    ((1024, 3), InvalidArgumentError), (("1MiB",), InvalidArgumentError),
])
def test_bad_allocate_arguments(bad, exc):
    with GpuMemoryManager("sim:gtx-1050-2gb") as m:
        before = _state(m)
        with pytest.raises(exc):
            m.allocate(*bad)
        with pytest.raises(InvalidArgumentError, match="tag"):
            m.allocate(1024, tag=7)
        assert _state(m)[1:] == before[1:]


def test_bad_deallocate_changes_nothing():
    with GpuMemoryManager("sim:t4-16gb") as m, GpuMemoryManager("sim:t4-16gb") as other:
        a = m.allocate(MiB)
        o = other.allocate(MiB)
        before = _state(m)
        with pytest.raises(InvalidPointerError):
            m.deallocate(o)
        with pytest.raises(InvalidArgumentError, match="Allocation"):
            m.deallocate(a.ptr)
        with pytest.raises(InvalidPointerError):
            m.deallocate(Allocation(a.ptr, a.nbytes + 1, a.buffer_id, a.device_index))
        assert _state(m)[1:] == before[1:]
        m.deallocate(a)
        with pytest.raises(InvalidPointerError):
            m.deallocate(a)
        other.deallocate(o)


def test_device_argument_forms():
    dev = gpumem.open_device("sim:t4-16gb")
    with GpuMemoryManager(dev) as m:
        assert m.device is dev
    assert not dev.closed                      # the caller owns it
    dev.close()
    with pytest.raises(DeviceClosedError):
        GpuMemoryManager(dev)
    m = GpuMemoryManager("sim:t4-16gb", device_index=3)
    assert m.allocate(512).device_index == 3
    m.close()
    assert m.device.closed                     # opened by the manager, closed by it
    for bad in (1.0, None, ["sim:t4-16gb"], True):
        with pytest.raises(InvalidArgumentError):
            GpuMemoryManager(bad)
    with pytest.raises(DeviceNotFoundError):
        GpuMemoryManager("sim:no-such-card")
    with pytest.raises(InvalidArgumentError):
        GpuMemoryManager("sim:t4-16gb", config={"gpu_memory_fraction": 0.5})
    with pytest.raises(InvalidArgumentError):
        GpuMemoryManager("sim:t4-16gb", enable_pooling="yes")


def test_missing_cuda_index_says_how_many(monkeypatch):
    from gpumem.cuda import nvml
    from gpumem.cuda.nvml import CudaDeviceSummary

    monkeypatch.setattr(nvml, "list_cuda_devices",
                        lambda: [CudaDeviceSummary(0, "NVIDIA H200", 150 * GiB, 149 * GiB, "GPU-1")])
    with pytest.raises(DeviceNotFoundError, match=r"index 4 does not exist: 1 CUDA device\(s\) found \(cuda:0"):
        GpuMemoryManager(4)
    monkeypatch.setattr(nvml, "list_cuda_devices", lambda: [])
    with pytest.raises(DeviceNotFoundError, match="0 CUDA device"):
        GpuMemoryManager(0)
    with pytest.raises(DeviceNotFoundError, match="0 CUDA device"):
        GpuMemoryManager(-1)


def test_pooling_off_allocates_straight_from_the_device():
    with GpuMemoryManager("sim:rtx-3060-12gb", enable_pooling=False) as m:
        a = m.allocate(3 * MiB)
        assert m.device.n_allocations == 1
        m.deallocate(a)
        assert m.device.n_allocations == 0
        assert m.empty_cache() == 0
        st = m.get_detailed_stats()
        assert st.pool is None and st.fragmentation_ratio == 0.0


def test_pooling_caches_and_empty_cache_gives_back():
    with GpuMemoryManager("sim:rtx-3060-12gb") as m:
        a = m.allocate(64 * MiB)
        m.deallocate(a)
        st = m.get_detailed_stats()
        assert st.allocated_nbytes == 0 and st.held_nbytes >= 64 * MiB and st.pool.cached_nbytes >= 64 * MiB
        assert m.empty_cache() >= 64 * MiB
        assert m.get_detailed_stats().held_nbytes == 0


def test_detailed_stats():
    with GpuMemoryManager("sim:t4-16gb") as m:
        with region("fwd"):
            a = m.allocate(100 * MiB, tag="act", n_elements=25 * MiB)
        b = m.allocate(10 * MiB)
        st = m.get_detailed_stats()
        assert st.device == "sim:t4-16gb" and st.device_name == "Tesla T4"
        assert st.allocated_nbytes == 110 * MiB and st.n_allocations == 2
        assert st.utilisation == pytest.approx(110 * MiB / m.usable_memory)
        assert st.free_nbytes == m.memory_info().free_nbytes
        assert st.pool.cache_misses >= 1 and 0 <= st.pool.hit_rate <= 1
        info = m.tracker.get(a.buffer_id)
        assert (info.region, info.tag, info.n_elements, info.ptr) == ("fwd", "act", 25 * MiB, a.ptr)
        assert m.tracker.region_stats("fwd").live_nbytes == 100 * MiB
        assert [(r.region, r.live_nbytes) for r in st.regions] == [("fwd", 100 * MiB)]
        m.deallocate(a)
        m.deallocate(b)
        m.reset_peak()
        assert m.get_detailed_stats().peak_allocated_nbytes == 0


def test_tracking_off():
    with GpuMemoryManager("sim:t4-16gb", config=MemoryConfig().with_tracking(False)) as m:
        a = m.allocate(MiB)
        assert a.buffer_id is None and m.tracker is None
        m.deallocate(a)


def test_fragmentation_warning(caplog):
    cfg = MemoryConfig(pool_policy="bestfit", fragmentation_warning=0.3)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        allocs = [m.allocate(4 * MiB) for _ in range(16)]
        for a in allocs[::2]:
            m.deallocate(a)
        with caplog.at_level(logging.INFO, logger="gpumem.managers.manager"):
            st = m.log_memory_usage()
        assert st.fragmentation_ratio > 0.3
        assert any(r.levelno == logging.WARNING and "fragmented" in r.getMessage() for r in caplog.records)
        caplog.clear()
        m.empty_cache()
        for a in allocs[1::2]:
            m.deallocate(a)
        m.empty_cache()
        with caplog.at_level(logging.INFO, logger="gpumem.managers.manager"):
            m.log_memory_usage()
        assert not any(r.levelno == logging.WARNING for r in caplog.records)
        assert "allocated of" in caplog.text


def test_preallocation_warms_the_pool():
    with GpuMemoryManager("sim:t4-16gb", config=MemoryConfig().with_preallocation(64 * MiB)) as m:
        st = m.get_detailed_stats()
        assert st.held_nbytes >= 64 * MiB and st.allocated_nbytes == 0
    dev = gpumem.open_device("sim:gtx-1050-2gb")
    cfg = MemoryConfig(leak_report_at_exit=True).with_preallocation(64 * MiB, 4 * GiB)
    with pytest.raises(InvalidArgumentError, match="preallocate"):
        GpuMemoryManager(dev, config=cfg)
    assert dev.n_allocations == 0 and not dev.mapping_ranges()   # the failed constructor gave everything back
    dev.close()


def test_closed_manager_refuses():
    m = GpuMemoryManager("sim:t4-16gb")
    a = m.allocate(MiB)
    m.close()
    m.close()
    for call in (lambda: m.allocate(1), lambda: m.deallocate(a), m.empty_cache, m.get_detailed_stats, m.memory_info):
        with pytest.raises(DeviceClosedError):
            call()
    assert m.allocated_nbytes == 0            # close() gave everything back (it said 256 before)


def test_threads_share_a_manager():
    with GpuMemoryManager("sim:a100-80gb") as m:
        errors = []

        def work(i):
            try:
                for k in range(50):
                    a = m.allocate((i + 1) * 4096 + k * 512, tag=f"t{i}")
                    m.deallocate(a)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        st = m.get_detailed_stats()
        assert st.allocated_nbytes == 0 and len(m.tracker) == 0


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600 * MiB), st.booleans()), max_size=25))
def test_never_past_usable(ops):
    with GpuMemoryManager("sim:gtx-1050-2gb", enable_pooling=False) as m:
        live = []
        for nbytes, free_one in ops:
            if free_one and live:
                m.deallocate(live.pop(0))
            try:
                live.append(m.allocate(nbytes))
            except OutOfMemoryError:
                assert sum(a.nbytes for a in live) + nbytes > m.usable_memory
            st = m.get_detailed_stats()
            assert st.allocated_nbytes == sum(a.nbytes for a in live) <= m.usable_memory
        for a in live:
            m.deallocate(a)


# -- the same suite on whatever --gpumem-device names (sims by default, cuda:0 on the H200) ---------------
def test_manager_on_the_device(device):
    with GpuMemoryManager(device) as m:
        r = compute_reserve(device.properties(), device.mem_info())
        assert m.reserve.emergency_nbytes >= r.emergency_nbytes
        a = m.allocate(8 * MiB, 4096, tag="data")
        device.write(a.ptr, b"gpumem" * 100)
        assert device.read(a.ptr, 600) == b"gpumem" * 100
        with pytest.raises(OutOfMemoryError):
            m.allocate(m.usable_memory)
        m.deallocate(a)
        assert m.get_detailed_stats().allocated_nbytes == 0


@pytest.mark.cuda
def test_cuda_index_opens_the_real_gpu(device_spec):
    index = int(device_spec.split(":")[1])
    with GpuMemoryManager(index) as m:
        assert m.device.spec == f"cuda:{index}" and m.device_index == index
        assert m.reserve.context_nbytes > 0
        a = m.allocate(64 * MiB)
        m.deallocate(a)
        assert m.empty_cache() >= 0


@pytest.mark.cuda
def test_cuda_missing_index_says_how_many(device_spec):
    from gpumem.cuda.nvml import list_cuda_devices

    n = len(list_cuda_devices())
    with pytest.raises(DeviceNotFoundError, match=f"{n} CUDA device"):
        GpuMemoryManager(n + 7)


class ManagerMachine(RuleBasedStateMachine):
    """The manager against a model: live allocations, bytes, never past usable, refusals change nothing."""

    allocs = Bundle("allocs")

    @initialize(spec=st.sampled_from(["sim:gtx-1050-2gb", "sim:jetson-nano-2gb", "sim:h200-141gb"]),
                pooling=st.booleans())
    def start(self, spec, pooling):
        self.m = GpuMemoryManager(spec, enable_pooling=pooling)
        self.live: dict[int, Allocation] = {}

    @rule(target=allocs, frac=st.floats(0.0001, 0.6), alignment=st.sampled_from([256, 4096, 1 << 21]))
    def allocate(self, frac, alignment):
        nbytes = max(1, int(self.m.usable_memory * frac))
        used = sum(a.nbytes for a in self.live.values())
        before = _state(self.m)
        try:
            a = self.m.allocate(nbytes, alignment)
        except OutOfMemoryError as exc:
            # past the usable memory, or (pooling) the pool's own limit: a segment split by a live block
            # cannot serve a new request of its size (Note [The pool's limit])
            assert used + nbytes > self.m.usable_memory or exc.limit_nbytes == self.m.pool_limit_nbytes
            after = _state(self.m)
            # what the program holds is unchanged; the pool may have given its cache back before failing
            assert after[3:] == before[3:] and after[0].allocated_nbytes == before[0].allocated_nbytes
            assert after[1] <= before[1] and after[2] <= before[2]
            return multiple()
        assert a.ptr % alignment == 0 and a.ptr not in self.live
        self.live[a.ptr] = a
        return a

    @rule(a=consumes(allocs))
    def deallocate(self, a):
        self.m.deallocate(a)
        del self.live[a.ptr]

    @rule(a=allocs)
    def deallocate_again_or_foreign(self, a):
        if a.ptr in self.live:
            return
        before = _state(self.m)
        with pytest.raises(InvalidPointerError):
            self.m.deallocate(a)
        assert _state(self.m)[1:] == before[1:]

    @rule()
    def empty_cache(self):
        assert self.m.empty_cache() >= 0

    @invariant()
    def figures_add_up(self):
        if not hasattr(self, "m"):
            return
        st_ = self.m.get_detailed_stats()
        assert st_.allocated_nbytes == sum(a.nbytes for a in self.live.values()) <= self.m.usable_memory
        assert st_.n_allocations == len(self.live) == len(self.m.tracker)
        if st_.pool is not None:
            assert st_.pool.reserved_nbytes <= self.m.pool_limit_nbytes

    def teardown(self):
        if hasattr(self, "m"):
            for a in list(self.live.values()):
                self.m.deallocate(a)
            self.m.close()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)


# -- the size-bucket pool under a manager ----------------------------------------------------------
@pytest.mark.parametrize("cap", [0, 2, 5])
def test_pool_policy_bucket_uses_the_bucket_pool_and_max_pooled_per_bucket(cap):
    """MemoryConfig.max_pooled_per_bucket used to do nothing and pool_policy="bucket" was refused."""
    from gpumem.allocator.bucket import BucketAllocator
    from gpumem.managers import MemoryConfig

    cfg = MemoryConfig(pool_policy="bucket", max_pooled_per_bucket=cap)
    with GpuMemoryManager("sim:t4-16gb", config=cfg) as m:
        assert isinstance(m._base, BucketAllocator)
        assert m._base.policy.max_pooled_per_bucket == cap
        held = [m.allocate(1000) for _ in range(4)]
        for a in held:
            m.deallocate(a)
        st = m.get_detailed_stats()
        assert st.pool.policy == "bucket" and st.allocated_nbytes == 0
        assert st.pool.cached_nbytes == min(cap, 4) * 1024  # 1000 B lands in the 1 KiB bucket
        again = m.allocate(1000)
        assert m.get_detailed_stats().pool.cache_hits == (1 if cap else 0)
        m.deallocate(again)
        assert m.empty_cache() >= 0 and m.get_detailed_stats().pool.cached_nbytes == 0


def test_pool_policy_bucket_refuses_past_usable_memory_and_falls_back():
    from gpumem.managers import MemoryConfig

    cfg = MemoryConfig(pool_policy="bucket", cpu_fallback_enabled=True)
    with GpuMemoryManager("sim:t4-16gb", config=cfg) as m:
        with pytest.raises(OutOfMemoryError):
            m.allocate(m.usable_memory + 1)
        buf = m.create_buffer(64, data=b"a" * 64)
        assert buf.on_gpu and buf.read() == b"a" * 64


def test_log_memory_usage_prints_when_logging_is_not_configured(monkeypatch, capsys):
    """Issue 20 item 7: without logging configured the INFO line was dropped: the call showed nothing."""
    import gpumem.managers.manager as manager_module

    mgr = GpuMemoryManager("sim:t4-16gb")
    try:
        monkeypatch.setattr(manager_module.log, "hasHandlers", lambda: False)
        st = mgr.log_memory_usage()
        err = capsys.readouterr().err
        assert err.startswith("gpumem: sim:t4-16gb: 0 B allocated of") and "fragmentation" in err
        assert st.device == "sim:t4-16gb"
    finally:
        mgr.close()


def test_tracking_keeps_the_entry_of_a_pointer_handed_out_again_during_a_free():
    """The race behind a rare failure of test_threads_share_a_manager: while one thread's free is in the
    allocator, another thread is handed the same pointer and tracked; the first thread's free must not then
    remove the second's entry (it removed it after the upstream free; now before)."""
    with GpuMemoryManager("sim:a100-80gb") as m:
        layer = m._tracking
        upstream = layer.upstream
        real_free = upstream.do_deallocate
        again = []

        def free_then_reallocate(ptr, nbytes, alignment, stream):
            real_free(ptr, nbytes, alignment, stream)
            if not again:   # "another thread", between the free and the entry's removal
                again.append(layer.do_allocate(nbytes, alignment, stream))

        upstream.do_deallocate = free_then_reallocate
        try:
            a = m.allocate(64 * 1024)
            m.deallocate(a)
        finally:
            del upstream.do_deallocate
        assert again and again[0] == a.ptr   # the same pointer came back
        assert layer.buffer_id(again[0]) is not None   # and it is still tracked
        layer.do_deallocate(again[0], 64 * 1024, a.alignment, a.stream)
