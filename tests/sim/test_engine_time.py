"""The engine's own time in the simulated clock (Note [The engine's own time] in gpumem.sim.latency): the engine
tells the device how many pages it indexes before a steal, and the simulator lets that time pass."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpumem import InvalidArgumentError, MiB
from gpumem.allocator import make_allocator
from gpumem.native import load_engine
from gpumem.sim import LatencyModel, SimDevice, get_profile

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


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None, 2**70 * 1.0])
def test_engine_work_refuses_what_is_not_a_count(bad):
    dev = _device()
    try:
        t0 = dev.now_s
        with pytest.raises(InvalidArgumentError, match="engine_work: pages_indexed"):
            dev.engine_work(bad)
        assert dev.now_s == t0
    finally:
        dev.close()


def test_engine_work_on_a_closed_device_does_nothing():
    dev = _device()
    t0 = dev.now_s
    dev.close()
    dev.engine_work(10_000)  # the engine's work, not the device's: nothing to refuse
    assert dev.now_s == t0


def test_a_huge_count_cannot_make_the_clock_infinite():
    dev = _device(engine_index_us=1e300, engine_index_pages=1e-300)
    try:
        t0 = dev.now_s
        dev.engine_work(2**62)
        assert math.isfinite(dev.now_s) and dev.now_s == t0
    finally:
        dev.close()


@pytest.mark.parametrize("field, value", [("engine_index_us", -1.0), ("engine_index_us", math.inf),
                                          ("engine_index_us", math.nan), ("engine_index_us", True),
                                          ("engine_index_pages", 0.0), ("engine_index_pages", -5.0),
                                          ("engine_index_pages", math.nan), ("engine_index_pages", "274")])
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
