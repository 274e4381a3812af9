"""Note [A busy device prices VMM calls higher]: the busy-device terms of the latency model, and the device
pricing each VMM call by whether work is queued and how many mappings it holds."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import InvalidArgumentError, MiB
from gpumem.errors import MappingError
from gpumem.sim import LatencyModel, SimDevice, get_profile
from gpumem.sim.latency import BUSY_PRICED_CALLS, MEASURED_BUSY_FACTOR_BASE, MEASURED_BUSY_FACTOR_PER_DECADE

US = 1e-6
GRAN = 2 * MiB

factors = st.floats(1.0, 10.0, allow_nan=False)
per_decade = st.floats(0.0, 5.0, allow_nan=False)
mappings = st.integers(0, 10**7)


def _device(latency: LatencyModel) -> SimDevice:
    return SimDevice(dataclasses.replace(get_profile("h200-141gb"), latency=latency))


def _cost_us(dev: SimDevice, fn) -> float:
    t0 = dev.now_s
    fn()
    return (dev.now_s - t0) / US


def test_the_default_prices_every_call_idle_and_as_measured_holds_the_fit():
    assert LatencyModel().busy_factor(0) == LatencyModel().busy_factor(10**6) == 1.0
    m = LatencyModel.as_measured()
    assert m.busy_factor_base == MEASURED_BUSY_FACTOR_BASE
    assert m.busy_factor_per_decade == MEASURED_BUSY_FACTOR_PER_DECADE
    assert m.busy_factor(3000) == pytest.approx(1.18 + 0.33 * math.log10(3001))
    assert LatencyModel.as_measured(mem_map_us=5.0).mem_map_us == 5.0


@given(base=factors, slope=per_decade, a=mappings, b=mappings)
def test_the_factor_is_at_least_one_and_never_lower_with_more_mappings(base, slope, a, b):
    lat = LatencyModel(busy_factor_base=base, busy_factor_per_decade=slope)
    lo, hi = sorted((a, b))
    assert 1.0 <= lat.busy_factor(lo) <= lat.busy_factor(hi)


@pytest.mark.parametrize("knob,bad", [("busy_factor_base", 0.99), ("busy_factor_base", math.nan),
                                      ("busy_factor_base", math.inf), ("busy_factor_base", True),
                                      ("busy_factor_base", "2"), ("busy_factor_per_decade", -0.01),
                                      ("busy_factor_per_decade", math.inf), ("busy_factor_per_decade", None)])
def test_bad_terms_are_refused(knob, bad):
    with pytest.raises(InvalidArgumentError, match=knob):
        LatencyModel(**{knob: bad})


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_a_bad_mapping_count_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="n_mappings"):
        LatencyModel.as_measured().busy_factor(bad)


def _held(dev: SimDevice, n: int) -> tuple[int, object]:
    """``n`` one-page mappings held in a reservation of their own, and a spare chunk with a free page to map."""
    va = dev.address_reserve((n + 1) * GRAN)
    for i in range(n):
        h = dev.mem_create(GRAN)
        dev.mem_map(va + i * GRAN, GRAN, h)
        dev.mem_release(h)
    spare = dev.mem_create(GRAN)
    return va + n * GRAN, spare


def _steal_us(dev: SimDevice, va: int, h) -> float:
    """Map, set access and unmap one page: the three calls of a steal."""
    def steal():
        dev.mem_map(va, GRAN, h)
        dev.mem_set_access(va, GRAN)
        dev.mem_unmap(va, GRAN)
    return _cost_us(dev, steal)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 40), more=st.integers(1, 40))
def test_a_steal_costs_more_busy_than_idle_and_more_with_more_mappings(n, more):
    lat = LatencyModel.as_measured()
    costs = {}
    for held in (n, n + more):
        dev = _device(lat)
        va, h = _held(dev, held)
        idle_us = _steal_us(dev, va, h)
        dev.launch(0, 1.0)  # a second of work queued: every call below meets a busy device
        busy_us = _steal_us(dev, va, h)
        assert busy_us >= idle_us
        # map at `held`, set access and unmap at `held + 1` mappings
        want = (lat.mem_map_us * lat.busy_factor(held)
                + lat.mem_set_access_cost_us(1, GRAN) * lat.busy_factor(held + 1)
                + lat.mem_unmap_cost_us(1, GRAN) * lat.busy_factor(held + 1))
        assert busy_us == pytest.approx(want)
        assert idle_us == pytest.approx(lat.mem_map_us + lat.mem_set_access_cost_us(1, GRAN)
                                        + lat.mem_unmap_cost_us(1, GRAN))
        assert dev.n_mappings == held
        dev.check_invariants()
        costs[held] = busy_us
        dev.close()
    assert costs[n] <= costs[n + more]


def test_every_busy_priced_call_pays_the_factor_and_others_do_not():
    lat = LatencyModel.as_measured(busy_factor_per_decade=0.0, busy_factor_base=2.0)
    dev = _device(lat)
    dev.launch(0, 1.0)
    assert _cost_us(dev, lambda: dev.address_reserve(GRAN)) == pytest.approx(2 * lat.address_reserve_us)
    assert _cost_us(dev, lambda: dev.mem_create(GRAN)) == pytest.approx(2 * lat.mem_create_cost_us(GRAN))
    assert _cost_us(dev, dev.mem_info) == pytest.approx(lat.mem_get_info_us)  # not a VMM call
    assert _cost_us(dev, lambda: dev.event_record(0)) == pytest.approx(lat.event_record_us)
    assert dev.stats.busy_priced_calls == 2
    assert set(dev.stats.cost_us) >= {"address_reserve", "mem_create", "mem_info", "event_record", "launch"}
    assert sum(dev.stats.cost_us.values()) == pytest.approx(dev.stats.busy_us)
    assert "mem_create" in BUSY_PRICED_CALLS and "malloc" not in BUSY_PRICED_CALLS


def test_the_default_model_counts_busy_calls_but_prices_them_idle():
    lat = LatencyModel()
    dev = _device(lat)
    va, h = _held(dev, 3)
    dev.launch(0, 1.0)
    assert _steal_us(dev, va, h) == pytest.approx(lat.mem_map_us + lat.mem_set_access_cost_us(1, GRAN)
                                                  + lat.mem_unmap_cost_us(1, GRAN))
    assert dev.stats.busy_priced_calls == 3


def test_a_call_that_waits_for_the_device_pays_the_idle_price():
    lat = LatencyModel.as_measured(waits_for_device=("mem_unmap",))
    dev = _device(lat)
    va, h = _held(dev, 10)
    dev.mem_map(va, GRAN, h)
    dev.launch(0, 0.001)
    cost_us = _cost_us(dev, lambda: dev.mem_unmap(va, GRAN))  # the queued millisecond, then the idle price
    assert cost_us == pytest.approx(0.001 / US + lat.mem_unmap_cost_us(1, GRAN))
    assert dev.stats.device_waits == 1


def test_a_failed_map_changes_no_count():
    dev = _device(LatencyModel.as_measured())
    va, h = _held(dev, 2)
    dev.mem_map(va, GRAN, h)
    with pytest.raises(MappingError):
        dev.mem_map(va, GRAN, h)  # already mapped there
    assert dev.n_mappings == 3
    dev.check_invariants()
