"""MultiGpuMemoryManager: placement by headroom, affinity, spill, refusal naming every device, bad input,
threads, and a Hypothesis state machine; on unequal simulated devices."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

import gpumem
from gpumem import sim
from gpumem.errors import InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from gpumem.managers.multi import MultiGpuMemoryManager, MultiGpuOutOfMemoryError
from gpumem.managers.pressure import MemoryPressure, PressureMonitor
from test_multi_helpers import manager_factories

GiB = gpumem.GiB
MiB = gpumem.MiB
FACTORIES = manager_factories()


@pytest.fixture(params=sorted(FACTORIES))
def factory(request):
    return FACTORIES[request.param]


def _multi(factory, *specs, **open_kw):
    devs = [gpumem.open_device(s, **open_kw) for s in specs]
    return MultiGpuMemoryManager(devs, manager_factory=factory), devs


def _close(multi, devs):
    multi.close()
    for d in devs:
        d.close()


def _no_overlap(multi):
    per: dict[int, list[tuple[int, int]]] = {}
    for i, a in multi.live_allocations():
        per.setdefault(i, []).append((a.ptr, a.ptr + a.nbytes))
    for ranges in per.values():
        ranges.sort()
        for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
            assert e0 <= s1, "overlapping allocations on one device"


def test_unequal_devices_fill_in_proportion_then_affinity_holds(factory):
    """Note [Placement policy]: both cards get work from the start, each in proportion to its usable
    memory (the first policy gave the 24 GB card nothing until the 80 GB one was 73 % full)."""
    multi, devs = _multi(factory, "sim:a10-24gb", "sim:a100-80gb")
    try:
        m0, m1 = multi.managers
        assert m1.usable_memory > m0.usable_memory
        i, a = multi.allocate_on_best_device(4 * GiB, "kv")
        assert i == 1  # 4 GiB is a smaller share of the 80 GB card
        placed = [0, 0]
        for _ in range(24):
            d, _x = multi.allocate_on_best_device(1 * GiB)
            placed[d] += 1
        assert placed[0] > 0 and placed[1] > 0  # the small card is not left idle
        stats = multi.get_memory_stats().devices
        shares = [stats[k].allocated_nbytes / stats[k].usable_nbytes for k in (0, 1)]
        # balanced: the shares differ by at most one allocation's share of the smaller card
        assert abs(shares[0] - shares[1]) <= 1 * GiB / m0.usable_memory
        # "kv" stays at home while it fits, even where the other card's share is lower
        j, b = multi.allocate_on_best_device(1 * GiB, "kv")
        assert j == 1 and multi.affinity("kv") == 1
        stats = multi.get_memory_stats()
        assert stats.allocated_nbytes == sum(x.nbytes for _, x in multi.live_allocations())
        assert stats.devices[1].n_tensor_names == 1 and stats.n_allocations == 24 + 2
        assert stats.total_nbytes == m0.total_memory + m1.total_memory
        _no_overlap(multi)
    finally:
        _close(multi, devs)


def test_equal_shares_tie_to_the_lower_index(factory):
    multi, devs = _multi(factory, "sim:a10-24gb", "sim:a10-24gb")
    try:
        assert [multi.allocate_on_best_device(1 * GiB)[0] for _ in range(4)] == [0, 1, 0, 1]
    finally:
        _close(multi, devs)


def test_a_full_device_spills_to_the_next_and_affinity_moves(factory):
    multi, devs = _multi(factory, "sim:gtx-1650-4gb", "sim:jetson-nano-2gb")
    try:
        i, a = multi.allocate_on_best_device(1 * GiB, "w")
        assert i == 0 and multi.affinity("w") == 0
        while multi.get_memory_stats().devices[0].headroom_nbytes >= 512 * MiB:
            multi.allocate_on_best_device(512 * MiB, "w")
        # device 0 cannot take 512 MiB more: "w" spills to device 1 and its affinity follows
        j, b = multi.allocate_on_best_device(512 * MiB, "w")
        assert j == 1 and multi.affinity("w") == 1
        assert multi.get_memory_stats().spills >= 1
        multi.forget("w")
        assert multi.affinity("w") is None
        _no_overlap(multi)
    finally:
        _close(multi, devs)


def test_a_device_that_refuses_is_skipped(factory):
    """An injected out-of-memory on the first choice: the allocation lands on the other device."""
    d0 = gpumem.open_device("sim:a100-80gb", faults=sim.FaultPlan(malloc_failure_rate=1.0))
    d1 = gpumem.open_device("sim:a10-24gb")
    multi = MultiGpuMemoryManager([d0, d1], manager_factory=factory)
    try:
        i, a = multi.allocate_on_best_device(64 * MiB, "x")
        assert i == 1 and multi.affinity("x") == 1 and multi.get_memory_stats().spills == 1
    finally:
        _close(multi, [d0, d1])


def test_when_nothing_fits_the_error_names_every_device_and_nothing_changes(factory):
    multi, devs = _multi(factory, "sim:jetson-nano-2gb", "sim:gtx-1650-4gb")
    try:
        keep = [multi.allocate_on_best_device(256 * MiB, f"t{k}") for k in range(4)]
        before = multi.get_memory_stats()
        live_before = multi.live_allocations()
        affinity_before = {f"t{k}": multi.affinity(f"t{k}") for k in range(4)}
        with pytest.raises(MultiGpuOutOfMemoryError) as info:
            multi.allocate_on_best_device(5 * GiB, "t0")
        err = info.value
        assert isinstance(err, OutOfMemoryError) and err.requested_nbytes == 5 * GiB
        text = str(err)
        for k, d in enumerate(devs):
            assert f"device {k} ({d.spec})" in text
        assert [r.index for r in err.refusals] == [0, 1] or sorted(r.index for r in err.refusals) == [0, 1]
        after = multi.get_memory_stats()
        assert after.allocated_nbytes == before.allocated_nbytes and after.n_allocations == before.n_allocations
        assert after.refused == before.refused + 1
        assert multi.live_allocations() == live_before
        assert {f"t{k}": multi.affinity(f"t{k}") for k in range(4)} == affinity_before
        for _, a in keep:
            multi.deallocate(a)
        assert multi.get_memory_stats().allocated_nbytes == 0
    finally:
        _close(multi, devs)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "1", None])
def test_bad_sizes_change_nothing(factory, size):
    multi, devs = _multi(factory, "sim:jetson-nano-2gb", "sim:gtx-1650-4gb")
    try:
        before = multi.get_memory_stats()
        with pytest.raises(InvalidArgumentError, match="size"):
            multi.allocate_on_best_device(size, "x")
        assert multi.get_memory_stats().allocated_nbytes == before.allocated_nbytes
        assert multi.affinity("x") is None
    finally:
        _close(multi, devs)


def test_bad_names_alignments_and_deallocations_change_nothing(factory):
    multi, devs = _multi(factory, "sim:jetson-nano-2gb", "sim:gtx-1650-4gb")
    try:
        i, a = multi.allocate_on_best_device(MiB, "x")
        for name in (3, "", b"x"):
            with pytest.raises(InvalidArgumentError, match="tensor_name"):
                multi.allocate_on_best_device(MiB, name)
        for alignment in (0, 3, -256, True):
            with pytest.raises(InvalidArgumentError, match="alignment"):
                multi.allocate_on_best_device(MiB, "y", alignment=alignment)
        with pytest.raises(InvalidPointerError):
            multi.deallocate(object())
        multi.deallocate(a)
        with pytest.raises(InvalidPointerError):
            multi.deallocate(a)  # twice
        with pytest.raises(InvalidArgumentError, match="device_index"):
            multi.manager(2)
        st_ = multi.get_memory_stats()
        assert st_.allocated_nbytes == 0 and st_.n_allocations == 0 and multi.affinity("y") is None
    finally:
        _close(multi, devs)


def test_bad_device_lists(factory):
    dev = gpumem.open_device("sim:jetson-nano-2gb")
    try:
        for bad, match in (([], "at least one"), ("sim:t4-16gb", "sequence"), (dev, "sequence"),
                           ([dev, dev], "twice"), ([1.5], "Device")):
            with pytest.raises(InvalidArgumentError, match=match):
                MultiGpuMemoryManager(bad, manager_factory=factory)
    finally:
        dev.close()


def test_default_factory_builds_gpumem_managers_from_specs():
    pytest.importorskip("gpumem.managers.manager")
    with MultiGpuMemoryManager(["sim:jetson-nano-2gb", "sim:t4-16gb"]) as multi:
        i, a = multi.allocate_on_best_device(8 * MiB, "x")
        assert i == 1
        multi.deallocate(a)


def test_threads_share_it_without_losing_or_overlapping_anything(factory):
    multi, devs = _multi(factory, "sim:gtx-1650-4gb", "sim:rtx-2060-6gb")
    errors = []

    def work(k):
        try:
            mine = []
            for n in range(60):
                _, a = multi.allocate_on_best_device((1 + (n * 7 + k) % 16) * MiB, f"thread{k}-{n % 3}")
                mine.append(a)
                if n % 3 == 2:
                    multi.deallocate(mine.pop(0))
            for a in mine:
                multi.deallocate(a)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        st_ = multi.get_memory_stats()
        assert st_.allocated_nbytes == 0 and st_.n_allocations == 0
    finally:
        _close(multi, devs)


def test_a_multi_manager_is_a_pressure_releaser(factory):
    multi, devs = _multi(factory, "sim:gtx-1650-4gb", "sim:rtx-2060-6gb")
    try:
        allocs = [multi.allocate_on_best_device(256 * MiB)[1] for _ in range(10)]
        for a in allocs:
            multi.deallocate(a)
        mon = PressureMonitor(devs[0], interval_s=1.0, hysteresis=0.0, releasers=[multi])
        total = devs[0].mem_info().total_nbytes
        mon.observe(int(total * 0.9))
        assert mon.level is MemoryPressure.HIGH and mon.stats().released_nbytes > 0
    finally:
        _close(multi, devs)


class MultiMachine(RuleBasedStateMachine):
    """Random allocations and frees over three unequal small devices: the books always add up."""

    live = Bundle("live")

    def __init__(self):
        super().__init__()
        specs = ("sim:jetson-nano-2gb", "sim:gtx-1650-4gb", "sim:jetson-nano-4gb")
        self.devs = [gpumem.open_device(s) for s in specs]
        factory = FACTORIES.get("GpuMemoryManager", FACTORIES["caching-stand-in"])
        self.multi = MultiGpuMemoryManager(self.devs, manager_factory=factory)
        self.sizes: dict[int, int] = {}
        self.last_home: dict[str, int] = {}

    @rule(target=live, mib=st.integers(1, 900), name=st.sampled_from([None, "a", "b", "c"]))
    def allocate(self, mib, name):
        before = self.multi.get_memory_stats()
        home = self.multi.affinity(name) if name else None
        try:
            i, a = self.multi.allocate_on_best_device(mib * MiB, name)
        except MultiGpuOutOfMemoryError:
            after = self.multi.get_memory_stats()
            assert after.allocated_nbytes == before.allocated_nbytes
            assert (self.multi.affinity(name) if name else None) == home
            return None
        if home is not None and before.devices[home].headroom_nbytes >= mib * MiB * 2:
            assert i == home  # plenty of room at home: it stays there
        if name:
            assert self.multi.affinity(name) == i
        return a

    @rule(a=consumes(live))
    def deallocate(self, a):
        if a is not None:
            self.multi.deallocate(a)

    @invariant()
    def books_add_up(self):
        st_ = self.multi.get_memory_stats()
        live = self.multi.live_allocations()
        assert st_.n_allocations == len(live)
        for d in st_.devices:
            assert d.allocated_nbytes == sum(a.nbytes for i, a in live if i == d.index)
            assert d.headroom_nbytes == d.usable_nbytes - d.allocated_nbytes
        _no_overlap(self.multi)

    def teardown(self):
        self.multi.close()
        for d in self.devs:
            d.close()


TestMultiMachine = MultiMachine.TestCase
TestMultiMachine.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)


def _lost_and_ok():
    lost = gpumem.open_device("sim:t4-16gb?lost_at_s=0.001")
    ok = gpumem.open_device("sim:t4-16gb")
    return lost, ok


def test_a_lost_device_is_refused_and_affinity_spills_to_a_healthy_one():
    # a name bound to a lost device got DeviceLostError; a small request was even served from the lost
    # device's cache
    lost, ok = _lost_and_ok()
    mm = MultiGpuMemoryManager([lost, ok])
    i, a = mm.allocate_on_best_device(1 << 20, "w")
    assert i == 0
    mm.deallocate(a)                                   # its block stays cached in device 0's pool
    lost.advance(0.01)
    for name, size in [("w", 1 << 20), ("w", 100 << 20), ("x", 1 << 20), (None, 1 << 20)]:
        j, b = mm.allocate_on_best_device(size, name)
        assert j == 1, (name, size)
        mm.deallocate(b)
    assert mm.affinity("w") == 1 and mm.affinity("x") == 1
    mm.close()
    lost.close(); ok.close()


def test_only_lost_devices_left_names_the_loss():
    lost = gpumem.open_device("sim:t4-16gb?lost_at_s=0.001")
    mm = MultiGpuMemoryManager([lost])
    lost.advance(0.01)
    with pytest.raises(MultiGpuOutOfMemoryError) as ei:
        mm.allocate_on_best_device(1 << 20, "w")
    assert ei.value.refusals[0].reason.startswith("lost:") and mm.affinity("w") is None
    mm.close()
    lost.close()


def test_memory_stats_report_a_lost_device_instead_of_failing():
    lost, ok = _lost_and_ok()
    mm = MultiGpuMemoryManager([lost, ok])
    i, a = mm.allocate_on_best_device(1 << 20, "w")
    lost.advance(0.01)
    st_ = mm.get_memory_stats()
    d0, d1 = st_.devices
    assert d0.lost is not None and "lost" in d0.lost and d0.detail is None and d0.free_nbytes == 0
    assert d0.allocated_nbytes == 1 << 20
    assert d1.lost is None and d1.detail is not None and d1.free_nbytes > 0
    mm.deallocate(a)
    mm.close()
    lost.close(); ok.close()


def test_an_allocation_on_device_1_says_device_index_1() -> None:
    """issue 20 item 12: an allocation placed on device 1 reported ``device_index=0``."""
    multi = MultiGpuMemoryManager(["sim:t4-16gb", "sim:t4-16gb"])
    try:
        placed = [multi.allocate_on_best_device(1 << 20) for _ in range(4)]
        assert {i for i, _ in placed} == {0, 1}
        for i, allocation in placed:
            assert allocation.device_index == i
        assert all(a.device_index == i for i, a in multi.live_allocations())
    finally:
        multi.close()
