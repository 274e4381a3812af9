"""The engine's own time in the simulated clock (Note [The engine's own time] in gpumem.sim.latency): the engine
tells the device how many pages it indexes before a steal, and the simulator lets that time pass."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gpumem import InvalidArgumentError, MiB
from gpumem.allocator import make_allocator
from gpumem.native import load_engine
from gpumem.sim import FaultPlan, LatencyModel, SimDevice, get_profile

US = 1e-6
ENGINES = ["python"] + (["native"] if load_engine() is not None else [])


def _device(**latency) -> SimDevice:
    profile = get_profile("h200-141gb")
    return SimDevice(dataclasses.replace(profile, latency=LatencyModel(**latency)))


def test_the_cost_is_a_log_of_the_pages():
    lat = LatencyModel()
    assert lat.engine_index_cost_us(0) == 0.0
    assert lat.engine_index_cost_us(274) == pytest.approx(17.1 * math.log(2))
    # far less than in proportion: 36 ns a page at a few hundred, under 5 at 17,000 (the call logs' shape)
    assert lat.engine_index_cost_us(261) / 261 > 0.03
    assert lat.engine_index_cost_us(17_000) / 17_000 < 0.005
    assert LatencyModel(engine_index_us=0.0).engine_index_cost_us(10_000) == 0.0


def test_engine_work_lets_the_time_pass_and_is_no_device_call():
    dev = _device()
    try:
        calls = dict(dev._calls)  # noqa: SLF001 - the device's call counts
        busy_us = dev.stats.busy_us
        t0 = dev.now_s
        dev.engine_work(274)
        assert (dev.now_s - t0) / US == pytest.approx(17.1 * math.log(2))
        assert dev._calls == calls and dev.stats.busy_us == busy_us  # noqa: SLF001
        t1 = dev.now_s
        dev.engine_work(0)
        assert dev.now_s == t1
    finally:
        dev.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None, 2**70 * 1.0, 2**63, 2**1100])
def test_engine_work_refuses_what_is_not_a_count(bad):
    dev = _device()
    try:
        t0 = dev.now_s
        with pytest.raises(InvalidArgumentError, match="engine_work: pages_indexed"):
            dev.engine_work(bad)
        assert dev.now_s == t0
    finally:
        dev.close()


def test_any_integer_type_is_a_count_and_the_cost_checks_its_argument():
    dev = _device()
    try:
        t0 = dev.now_s
        dev.engine_work(np.int64(274))  # as every device call takes any integer type (attacker 38)
        assert (dev.now_s - t0) / US == pytest.approx(17.1 * math.log(2))
    finally:
        dev.close()
    lat = LatencyModel()
    for bad in (-5, -274, True, math.nan, 2**63):
        with pytest.raises(InvalidArgumentError, match="engine_index_cost_us: pages_indexed"):
            lat.engine_index_cost_us(bad)


def test_engine_work_on_a_closed_device_does_nothing():
    dev = _device()
    t0 = dev.now_s
    dev.close()
    dev.engine_work(10_000)  # the engine's work, not the device's: nothing to refuse
    assert dev.now_s == t0


def test_the_largest_walk_keeps_the_clock_finite():
    dev = _device(engine_index_us=2e10, engine_index_pages=1)
    try:
        dev.engine_work(2**63 - 1)  # the most a model allows: about 10 days of simulated time
        assert math.isfinite(dev.now_s) and dev.now_s > 0
    finally:
        dev.close()


@pytest.mark.parametrize("field, value", [("engine_index_us", -1.0), ("engine_index_us", math.inf),
                                          ("engine_index_us", math.nan), ("engine_index_us", True),
                                          ("engine_index_pages", 0.0), ("engine_index_pages", -5.0),
                                          ("engine_index_pages", math.nan), ("engine_index_pages", "274"),
                                          ("engine_index_pages", 0.5), ("engine_index_pages", 5e-324),
                                          ("engine_index_us", 2**1024), ("engine_index_us", 1e300),
                                          ("busy_factor_base", 2**1024)])
def test_the_latency_model_refuses_bad_engine_constants(field, value):
    with pytest.raises(InvalidArgumentError, match=f"LatencyModel.{field}"):
        LatencyModel(**{field: value})


@pytest.mark.parametrize("engine", ENGINES)
def test_a_steal_reports_the_pages_freed_since_the_last_look(engine):
    dev = _device()
    seen: list[int] = []
    real = dev.engine_work

    def record(n: int) -> None:
        seen.append(n)
        real(n)

    dev.engine_work = record  # type: ignore[method-assign]
    alloc = make_allocator(dev, "gpumem", engine=engine)
    try:
        a = alloc.allocate(64 * MiB)
        alloc.allocate(1 * MiB)
        alloc.free(a)  # 32 pages of 2 MiB fall empty: indexed at the next steal
        t0 = dev.now_s
        alloc.allocate(128 * MiB)  # past the slack: steals a's pages
        assert seen and seen[0] >= 32
        assert all(n > 0 for n in seen)
        assert (dev.now_s - t0) / US >= sum(dev.latency.engine_index_cost_us(n) for n in seen)
    finally:
        alloc.close()
        dev.close()


def test_both_engines_report_the_same_work():
    if len(ENGINES) < 2:
        pytest.skip("the native engine is not built")
    found = []
    for engine in ENGINES:
        dev = _device()
        seen: list[int] = []
        real = dev.engine_work
        dev.engine_work = lambda n, _seen=seen, _real=real: (_seen.append(n), _real(n))[1]  # type: ignore[method-assign]
        alloc = make_allocator(dev, "gpumem", engine=engine)
        try:
            live = [alloc.allocate((i % 7 + 1) * 8 * MiB) for i in range(40)]
            for p in live[::2]:
                alloc.free(p)
            live = [alloc.allocate(96 * MiB) for _ in range(8)]
            found.append((seen, dev.now_s))
        finally:
            alloc.close()
            dev.close()
    assert found[0] == found[1] and found[0][0]


class _StandIn:
    """A device proxy that forwards everything but ``engine_work`` (a stand-in written before it existed)."""

    def __init__(self, dev: SimDevice) -> None:
        self._dev = dev

    def __getattr__(self, name: str):
        if name == "engine_work":
            raise AttributeError(name)
        return getattr(self._dev, name)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_device_without_engine_work_is_not_told(engine):
    """Both engines skip a device that has no engine_work (new user 38: the Python engine raised AttributeError)."""
    dev = _device()
    alloc = make_allocator(_StandIn(dev), "gpumem", engine=engine)
    try:
        a = alloc.allocate(64 * MiB)
        alloc.allocate(1 * MiB)
        alloc.free(a)
        alloc.allocate(128 * MiB)  # a steal: the index refreshed, nobody told
        alloc.check_consistency()
    finally:
        alloc.close()
        dev.close()


def test_a_lost_device_ignores_engine_work():
    dev = SimDevice(get_profile("h200-141gb"), faults=FaultPlan(device_lost_at_s=0.001))
    try:
        dev.advance(0.002)  # lost meanwhile
        t0 = dev.now_s
        dev.engine_work(1_000)  # the engine's time, not the device's: no DeviceLostError, no time
        assert dev.now_s == t0
    finally:
        dev.close()


class _RaisingProperty(SimDevice):
    @property
    def engine_work(self):  # type: ignore[override]
        raise RuntimeError("engine_work cannot be read")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("how", ["none", "raising"])
def test_both_engines_decide_once_whether_the_device_is_told(engine, how):
    """An engine_work that is None or cannot be read counts as none, in both engines alike (re-check 38)."""
    profile = get_profile("h200-141gb")
    if how == "none":
        dev = SimDevice(profile)
        dev.engine_work = None  # type: ignore[assignment]
    else:
        dev = _RaisingProperty(profile)
    alloc = make_allocator(dev, "gpumem", engine=engine)
    try:
        a = alloc.allocate(64 * MiB)
        alloc.allocate(1 * MiB)
        alloc.free(a)
        alloc.allocate(128 * MiB)  # a steal: nobody told, no error
        alloc.check_consistency()
    finally:
        alloc.close()
        dev.close()


def test_the_latency_model_takes_numpy_numbers():
    lat = LatencyModel(engine_index_us=np.float32(17.1), engine_index_pages=np.int64(274))
    assert lat.engine_index_cost_us(274) == pytest.approx(17.1 * math.log(2), rel=1e-6)
    with pytest.raises(InvalidArgumentError, match="LatencyModel.engine_index_pages"):
        LatencyModel(engine_index_pages=np.True_)
