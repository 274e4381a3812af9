"""Other tenants (pressure scenarios), memory events and free-level watching."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpumem import GiB, InvalidArgumentError, MiB
from gpumem.sim import (
    MemoryEventKind,
    PeriodicSpikes,
    Ramp,
    RandomArrivals,
    SimDevice,
    Step,
    TraceTenant,
    custom_profile,
    get_profile,
    preset,
)
from gpumem.sim.pressure import PRESET_NAMES, Scenario

K = MemoryEventKind
T4 = get_profile("t4-16gb")
BASE_FREE = T4.total_nbytes - T4.context_nbytes


def _free(dev) -> int:
    return dev._free_nbytes()  # noqa: SLF001 - reads the state without letting time pass


def _at(dev, t_s: float) -> int:
    dev.advance(t_s - dev.now_s)
    return _free(dev)


def _events(dev, *kinds):
    return [e for e in dev.events.history if e.kind in kinds]


def test_step_takes_and_gives_back():
    dev = SimDevice(T4, pressure=Step(nbytes=4 * GiB, at_s=0.01, until_s=0.02))
    assert _at(dev, 0.005) == BASE_FREE
    assert _at(dev, 0.015) == BASE_FREE - 4 * GiB
    assert dev.tenant_nbytes == 4 * GiB
    assert _at(dev, 0.025) == BASE_FREE
    took, returned = _events(dev, K.TENANT_TOOK), _events(dev, K.TENANT_RETURNED)
    assert [(e.time_s, e.nbytes, e.free_nbytes, e.source) for e in took] == \
        [(pytest.approx(0.01), 4 * GiB, BASE_FREE - 4 * GiB, "tenant-0")]
    assert [(e.time_s, e.nbytes, e.free_nbytes) for e in returned] == [(pytest.approx(0.02), 4 * GiB, BASE_FREE)]
    assert dev.mem_info().free_nbytes == BASE_FREE


def test_step_is_rounded_to_pages_and_can_hold_forever():
    dev = SimDevice(T4, pressure=Step(nbytes=3 * MiB + 1, at_s=0.0))
    assert _at(dev, 1.0) == BASE_FREE - 4 * MiB
    assert _at(dev, 100.0) == BASE_FREE - 4 * MiB  # no until_s: held for good


def test_ramp():
    ramp = Ramp(nbytes=1 * GiB, duration_s=0.1, steps=4, hold_s=0.05, start_s=0.01)
    dev = SimDevice(T4, pressure=ramp)
    q = 256 * MiB
    assert _at(dev, 0.005) == BASE_FREE
    assert _at(dev, 0.02) == BASE_FREE - q
    assert _at(dev, 0.045) == BASE_FREE - 2 * q
    assert _at(dev, 0.07) == BASE_FREE - 3 * q
    assert _at(dev, 0.1) == BASE_FREE - 4 * q
    assert _at(dev, 0.155) == BASE_FREE - 4 * q
    assert _at(dev, 0.165) == BASE_FREE
    assert len(_events(dev, K.TENANT_TOOK)) == 4
    [back] = _events(dev, K.TENANT_RETURNED)
    assert back.nbytes == 1 * GiB and back.time_s == pytest.approx(0.16)


def test_ramp_without_hold_keeps_its_memory():
    dev = SimDevice(T4, pressure=Ramp(nbytes=1 * GiB, duration_s=0.01, steps=2))
    assert _at(dev, 10.0) == BASE_FREE - 1 * GiB


def test_periodic_spikes():
    dev = SimDevice(T4, pressure=PeriodicSpikes(nbytes=512 * MiB, period_s=0.01, spike_s=0.002, count=3))
    for k in range(3):
        assert _at(dev, k * 0.01 + 0.001) == BASE_FREE - 512 * MiB
        assert _at(dev, k * 0.01 + 0.005) == BASE_FREE
    assert _at(dev, 0.5) == BASE_FREE
    assert len(_events(dev, K.TENANT_TOOK)) == 3 and len(_events(dev, K.TENANT_RETURNED)) == 3


def test_random_arrivals_are_seeded_and_settle():
    total = T4.total_nbytes
    scenario = RandomArrivals(rate_per_s=500.0, mean_hold_s=0.01, min_nbytes=total // 100, max_nbytes=total // 20,
                              until_s=0.2)

    def run(seed):
        dev = SimDevice(T4, pressure=scenario, seed=seed)
        samples = [_at(dev, t / 1000) for t in range(1, 200, 7)]
        return dev, samples

    dev, samples = run(1)
    assert min(samples) < BASE_FREE  # something arrived
    assert all(0 <= s <= BASE_FREE for s in samples)
    took = _events(dev, K.TENANT_TOOK)
    assert 50 < len(took) < 200  # about 100 arrivals in 0.2 s
    assert all(total // 100 <= e.nbytes <= total // 20 for e in took)
    assert run(1)[1] == samples
    assert run(2)[1] != samples
    assert _at(dev, 5.0) == BASE_FREE and dev.tenant_nbytes == 0  # every job ended


@dataclass
class FakeTrace:
    """What TraceTenant.from_trace reads: kinds (0 alloc, 1 free), alloc ids, sizes, times in µs."""

    kinds: list = field(default_factory=lambda: [0, 0, 1, 0, 1, 1])
    alloc_ids: list = field(default_factory=lambda: [0, 1, 0, 2, 1, 2])
    nbytes: list = field(default_factory=lambda: [100 * MiB, 50 * MiB, 100 * MiB, 30 * MiB, 50 * MiB, 30 * MiB])
    times_us: list = field(default_factory=lambda: [5000.0, 6000.0, 7000.0, 8000.0, 9000.0, 10000.0])


@pytest.mark.parametrize("start_s, scale", [(0.0, 1.0), (0.01, 1.0), (0.0, 2.0), (0.005, 0.5)])
def test_trace_tenant(start_s, scale):
    tenant = TraceTenant.from_trace(FakeTrace(), start_s=start_s, time_scale=scale)
    assert tenant.ops[0] == (0.0, 0, 100 * MiB, True)
    dev = SimDevice(T4, pressure=tenant)

    def t(ms):  # trace time (relative to its first op) -> device time, just after
        return start_s + ms * 1e-3 * scale + 1e-7

    assert _at(dev, t(0)) == BASE_FREE - 100 * MiB
    assert _at(dev, t(1)) == BASE_FREE - 150 * MiB
    assert _at(dev, t(2)) == BASE_FREE - 50 * MiB
    assert _at(dev, t(3)) == BASE_FREE - 80 * MiB
    assert _at(dev, t(4)) == BASE_FREE - 30 * MiB
    assert _at(dev, t(5)) == BASE_FREE
    assert [e.nbytes for e in _events(dev, K.TENANT_TOOK)] == [100 * MiB, 50 * MiB, 30 * MiB]


def test_trace_tenant_skips_frees_of_allocations_it_never_got():
    small = custom_profile("small-256mib", 256 * MiB, base="t4-16gb", context_nbytes=16 * MiB)
    trace = FakeTrace(kinds=[0, 0, 1, 1], alloc_ids=[0, 1, 1, 0], nbytes=[200 * MiB, 100 * MiB, 100 * MiB, 200 * MiB],
                      times_us=[0.0, 1000.0, 2000.0, 3000.0])
    dev = SimDevice(small, pressure=TraceTenant.from_trace(trace))
    base = small.total_nbytes - small.context_nbytes
    assert _at(dev, 0.0015) == base - 200 * MiB  # the 100 MiB allocation was denied
    [denied] = _events(dev, K.TENANT_DENIED)
    assert denied.nbytes == 100 * MiB and denied.free_nbytes == base - 200 * MiB
    assert _at(dev, 0.01) == base
    assert len(_events(dev, K.TENANT_RETURNED)) == 1


def test_tenant_that_cannot_fit_is_denied():
    dev = SimDevice(T4, pressure=Step(nbytes=T4.total_nbytes, at_s=0.001))
    assert _at(dev, 0.01) == BASE_FREE
    [denied] = _events(dev, K.TENANT_DENIED)
    assert denied.nbytes == T4.total_nbytes and denied.free_nbytes == BASE_FREE
    assert not _events(dev, K.TENANT_TOOK)


def test_process_memory_makes_a_tenant_denied():
    dev = SimDevice(T4, pressure=Step(nbytes=8 * GiB, at_s=0.01))
    ptr = dev.malloc(8 * GiB)
    assert _at(dev, 0.02) == BASE_FREE - 8 * GiB
    assert len(_events(dev, K.TENANT_DENIED)) == 1
    dev.free(ptr)


def test_watch_free_level():
    dev = SimDevice(T4, pressure=Step(nbytes=2 * GiB, at_s=0.01, until_s=0.02))
    level = BASE_FREE - 1 * GiB
    dev.watch_free_level(level)
    dev.watch_free_level(level)  # watching twice publishes once
    _at(dev, 0.03)
    below, above = _events(dev, K.FREE_BELOW), _events(dev, K.FREE_ABOVE)
    assert [(e.time_s, e.level_nbytes, e.free_nbytes, e.source) for e in below] == \
        [(pytest.approx(0.01), level, BASE_FREE - 2 * GiB, "tenant-0")]
    assert [(e.time_s, e.level_nbytes, e.free_nbytes) for e in above] == [(pytest.approx(0.02), level, BASE_FREE)]
    # the process's own allocations cross levels too
    ptr = dev.malloc(1 * GiB + 2 * MiB)
    assert _events(dev, K.FREE_BELOW)[-1].source == "process"
    dev.free(ptr)
    assert _events(dev, K.FREE_ABOVE)[-1].source == "process"
    assert len(_events(dev, K.FREE_BELOW)) == 2 and len(_events(dev, K.FREE_ABOVE)) == 2
    with pytest.raises(InvalidArgumentError):
        dev.watch_free_level(-1)


def test_subscribe_and_cancel():
    dev = SimDevice(T4, pressure=PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=0.005))
    seen = []
    sub = dev.subscribe(seen.append)
    _at(dev, 0.012)
    assert [e.kind for e in seen] == [K.TENANT_TOOK, K.TENANT_RETURNED, K.TENANT_TOOK]
    sub.cancel()
    sub.cancel()
    _at(dev, 0.05)
    assert len(seen) == 3
    assert len(dev.events.history) > 3


def test_several_tenants_and_add_tenant():
    dev = SimDevice(T4, pressure=[Step(nbytes=GiB, at_s=0.0), Step(nbytes=2 * GiB, at_s=0.0)])
    dev.add_tenant(Step(nbytes=3 * GiB, at_s=0.001), name="late")
    assert _at(dev, 0.01) == BASE_FREE - 6 * GiB
    assert {e.source for e in _events(dev, K.TENANT_TOOK)} == {"tenant-0", "tenant-1", "late"}
    with pytest.raises(InvalidArgumentError):
        dev.add_tenant("not a scenario")


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_move_free_memory(name):
    total = T4.total_nbytes
    dev = SimDevice(T4, pressure=preset(name, total), seed=3)
    samples = [_at(dev, t / 1000) for t in range(0, 150, 3)]
    assert min(samples) < BASE_FREE
    assert all(s >= 0 for s in samples)


def test_preset_unknown():
    with pytest.raises(InvalidArgumentError):
        preset("tsunami", GiB)


@pytest.mark.parametrize("make", [
    lambda: Step(nbytes=0),
    lambda: Step(nbytes=GiB, at_s=-1),
    lambda: Step(nbytes=GiB, at_s=2, until_s=1),
    lambda: Ramp(nbytes=GiB, duration_s=0),
    lambda: Ramp(nbytes=GiB, duration_s=1, steps=0),
    lambda: Ramp(nbytes=GiB, duration_s=1, start_s=-1),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=0.01),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0, spike_s=0.001),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=0.001, start_s=-1),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=0.001, count=-1),
    lambda: RandomArrivals(rate_per_s=0, mean_hold_s=1, min_nbytes=1, max_nbytes=2),
    lambda: RandomArrivals(rate_per_s=1, mean_hold_s=1, min_nbytes=10, max_nbytes=2),
    lambda: TraceTenant(ops=(), time_scale=0),
    lambda: TraceTenant(ops=(), start_s=-0.5),
])
def test_scenario_validation(make):
    with pytest.raises(InvalidArgumentError):
        make()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make", [
    lambda: Step(nbytes=GiB, at_s=NAN), lambda: Step(nbytes=GiB, at_s=INF), lambda: Step(nbytes=GiB, until_s=NAN),
    lambda: Step(nbytes=GiB, at_s=1e308, until_s=INF), lambda: Step(nbytes=NAN), lambda: Step(nbytes=1.5),
    lambda: Step(nbytes=True), lambda: Step(nbytes="1GiB"),
    lambda: Ramp(nbytes=GiB, duration_s=NAN), lambda: Ramp(nbytes=GiB, duration_s=1, hold_s=NAN),
    lambda: Ramp(nbytes=GiB, duration_s=1, hold_s=-1), lambda: Ramp(nbytes=GiB, duration_s=1, steps=2.5),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=INF, spike_s=0.001),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=NAN),
    lambda: PeriodicSpikes(nbytes=GiB, period_s=0.01, spike_s=0.001, count=1.5),
    lambda: RandomArrivals(rate_per_s=NAN, mean_hold_s=1, min_nbytes=1, max_nbytes=2),
    lambda: RandomArrivals(rate_per_s=1, mean_hold_s=INF, min_nbytes=1, max_nbytes=2),
    lambda: RandomArrivals(rate_per_s=1, mean_hold_s=1, min_nbytes=1.5, max_nbytes=2),
    lambda: RandomArrivals(rate_per_s=1, mean_hold_s=1, min_nbytes=1, max_nbytes=2, until_s=NAN),
    lambda: TraceTenant(ops=(), time_scale=NAN), lambda: TraceTenant(ops=(), start_s=INF),
])
def test_scenario_times_and_sizes_are_finite_numbers(make):
    """Review rv21a: the checks compared with ``<= 0``, which NaN passes: Step(nbytes=nan) made the device's
    tenant_nbytes NaN, Step(nbytes=1.5) a float, at_s=nan queued a SimPy timeout at time NaN (the tenant
    never ran, silently), and the unchecked fields (until_s, hold_s) took anything."""
    with pytest.raises(InvalidArgumentError):
        make()


def test_scenario_numbers_are_kept_as_ints_and_floats():
    import numpy as np

    step = Step(nbytes=np.int64(GiB), at_s=np.float32(0.5))
    assert type(step.nbytes) is int and type(step.at_s) is float
    dev = SimDevice(T4, pressure=step)
    assert _at(dev, 1.0) == BASE_FREE - GiB and type(dev.tenant_nbytes) is int


def test_a_give_returns_the_pages_of_its_take():
    """Each take is rounded to pages on its own; giving one back frees exactly its pages."""
    ops = [(0.0, 0, 1 * MiB, True), (0.0, 1, 1 * MiB, True), (0.0, 2, 3 * MiB, True),
           (0.001, 0, 1 * MiB, False), (0.002, 2, 3 * MiB, False), (0.003, 1, 1 * MiB, False)]
    dev = SimDevice(T4, pressure=TraceTenant(ops=ops))
    assert _at(dev, 0.0005) == BASE_FREE - 8 * MiB   # 2 + 2 + 4 MiB of pages
    assert _at(dev, 0.0015) == BASE_FREE - 6 * MiB   # the first 1 MiB allocation's page
    assert _at(dev, 0.0025) == BASE_FREE - 2 * MiB   # the 3 MiB allocation's two pages
    assert _at(dev, 0.0035) == BASE_FREE
    ramp = SimDevice(T4, pressure=Ramp(nbytes=3 * MiB, duration_s=0.003, steps=3, hold_s=0.001))
    assert _at(ramp, 0.0029) == BASE_FREE - 6 * MiB  # three 1 MiB steps, a page each
    assert _at(ramp, 0.0045) == BASE_FREE             # given back all at once


class _Takes(Scenario):
    """A scenario of its own that takes (or gives) ``amount`` at 1 ms."""

    def __init__(self, amount, give: bool = False) -> None:
        self.amount, self.give = amount, give

    def process(self, ctx):
        yield ctx.env.timeout(0.001)
        if self.give:
            ctx.take(GiB)
            ctx.give(self.amount)
        else:
            ctx.take(self.amount)


@pytest.mark.parametrize("amount, give", [(-4 * GiB, False), (1.5, False), (float("nan"), False), (True, False),
                                          ("1GiB", False), (-GiB, True), (float("nan"), True)])
def test_a_tenant_takes_and_gives_whole_bytes(amount, give):
    """Review rv21a: TenantContext.take/give (what a Scenario of one's own calls) took any value: take(-4 GiB)
    left the device with more free memory than it has."""
    dev = SimDevice(T4, pressure=_Takes(amount, give))
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        dev.advance(0.01)
    assert dev.tenant_nbytes == (GiB if give else 0)
    assert dev.mem_info().free_nbytes == BASE_FREE - dev.tenant_nbytes
